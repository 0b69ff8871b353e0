"""The channel's keys: init (root offline, private files 0600), rotation that enrolled boxes
follow (root, timestamp, a cell's key), and one cell's key never releasing to another cell."""

from __future__ import annotations

import json
import stat

from edge import agent
from edge.channels import open_channel
from edge.keys import key_path, load_signer
from edge.release import publish_release
from edge.rotation import init_keys, rotate_key
from edge.tuf_repo import METADATA_PREFIX
from tests.edge.signed import EXPIRY_S


def test_init_makes_root_offline_and_private_files_0600(keys, channel):
    made = init_keys(keys, channel, EXPIRY_S)
    assert made["made"] == ["root", "timestamp", "snapshot", "targets", "gate"]
    assert key_path(keys, "root").parent == keys / "offline"
    assert {p.name for p in (keys / "online").glob("*.key")} == {
        "timestamp.key",
        "snapshot.key",
        "targets.key",
        "gate.key",
    }
    for path in keys.rglob("*.key"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    root = json.loads((keys / "root.json").read_text())
    assert root["signed"]["version"] == 1 and root["signed"]["consistent_snapshot"] is True
    names = set(open_channel(channel).list(METADATA_PREFIX))
    assert {f"{METADATA_PREFIX}1.root.json", f"{METADATA_PREFIX}timestamp.json"} <= names
    assert init_keys(keys, channel, EXPIRY_S)["made"] == []  # idempotent: keys are never replaced


def test_publishing_never_needs_the_root_key(publish, keys, channel, tmp_path):
    publish(channel, 1)
    (keys / "offline").rename(tmp_path / "usb-stick")  # root stored away, as it should be
    assert publish(channel, 2)["model_version"] == 2


def test_enrolled_box_follows_root_timestamp_and_cell_rotations(
    publish, enroll_box, keys, channel, dest, cell
):
    publish(channel, 1)
    enroll_box(channel, dest)
    agent.pull(dest)
    for role in ("root", "timestamp", cell):
        old = load_signer(keys, role).public_key.keyid
        rotated = rotate_key(keys, role, channel, EXPIRY_S)
        assert rotated["new_keyid"] != old == rotated["old_keyid"]
        release = publish(channel, rotated["timestamp_version"])  # a new release after each
        pulled = agent.pull(dest)
        assert pulled["bundle_id"] == release["bundle_id"], role
    root2 = json.loads(open_channel(channel).get_bytes(f"{METADATA_PREFIX}2.root.json"))
    assert len(root2["signatures"]) == 2  # old and new root key: boxes on root 1 verify it
    assert (dest / "tuf" / "metadata" / "root_history" / "3.root.json").exists()


def test_a_cells_key_cannot_release_to_another_cell(publish, enroll_box, keys, channel, tmp_path):
    publish(channel, 1, cell="cell-7")
    good = publish(channel, 1, cell="cell-8")
    box = enroll_box(channel, tmp_path / "box-8")  # the cell-7 fixture cell; re-enrol for 8
    (box / "tuf" / "enrollment.json").write_text(
        json.dumps({"channel": channel, "cell_id": "cell-8"})
    )
    agent.pull(box)
    # Whoever holds cell-7's key signs a release for cell-8 with it.
    key_path(keys, "cell-8").write_bytes(key_path(keys, "cell-7").read_bytes())
    key_path(keys, "cell-8").with_suffix(".pub.json").write_bytes(
        key_path(keys, "cell-7").with_suffix(".pub.json").read_bytes()
    )
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(b"evil")
    decision = {"kind": "override", "by": "x", "at": "now", "reason": "cell-7's key"}
    publish_release(
        channel,
        keys,
        "cell-8",
        {"model.safetensors": evil},
        {"model_name": "m", "model_version": 5},
        decision,
        None,
        EXPIRY_S,
    )
    import pytest

    from edge.errors import EdgeError

    with pytest.raises(EdgeError, match="cell-8 was signed by 0/1 keys"):
        agent.pull(box)
    assert agent.status(box)["bundle_id"] == good["bundle_id"]
