"""Attacks on the signed channel, each by someone who can write to it (the bucket many people
can write to), each starting from a box running a good signed release. Every one must be
refused with a one-line reason, the active model unchanged and whole. Run against a folder
channel and against an S3-compatible server on loopback (moto): the S3 ones are `slow`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tuf.api.metadata import Metadata

from edge.channels import open_channel
from edge.keys import generate_key
from edge.tuf_repo import METADATA_PREFIX, TARGETS_PREFIX, Repository, publishing
from tests.edge.signed import EXPIRY_S, attest, passing_predicate

MODEL = "model.safetensors"


@pytest.fixture(params=["folder", pytest.param("s3", marks=pytest.mark.slow)])
def channel(request, tmp_path):
    if request.param == "folder":
        return str(tmp_path / "channel")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/releases"


@pytest.fixture
def running(publish, enroll_box, cli, channel, dest):
    """A box running a good signed release (model version 1); returns that release."""
    good = publish(channel, 1)
    enroll_box(channel, dest)
    assert cli("pull", "--box", dest, "--json").json()["action"] == "activated"
    return good


def refused(cli, dest: Path, good: dict, *fragments: str) -> str:
    """The pull fails in one line naming `fragments`; the good release still runs, whole."""
    line = cli("pull", "--box", dest, "--json").expect_error(*fragments)
    status = cli("status", "--box", dest, "--json")
    assert status.code == 0, status.stderr
    assert status.json()["bundle_id"] == good["bundle_id"]
    assert status.json()["intact"] is True
    assert not (dest / ".staging").exists()
    return line


def target_key(release: dict, name: str) -> str:
    sha = release["files"][name]["sha256"]
    return f"{TARGETS_PREFIX}{release['cell_id']}/{release['bundle_id']}/{sha}.{name}"


def latest(channel: str, role: str) -> str:
    """The metadata key of `role`'s newest version on the channel."""
    names = [k for k in open_channel(channel).list(METADATA_PREFIX) if k.endswith(f".{role}.json")]
    return max(names, key=lambda k: int(k[len(METADATA_PREFIX) :].split(".")[0]))


def test_flipped_byte_in_a_target(running, publish, cli, channel, dest):
    second = publish(channel, 2)
    ch = open_channel(channel)
    data = bytearray(ch.get_bytes(target_key(second, MODEL)))
    data[len(data) // 2] ^= 0x01
    ch.put_bytes(target_key(second, MODEL), bytes(data))
    refused(cli, dest, running, MODEL, "hash mismatch", "unchanged")


def test_unsigned_release(running, publish, cli, channel, dest, cell):
    publish(channel, 2)
    ch, key = open_channel(channel), latest(channel, cell)
    document = json.loads(ch.get_bytes(key))
    document["signatures"] = []  # what someone without the cell's key can write
    ch.put_bytes(key, json.dumps(document).encode())
    refused(cli, dest, running, cell, "bad signature", "0/1")


def test_release_signed_with_an_attackers_key(
    running, publish, cli, channel, dest, keys, tmp_path, cell
):
    # Even with the online timestamp and snapshot keys, a cell role signed by another key fails
    # the delegation that the targets role signed.
    attacker = tmp_path / "attacker-keys"
    shutil.copytree(keys, attacker)
    generate_key(attacker, cell, replace=True)
    files = {MODEL: tmp_path / "evil.safetensors"}
    files[MODEL].write_bytes(b"evil" * 100)
    meta = {"model_name": "pusher-policy", "model_version": 9}
    from edge.release import publish_release

    publish_release(
        channel,
        attacker,
        cell,
        files,
        meta,
        {"kind": "gate"},
        attest(attacker, files[MODEL]),
        EXPIRY_S,
    )
    refused(cli, dest, running, cell, "bad signature")


def test_old_release_re_pointed_as_latest(publish, enroll_box, cli, channel, dest):
    publish(channel, 1)
    enroll_box(channel, dest)
    cli("pull", "--box", dest)
    ch = open_channel(channel)
    old_timestamp = ch.get_bytes(METADATA_PREFIX + "timestamp.json")
    good = publish(channel, 2)
    assert cli("pull", "--box", dest, "--json").json()["model_version"] == 2
    ch.put_bytes(METADATA_PREFIX + "timestamp.json", old_timestamp)  # replay: back to v1
    refused(cli, dest, good, "rollback attack", "timestamp")
    # The publisher is not fooled either: its next versions go above anything written before.
    third = publish(channel, 3)
    assert cli("pull", "--box", dest, "--json").json()["bundle_id"] == third["bundle_id"]


def test_older_model_version_without_a_rollback_decision(publish, enroll_box, cli, channel, dest):
    enroll_box(channel, dest)
    publish(channel, 3)
    good = cli("pull", "--box", dest, "--json").json()
    publish(channel, 2)  # properly signed, but a downgrade that nobody decided
    refused(cli, dest, good, "model version 2 is older than the active 3", "not a rollback")


def test_frozen_channel_metadata_past_expiry(running, cli, channel, dest, keys):
    # A frozen channel serves the last metadata until it expires; re-signed here with an
    # expiry in the past instead of waiting a day.
    with publishing(keys):
        Repository(open_channel(channel), keys, timestamp_expiry_s=-60).refresh_timestamp()
    refused(cli, dest, running, "freeze attack", "expired")


def test_snapshot_naming_targets_from_two_releases(running, publish, cli, channel, dest, cell):
    publish(channel, 2)
    ch = open_channel(channel)
    key = latest(channel, "snapshot")
    snapshot = Metadata.from_bytes(ch.get_bytes(key))
    snapshot.signed.meta[f"{cell}.json"].version -= 1  # the cell's release before this one
    ch.put_bytes(key, snapshot.to_bytes())
    refused(cli, dest, running, "snapshot", "hash mismatch")


def test_target_path_with_dot_dot(running, cli, channel, dest, keys, cell):
    # Even a correctly signed release may not name a file outside its folder on the box.
    with publishing(keys):
        repo = Repository(open_channel(channel), keys, EXPIRY_S)
        release = dict(running, bundle_id=running["bundle_id"])
        release["files"] = {**running["files"], "../../escape": running["files"][MODEL]}
        data = json.dumps(release).encode()
        repo.set_target(cell, f"{cell}/release.json", data)
        repo.commit()
    refused(cli, dest, running, "../../escape", "not a safe name")


def test_target_replaced_by_a_symlink(running, publish, cli, channel, dest, tmp_path):
    if channel.startswith("s3://"):
        pytest.skip("S3 has no symlinks")
    second = publish(channel, 2)
    path = Path(channel) / target_key(second, MODEL)
    (tmp_path / "elsewhere").write_bytes(b"x" * path.stat().st_size)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    refused(cli, dest, running, MODEL, "hash mismatch")


def test_failing_gate_attestation(running, publish, cli, channel, dest, keys, tmp_path):
    failing = dict(passing_predicate(), verdict="fail", reasons=["FAIL: 2 safety stops"])
    model = tmp_path / "source-v2" / MODEL
    model.parent.mkdir()
    model.write_bytes(b"weights-v2" * 100)
    publish(channel, 2, attestation=attest(keys, model, failing))
    refused(cli, dest, running, "attestation", "verdict is 'fail'")


def test_missing_gate_attestation(running, cli, channel, dest, keys, cell):
    with publishing(keys):
        repo = Repository(open_channel(channel), keys, EXPIRY_S)
        release = dict(running, attestation=None, model_version=2)
        repo.set_target(cell, f"{cell}/release.json", json.dumps(release).encode())
        repo.commit()
    refused(cli, dest, running, "without a gate attestation")


def test_valid_attestation_for_other_bytes(running, publish, cli, channel, dest, keys, tmp_path):
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"some other model")
    publish(channel, 2, attestation=attest(keys, other))
    refused(cli, dest, running, "attests model sha256", "other bytes")


def test_attestation_signed_by_another_key(running, publish, cli, channel, dest, tmp_path):
    forger = tmp_path / "forger"
    generate_key(forger, "gate")
    model = tmp_path / "source-v2" / MODEL
    model.parent.mkdir()
    model.write_bytes(b"weights-v2" * 100)
    publish(channel, 2, attestation=attest(forger, model))
    refused(cli, dest, running, "not signed by a gate key")


# --- kill -9 ---------------------------------------------------------------------------------

_SLOW_PUT = """
import os, sys, time
from edge import channel as c, s3
marker = os.environ["REALLOOP_TEST_MARKER"]
for cls in (c.LocalChannel, s3.S3Channel):
    for name in ("get_bytes", "put_bytes"):
        def wrap(orig, name=name):
            def slow(self, key, *rest):
                if os.environ["REALLOOP_TEST_STALL"] in key:
                    open(marker, "w").close()
                    time.sleep(60)
                return orig(self, key, *rest)
            return slow
        setattr(cls, name, wrap(getattr(cls, name)))
"""


def _killed(tmp_path: Path, stall_on: str, code: str) -> None:
    """Run `code` in a child that stalls on the first channel key containing `stall_on`, and
    SIGKILL it there."""
    marker = tmp_path / "stalled"
    env = dict(os.environ, REALLOOP_TEST_MARKER=str(marker), REALLOOP_TEST_STALL=stall_on)
    child = subprocess.Popen([sys.executable, "-c", _SLOW_PUT + code], env=env)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert child.poll() is None and time.monotonic() < deadline, "never reached the stall"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()


def test_kill_9_during_pull(running, publish, cli, channel, dest, tmp_path):
    second = publish(channel, 2)
    code = f"from edge.agent import pull; pull({str(dest)!r})"
    _killed(tmp_path, f"{second['bundle_id']}/", code)
    status = cli("status", "--box", dest, "--json").json()
    assert status["bundle_id"] == running["bundle_id"] and status["intact"] is True
    assert cli("pull", "--box", dest, "--json").json()["bundle_id"] == second["bundle_id"]


def test_kill_9_during_publish(running, cli, channel, dest, keys, tmp_path, cell):
    source = tmp_path / "source-v2"
    source.mkdir()
    (source / MODEL).write_bytes(b"weights-v2" * 100)
    code = (
        "from pathlib import Path; from edge.release import publish_release\n"
        f"publish_release({channel!r}, Path({str(keys)!r}), {cell!r}, "
        f"{{'{MODEL}': Path({str(source / MODEL)!r})}}, "
        "{'model_name': 'pusher-policy', 'model_version': 2}, "
        "{'kind': 'override', 'by': 't', 'at': 'now', 'reason': 'test'}, None, 86400)"
    )
    _killed(tmp_path, "timestamp.json", code)  # everything written but the publish itself
    again = cli("pull", "--box", dest, "--json")
    assert again.code == 0, again.stderr
    assert again.json()["action"] == "already_active"
    assert again.json()["bundle_id"] == running["bundle_id"] and again.json()["intact"] is True
