"""init / pull / status / rollback / repair on a local channel, through the realloop-edge CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from edge.agent import read_history


def pull_args(dest: Path) -> list[str | Path]:
    return ["pull", "--box", dest, "--json"]


def target_file(channel: str, release: dict, name: str) -> Path:
    """Where a release's file lives on the channel (content-addressed TUF target)."""
    sha = release["files"][name]["sha256"]
    return (
        Path(channel)
        / "tuf"
        / "targets"
        / release["cell_id"]
        / release["bundle_id"]
        / f"{sha}.{name}"
    )


def active_model_bytes(dest: Path) -> bytes:
    return (dest / "current" / "model.safetensors").read_bytes()


def test_init_publish_pull_status(publish, cli, channel, keys, dest, cell):
    release = publish(channel, 1)
    enrolled = cli(
        "init",
        "--channel",
        channel,
        "--cell",
        cell,
        "--box",
        dest,
        "--root",
        keys / "root.json",
        "--json",
    )
    assert enrolled.code == 0, enrolled.stderr
    assert enrolled.json()["root_version"] == 1

    pulled = cli(*pull_args(dest))
    assert pulled.code == 0, pulled.stderr
    assert pulled.json()["action"] == "activated"

    status = cli("status", "--box", dest, "--json").json()
    model = Path(status["path"]) / "model.safetensors"
    assert Path(status["path"]) == (dest / "releases" / release["bundle_id"]).resolve()
    assert status["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert status["sha256"] == release["files"]["model.safetensors"]["sha256"]
    assert status["intact"] is True and status["signed"] is True
    assert (status["bundle_id"], status["model_version"], status["cell_id"]) == (
        release["bundle_id"],
        1,
        cell,
    )
    assert status["dataset_version"] == "data-1" and status["mlflow_run_id"] == "run1"
    assert status["decision"]["kind"] == "gate"
    assert status["decision"]["attestation"]["verdict"] == "pass"
    assert status["decision"]["attestation"]["request_id"] == "trial-1"
    assert status["previous"] is None
    assert [r["action"] for r in read_history(dest)] == ["pull"]
    text = cli("status", "--box", dest).stdout
    assert "pusher-policy version 1" in text and "gate: gate pass on trial request trial-1" in text


def test_dest_is_an_alias_of_box(publish, cli, channel, dest, enroll_box):
    publish(channel, 1)
    enroll_box(channel, dest)
    assert cli("pull", "--dest", dest, "--json").json()["action"] == "activated"


def test_pulling_the_active_release_again_does_nothing(publish, cli, channel, dest, enroll_box):
    publish(channel, 1)
    enroll_box(channel, dest)
    cli(*pull_args(dest))
    again = cli("pull", "--box", dest)
    assert again.code == 0 and "already active" in again.stdout
    assert len(read_history(dest)) == 1


def test_second_pull_keeps_previous_and_rollback_restores_it(
    publish, cli, channel, dest, enroll_box
):
    first = publish(channel, 1)
    enroll_box(channel, dest)
    cli(*pull_args(dest))
    second = publish(channel, 2)
    pulled = cli(*pull_args(dest)).json()
    assert pulled["bundle_id"] == second["bundle_id"]
    assert pulled["previous"] == {"bundle_id": first["bundle_id"], "model_version": 1}

    assert cli("rollback", "--box", dest, "--json").code == 0
    status = cli("status", "--box", dest, "--json").json()
    assert status["model_version"] == 1 and active_model_bytes(dest) == b"weights-v1" * 100
    assert status["previous"] == {"bundle_id": second["bundle_id"], "model_version": 2}
    assert [r["action"] for r in read_history(dest)] == ["pull", "pull", "rollback"]


def test_only_current_and_previous_releases_are_kept(publish, cli, channel, dest, enroll_box):
    bundles = []
    enroll_box(channel, dest)
    for version in (1, 2, 3):
        bundles.append(publish(channel, version)["bundle_id"])
        cli(*pull_args(dest))
    assert sorted(p.name for p in (dest / "releases").iterdir()) == sorted(bundles[1:])


def test_signed_rollback_release_is_accepted_and_shown(publish, cli, channel, dest, enroll_box):
    enroll_box(channel, dest)
    publish(channel, 1)
    cli(*pull_args(dest))
    publish(channel, 2)
    cli(*pull_args(dest))
    decision = {
        "kind": "rollback",
        "by": "ana",
        "at": "2026-01-01T00:00:00+00:00",
        "reason": "v2 drops parts",
    }
    publish(channel, 1, decision=decision)

    pulled = cli(*pull_args(dest))
    assert pulled.code == 0, pulled.stderr
    status = pulled.json()
    assert status["model_version"] == 1 and status["decision"] == decision
    assert (
        "rollback by ana at 2026-01-01T00:00:00+00:00: v2 drops parts"
        in cli("status", "--box", dest).stdout
    )


def test_a_damaged_active_model_is_repaired(publish, cli, channel, dest, enroll_box):
    release = publish(channel, 1)
    enroll_box(channel, dest)
    cli(*pull_args(dest))
    (dest / "current" / "model.safetensors").write_bytes(b"rotted" * 10)

    status = cli("status", "--box", dest, "--json")
    assert status.code != 0 and status.json()["intact"] is False  # never success while damaged
    repaired = cli(*pull_args(dest))
    assert repaired.code == 0, repaired.stderr
    assert repaired.json()["action"] == "repaired" and repaired.json()["intact"] is True
    assert active_model_bytes(dest) == b"weights-v1" * 100
    assert repaired.json()["bundle_id"] == release["bundle_id"]
    assert [p for p in (dest / "releases").iterdir()] == [(dest / "current").resolve()]


def test_damaged_model_without_channel_rolls_back_or_fails(publish, cli, channel, dest, enroll_box):
    import shutil

    enroll_box(channel, dest)
    publish(channel, 1)
    cli(*pull_args(dest))
    publish(channel, 2)
    cli(*pull_args(dest))
    (dest / "current" / "config.json").write_text("{}")
    shutil.rmtree(Path(channel) / "tuf" / "targets")  # the channel cannot serve the files now

    fell_back = cli(*pull_args(dest))
    assert fell_back.code == 0, fell_back.stderr
    assert (
        fell_back.json()["action"] == "rolled_back_damaged"
        and fell_back.json()["model_version"] == 1
    )
    (dest / "current" / "model.safetensors").write_bytes(b"rotted")
    (dest / "previous" / "model.safetensors").write_bytes(b"rotted")
    cli(*pull_args(dest)).expect_error("active model damaged", "repair failed", "cannot roll back")


def test_rollback_without_previous_fails_cleanly(publish, cli_process, channel, dest, enroll_box):
    publish(channel, 1)
    enroll_box(channel, dest)
    assert cli_process(*pull_args(dest)).code == 0
    before = (dest / "current").resolve()
    cli_process("rollback", "--box", dest).expect_error("no previous model", "unchanged")
    assert (dest / "current").resolve() == before


def test_unenrolled_and_empty_boxes_fail_cleanly(cli, channel, dest, enroll_box):
    cli("pull", "--box", dest).expect_error("not enrolled", "realloop-edge init")
    cli("status", "--box", dest).expect_error("no active model", "realloop-edge pull")
    cli("rollback", "--box", dest / "nowhere").expect_error("no such folder")
    enroll_box(channel, dest)  # keys and the channel's first metadata, nothing released yet
    cli("pull", "--box", dest).expect_error("no signed release for cell cell-7")


def test_enrolling_twice_or_with_a_bad_root_fails_cleanly(
    cli, channel, keys, dest, enroll_box, tmp_path
):
    enroll_box(channel, dest)
    again = cli(
        "init",
        "--channel",
        channel,
        "--cell",
        "cell-7",
        "--box",
        dest,
        "--root",
        keys / "root.json",
    )
    again.expect_error("already enrolled")
    (tmp_path / "bad.json").write_text(json.dumps({"signed": {}}))
    bad = cli(
        "init",
        "--channel",
        channel,
        "--cell",
        "cell-7",
        "--box",
        tmp_path / "b2",
        "--root",
        tmp_path / "bad.json",
    )
    bad.expect_error("bad.json", "not TUF root metadata")


def test_file_uri_channel(publish, cli, channel, dest, enroll_box):
    release = publish(Path(channel).as_uri(), 1)
    enroll_box(Path(channel).as_uri(), dest)
    assert cli(*pull_args(dest)).json()["bundle_id"] == release["bundle_id"]


def test_current_that_is_not_a_symlink_is_not_replaced(publish, cli, channel, dest, enroll_box):
    publish(channel, 1)
    enroll_box(channel, dest)
    (dest / "current").mkdir(parents=True)
    cli(*pull_args(dest)).expect_error("not a symlink")
    assert (dest / "current").is_dir() and not (dest / "current").is_symlink()
