"""The channel client (local and S3) and the publisher's contract."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from edge.bundle import MODEL_FILE
from edge.channels import LocalChannel, open_channel, upload_bundle
from edge.errors import EdgeError, KeyNotFoundError
from edge.integrity import sha256_bytes


@pytest.fixture(params=["local", "s3"])
def channel_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "channel")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/releases/line-a"


def test_channel_round_trip(channel_uri, tmp_path):
    channel = open_channel(channel_uri)
    channel.put_bytes("cell/a.json", b"{}")
    source = tmp_path / "blob"
    source.write_bytes(b"\x00\x01" * 1000)
    channel.put_file("cell/bundles/b1/blob", source)

    assert channel.get_bytes("cell/a.json") == b"{}"
    channel.get_file("cell/bundles/b1/blob", tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == source.read_bytes()
    assert channel.exists("cell/a.json")
    assert not channel.exists("cell/missing.json")
    assert channel.list() == ["cell/a.json", "cell/bundles/b1/blob"]
    assert channel.list("cell/bundles/") == ["cell/bundles/b1/blob"]
    assert channel.list("other/") == []
    with pytest.raises(KeyNotFoundError, match=r"missing\.json: not found"):
        channel.get_bytes("cell/missing.json")


def test_keys_cannot_escape_the_channel(tmp_path):
    channel = open_channel(tmp_path / "channel")
    for key in ("../outside", "/abs", "a//b", ""):
        with pytest.raises(EdgeError, match="channel key"):
            channel.put_bytes(key, b"x")


def test_local_writes_leave_no_temp_files(tmp_path):
    channel = open_channel(tmp_path / "channel")
    channel.put_bytes("cell/CURRENT.json", b"1")
    channel.put_bytes("cell/CURRENT.json", b"2")
    assert [p.name for p in (tmp_path / "channel" / "cell").iterdir()] == ["CURRENT.json"]
    assert channel.get_bytes("cell/CURRENT.json") == b"2"


def test_open_channel_kinds(tmp_path):
    assert isinstance(open_channel(tmp_path), LocalChannel)
    assert open_channel(tmp_path.as_uri()).root == tmp_path
    with pytest.raises(EdgeError, match="unsupported scheme"):
        open_channel("ftp://host/x")


def test_release_layout_signed_targets_and_trial_copy(publish, tmp_path, cell):
    root = tmp_path / "channel"
    release = publish(str(root), 3)
    bundle_dir = root / cell / "bundles" / release["bundle_id"]  # the copy trials run

    assert sorted(p.name for p in bundle_dir.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
    ]
    assert release["bundle_id"].startswith("3-")
    assert release["manifest_sha256"] == sha256_bytes((bundle_dir / "manifest.json").read_bytes())
    model = release["files"][MODEL_FILE]
    assert model == {
        "sha256": sha256_bytes((bundle_dir / MODEL_FILE).read_bytes()),
        "size": (bundle_dir / MODEL_FILE).stat().st_size,
    }
    signed_model = (
        root / "tuf" / "targets" / cell / release["bundle_id"] / f"{model['sha256']}.{MODEL_FILE}"
    )
    assert signed_model.read_bytes() == (bundle_dir / MODEL_FILE).read_bytes()
    metadata = sorted(p.name for p in (root / "tuf" / "metadata").iterdir())
    assert {"1.root.json", "timestamp.json", f"1.{cell}.json", "2.snapshot.json"} <= set(metadata)
    assert not (root / cell / "CURRENT.json").exists()  # no unsigned pointer any more
    assert (release["format"], release["decision"]["kind"], release["attestation"]) == (
        1,
        "gate",
        "attestation.json",
    )


def test_republishing_identical_content_keeps_the_bundle_and_moves_versions_up(
    publish, tmp_path, cell
):
    root = tmp_path / "channel"
    first = publish(str(root), 1)
    again = publish(str(root), 1)
    assert again["bundle_id"] == first["bundle_id"]
    assert again["tuf_version"] == first["tuf_version"] + 1
    assert len(list((root / cell / "bundles").iterdir())) == 1


def test_upload_rejects_bad_input(tmp_path):
    model = tmp_path / MODEL_FILE
    model.write_bytes(b"w")
    good = {"model_name": "m", "model_version": 1}
    ch = open_channel(tmp_path / "c")
    with pytest.raises(EdgeError, match=r"unknown fields \['typo'\]"):
        upload_bundle(ch, "cell", {MODEL_FILE: model}, {**good, "typo": 1})
    with pytest.raises(EdgeError, match=r"missing fields \['model_version'\]"):
        upload_bundle(ch, "cell", {MODEL_FILE: model}, {"model_name": "m"})
    with pytest.raises(EdgeError, match=r"must be a table that includes model\.safetensors"):
        upload_bundle(ch, "cell", {"config.json": model}, good)
    with pytest.raises(EdgeError, match="cell id"):
        upload_bundle(ch, "../cell", {MODEL_FILE: model}, good)
    with pytest.raises(EdgeError, match="cannot read"):
        upload_bundle(ch, "cell", {MODEL_FILE: tmp_path / "absent"}, good)
    assert not (tmp_path / "c").exists()


def test_interrupted_writes_are_swept_once_old_enough(channel_uri, tmp_path):
    """What killed writes leave (`*.partial`, unfinished multipart uploads) goes; younger
    ones may be writes in flight and stay; finished objects are never touched."""
    channel = open_channel(channel_uri)
    channel.put_bytes("cell/CURRENT.json", b"1")
    channel.put_bytes("cell/bundles/b1/model.safetensors.partial", b"half a model")
    if isinstance(channel, LocalChannel):
        old = tmp_path / "channel" / "cell" / "bundles" / "b1" / "model.safetensors.partial"
        os.utime(old, (time.time() - 7200,) * 2)
        (tmp_path / "channel" / "cell" / ".CURRENT.json.x1y2.partial").write_bytes(b"young")
        limit, expected = 3600, ["cell/bundles/b1/model.safetensors.partial"]
    else:  # S3 keeps its own times: age everything by sweeping with a zero limit
        assert channel.sweep_partials(3600) == []  # younger than an hour
        # (created after that check: moto dates every multipart upload 2010-11-10)
        channel._client.create_multipart_upload(
            Bucket=channel.bucket, Key="releases/line-a/cell/big.bin"
        )
        limit = 0
        expected = [
            "cell/bundles/b1/model.safetensors.partial",
            "cell/big.bin (unfinished multipart upload)",
        ]
    assert channel.sweep_partials(limit) == expected
    assert channel.sweep_partials(limit) == []
    assert channel.get_bytes("cell/CURRENT.json") == b"1"
    if isinstance(channel, LocalChannel):
        assert (tmp_path / "channel" / "cell" / ".CURRENT.json.x1y2.partial").exists()
    else:
        assert (
            channel._client.list_multipart_uploads(Bucket=channel.bucket).get("Uploads", []) == []
        )


def test_a_publish_sweeps_what_killed_publishes_left(publish, tmp_path, cell):
    channel = tmp_path / "channel"
    litter = channel / cell / "bundles" / "1-abc" / ".model.safetensors.k1ll.partial"
    litter.parent.mkdir(parents=True)
    litter.write_bytes(b"\x00" * 1000)
    os.utime(litter, (time.time() - 7200,) * 2)
    publish(str(channel), 1)
    assert not litter.exists()
