"""pull / status / rollback on a local channel, through the realloop-edge CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from edge.agent import read_history


def pull_args(channel: str, cell: str, dest: Path) -> list[str | Path]:
    return ["pull", "--channel", channel, "--cell", cell, "--dest", dest, "--json"]


def active_model_bytes(dest: Path) -> bytes:
    return (dest / "current" / "model.safetensors").read_bytes()


def test_publish_pull_status(publish, cli, channel, dest, cell):
    manifest = publish(channel, 1)

    pulled = cli(*pull_args(channel, cell, dest))
    assert pulled.code == 0, pulled.stderr
    assert pulled.json()["action"] == "activated"

    status = cli("status", "--dest", dest, "--json").json()
    model = Path(status["path"]) / "model.safetensors"
    assert model.is_file()
    assert Path(status["path"]) == (dest / "releases" / manifest["bundle_id"]).resolve()
    assert status["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert status["sha256"] == manifest["files"]["model.safetensors"]["sha256"]
    assert status["intact"] is True
    assert status["bundle_id"] == manifest["bundle_id"]
    assert status["model_version"] == 1
    assert status["cell_id"] == cell
    assert status["dataset_version"] == "data-1"
    assert status["mlflow_run_id"] == "run1"
    assert status["activated_at"] and status["created_at"] == manifest["created_at"]
    assert status["previous"] is None
    assert (dest / "current").is_symlink()
    assert (Path(status["path"]) / "config.json").is_file()
    assert [r["action"] for r in read_history(dest)] == ["pull"]


def test_status_human_readable(publish, cli, channel, dest, cell):
    publish(channel, 1)
    cli(*pull_args(channel, cell, dest))
    text = cli("status", "--dest", dest).stdout
    assert "pusher-policy version 1" in text
    assert "previous   none" in text


def test_pulling_the_active_bundle_again_does_nothing(publish, cli, channel, dest, cell):
    publish(channel, 1)
    cli(*pull_args(channel, cell, dest))
    again = cli("pull", "--channel", channel, "--cell", cell, "--dest", dest)
    assert again.code == 0
    assert "already active" in again.stdout
    assert len(read_history(dest)) == 1


def test_second_pull_keeps_previous_and_rollback_restores_it(publish, cli, channel, dest, cell):
    first = publish(channel, 1)
    cli(*pull_args(channel, cell, dest))
    second = publish(channel, 2)
    pulled = cli(*pull_args(channel, cell, dest)).json()

    assert pulled["bundle_id"] == second["bundle_id"]
    assert pulled["previous"] == {"bundle_id": first["bundle_id"], "model_version": 1}
    assert active_model_bytes(dest) == b"weights-v2" * 100
    assert (dest / "previous").resolve().name == first["bundle_id"]

    rolled = cli("rollback", "--dest", dest, "--json")
    assert rolled.code == 0, rolled.stderr
    status = cli("status", "--dest", dest, "--json").json()
    assert status["bundle_id"] == first["bundle_id"]
    assert status["model_version"] == 1
    assert status["previous"] == {"bundle_id": second["bundle_id"], "model_version": 2}
    assert active_model_bytes(dest) == b"weights-v1" * 100
    assert [r["action"] for r in read_history(dest)] == ["pull", "pull", "rollback"]
    assert status["activated_at"] == read_history(dest)[-1]["time"]


def test_pull_after_rollback_reinstalls_the_channel_bundle(publish, cli, channel, dest, cell):
    publish(channel, 1)
    cli(*pull_args(channel, cell, dest))
    second = publish(channel, 2)
    cli(*pull_args(channel, cell, dest))
    cli("rollback", "--dest", dest)

    again = cli(*pull_args(channel, cell, dest)).json()
    assert again["action"] == "activated"
    assert again["bundle_id"] == second["bundle_id"]
    assert active_model_bytes(dest) == b"weights-v2" * 100


def test_only_current_and_previous_releases_are_kept(publish, cli, channel, dest, cell):
    bundles = []
    for version in (1, 2, 3):
        bundles.append(publish(channel, version)["bundle_id"])
        cli(*pull_args(channel, cell, dest))
    assert sorted(p.name for p in (dest / "releases").iterdir()) == sorted(bundles[1:])


def test_rollback_without_previous_fails_cleanly(publish, cli_process, channel, dest, cell):
    publish(channel, 1)
    assert cli_process(*pull_args(channel, cell, dest)).code == 0
    before = (dest / "current").resolve()

    cli_process("rollback", "--dest", dest).expect_error("no previous model", "unchanged")
    assert (dest / "current").resolve() == before
    assert [r["action"] for r in read_history(dest)] == ["pull"]


def test_status_and_rollback_on_an_empty_box_fail_cleanly(cli, dest):
    cli("status", "--dest", dest).expect_error("no active model", "realloop-edge pull")
    cli("rollback", "--dest", dest).expect_error("no such folder")
    dest.mkdir()
    cli("rollback", "--dest", dest).expect_error("no previous model")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_tampered_file_is_refused_and_active_model_kept(
    publish, cli, cli_process, channel, dest, cell, name
):
    first = publish(channel, 1)
    cli(*pull_args(channel, cell, dest))
    second = publish(channel, 2)
    target = Path(channel) / cell / "bundles" / second["bundle_id"] / name
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: same size, different hash
    target.write_bytes(bytes(data))

    result = cli_process(*pull_args(channel, cell, dest))

    result.expect_error(second["bundle_id"], name, "sha256 mismatch", "unchanged")
    status = cli("status", "--dest", dest, "--json").json()
    assert status["bundle_id"] == first["bundle_id"]
    assert active_model_bytes(dest) == b"weights-v1" * 100
    assert [p.name for p in (dest / "releases").iterdir()] == [first["bundle_id"]]
    assert not (dest / ".staging").exists()
    assert len(read_history(dest)) == 1


def test_truncated_file_is_refused(publish, cli, channel, dest, cell):
    bundle = publish(channel, 1)
    target = Path(channel) / cell / "bundles" / bundle["bundle_id"] / "model.safetensors"
    target.write_bytes(target.read_bytes()[:-10])

    cli(*pull_args(channel, cell, dest)).expect_error("model.safetensors", "size mismatch")
    assert not (dest / "current").exists()
    assert not (dest / ".staging").exists()


def test_manifest_that_does_not_match_the_pointer_is_refused(publish, cli, channel, dest, cell):
    bundle = publish(channel, 1)
    manifest_path = Path(channel) / cell / "bundles" / bundle["bundle_id"] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model_version"] = 99
    manifest_path.write_text(json.dumps(manifest))

    cli(*pull_args(channel, cell, dest)).expect_error(
        "manifest.json", "sha256 mismatch with CURRENT.json", "unchanged"
    )
    assert not (dest / "current").exists()


def test_missing_pointer_is_reported(cli, channel, dest, cell):
    cli(*pull_args(channel, cell, dest)).expect_error("CURRENT.json", "not found", "--cell")


def test_pointer_that_is_not_json_is_reported(publish, cli, channel, dest, cell):
    publish(channel, 1)
    (Path(channel) / cell / "CURRENT.json").write_text("{not json")
    cli(*pull_args(channel, cell, dest)).expect_error("CURRENT.json", "not valid JSON")


def test_missing_bundle_file_is_reported(publish, cli, channel, dest, cell):
    bundle = publish(channel, 1)
    (Path(channel) / cell / "bundles" / bundle["bundle_id"] / "config.json").unlink()
    cli(*pull_args(channel, cell, dest)).expect_error(
        bundle["bundle_id"], "config.json", "not found"
    )
    assert not (dest / ".staging").exists()


def test_file_uri_channel(publish, cli, channel, dest, cell):
    bundle = publish(Path(channel).as_uri(), 1)
    result = cli(*pull_args(Path(channel).as_uri(), cell, dest))
    assert result.json()["bundle_id"] == bundle["bundle_id"]


def test_current_that_is_not_a_symlink_is_not_replaced(publish, cli, channel, dest, cell):
    publish(channel, 1)
    (dest / "current").mkdir(parents=True)
    cli(*pull_args(channel, cell, dest)).expect_error("not a symlink")
    assert (dest / "current").is_dir() and not (dest / "current").is_symlink()
