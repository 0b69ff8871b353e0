"""Ed25519 signatures: required and verified when the edge box is given a public key."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from edge.channels import generate_keypair
from edge.errors import EdgeError
from edge.integrity import sha256_bytes


def signed_pull(cli, channel: str, cell: str, dest: Path, public_key: Path):
    return cli(
        "pull", "--channel", channel, "--cell", cell, "--dest", dest, "--public-key", public_key
    )


def test_signed_bundle_is_accepted(publish, cli, keypair, channel, dest, cell):
    private, public = keypair
    bundle = publish(channel, 1, signing_key=private)
    assert bundle["signature"]

    assert signed_pull(cli, channel, cell, dest, public).code == 0
    status = cli("status", "--dest", dest, "--json").json()
    assert status["bundle_id"] == bundle["bundle_id"]
    assert status["signed"] is True


def test_unsigned_bundle_is_refused_when_a_key_is_given(publish, cli, keypair, channel, dest, cell):
    publish(channel, 1)
    signed_pull(cli, channel, cell, dest, keypair[1]).expect_error(
        "not signed", "refusing to activate", "unchanged"
    )
    assert not (dest / "current").exists()


def test_bundle_signed_with_another_key_is_refused(
    publish, cli, keypair, tmp_path, channel, dest, cell
):
    other_private = tmp_path / "other.pem"
    generate_keypair(other_private, tmp_path / "other.pub.pem")
    publish(channel, 1, signing_key=other_private)

    signed_pull(cli, channel, cell, dest, keypair[1]).expect_error("does not verify")
    assert not (dest / "current").exists()


def test_rewritten_manifest_with_a_matching_pointer_is_refused(
    publish, cli, keypair, channel, dest, cell
):
    # Someone with write access to the channel edits the manifest AND fixes up the pointer's
    # sha256: only the signature can catch that.
    bundle = publish(channel, 1, signing_key=keypair[0])
    manifest_path = Path(channel) / cell / "bundles" / bundle["bundle_id"] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["gate"] = {"passed": True, "success_rate": 1.0}
    manifest_bytes = json.dumps(manifest).encode()
    manifest_path.write_bytes(manifest_bytes)
    pointer = {"bundle_id": bundle["bundle_id"], "manifest_sha256": sha256_bytes(manifest_bytes)}
    (Path(channel) / cell / "CURRENT.json").write_text(json.dumps(pointer))

    signed_pull(cli, channel, cell, dest, keypair[1]).expect_error(
        bundle["bundle_id"], "signature does not verify"
    )


def test_signing_is_deterministic_so_republishing_is_idempotent(publish, keypair, channel):
    assert publish(channel, 1, signing_key=keypair[0]) == publish(
        channel, 1, signing_key=keypair[0]
    )


def test_generate_keypair_protects_the_private_key(keypair):
    private, public = keypair
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert b"PUBLIC KEY" in public.read_bytes()
    with pytest.raises(EdgeError, match="already exists"):
        generate_keypair(private, public)


def test_keygen_command(cli, tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub.pem"
    assert cli("keygen", "--private-key", private, "--public-key", public).code == 0
    assert private.is_file() and public.is_file()
    cli("keygen", "--private-key", private, "--public-key", public).expect_error("already exists")


def test_unreadable_public_key_is_reported(publish, cli, tmp_path, channel, dest, cell):
    publish(channel, 1)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    signed_pull(cli, channel, cell, dest, garbage).expect_error("garbage.pem", "not a PEM key")
