"""Logs written in place as rosbag2 does, and the uploader that sends only closed ones, with
their captures first, to a landing folder or an S3 prefix (a real S3 server on loopback)."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from pipelines.ingest.decoded import UnreadableLog
from pipelines.ingest.shift_log import read_log
from refcell.cell import Cell
from refcell.expert import Expert
from refcell.process.uploader import LandingUploader, is_closed
from refcell.runner import run_episode
from refcell.shift import GROUND_TRUTH_DIR
from refcell.world import load_world
from tests.refcell.conftest import recorder_in_place, run_shover


def spool_with_closed_logs(params, folder: Path) -> list[str]:
    """Two closed logs (one episode each) with captures, and a ground-truth side file."""
    recorder = recorder_in_place(params, folder, episodes_per_file=1)
    run_shover(params, recorder, 2)
    (folder / GROUND_TRUTH_DIR).mkdir()
    (folder / GROUND_TRUTH_DIR / "x.jsonl").write_text("{}\n")
    return [path.name for path in recorder.close()]


def test_a_log_grows_under_its_final_name_and_is_ingestible_only_once_closed(params, tmp_path):
    spool, landing = tmp_path / "spool", tmp_path / "landing"
    recorder = recorder_in_place(params, spool, episodes_per_file=50)
    cell = Cell(load_world("line"), params.cell)
    sizes = []
    for index in range(20):  # enough for a few MCAP chunks: the file grows chunk by chunk
        run_episode(cell, Expert(), 5, index, 20, observers=(recorder,))
        sizes.append(recorder.current.path.stat().st_size)
    path = recorder.current.path
    assert path.name == "cell-07_20261201T060000Z_0000.mcap"
    assert sizes[0] < sizes[-1]
    assert not list(spool.glob("*.partial")) and not is_closed(path)
    with pytest.raises(UnreadableLog):
        read_log(path)
    uploader = LandingUploader(str(landing), tmp_path / "sent")
    assert uploader.flush(spool, open_file=path) and uploader.uploaded == []
    recorder.close()
    assert is_closed(path) and read_log(path).messages > 0
    assert uploader.flush(spool)
    assert (landing / path.name).is_file() and not path.exists()


def test_closed_logs_land_in_a_folder_after_their_captures(params, tmp_path):
    spool, landing, sent = tmp_path / "spool", tmp_path / "landing", tmp_path / "sent"
    logs = spool_with_closed_logs(params, spool)
    uploader = LandingUploader(str(landing), sent)
    assert uploader.flush(spool)
    assert sorted(p.name for p in landing.glob("*.mcap")) == logs
    captures = sorted(p.name for p in (landing / "captures").iterdir())
    assert captures and all(not name.startswith(".") for name in captures)  # no temp left
    assert {Path(c).suffix for c in captures} == {".mcap", ".json", ".png"}
    order = uploader.uploaded
    for sidecar in (landing / "captures").glob("*.json"):  # captures first, sidecar last
        meta = json.loads(sidecar.read_text())
        position = order.index(f"captures/{sidecar.name}")
        assert position < order.index(meta["source_log"])
        for name in [f"{sidecar.stem}.mcap", *meta["attachments"]]:
            assert order.index(f"captures/{name}") < position
    assert not (landing / GROUND_TRUTH_DIR).exists()  # side files stay on the box
    assert (spool / GROUND_TRUTH_DIR / "x.jsonl").is_file()
    assert not list(spool.glob("*.mcap")) and (sent / logs[0]).is_file()  # moved, not lost


def test_closed_logs_land_on_s3_in_one_put_each(params, tmp_path, s3_bucket, s3_env):
    spool = tmp_path / "spool"
    logs = spool_with_closed_logs(params, spool)
    uploader = LandingUploader(f"s3://{s3_bucket}/landing/cell-07", tmp_path / "sent")
    assert uploader.flush(spool)
    listed = boto3.client("s3", endpoint_url=s3_env).list_objects_v2(Bucket=s3_bucket)
    keys = sorted(item["Key"] for item in listed["Contents"])
    assert [k for k in keys if k.count("/") == 2] == [f"landing/cell-07/{n}" for n in logs]
    assert any(k.startswith("landing/cell-07/captures/") for k in keys)
    assert not any(GROUND_TRUTH_DIR in k for k in keys)


def test_an_unreachable_landing_keeps_the_files_and_a_later_flush_sends_them(
    params, tmp_path, s3_env
):
    spool = tmp_path / "spool"
    logs = spool_with_closed_logs(params, spool)
    uploader = LandingUploader("s3://not-created-yet/landing", tmp_path / "sent")
    assert not uploader.flush(spool)
    assert sorted(p.name for p in spool.glob("*.mcap")) == logs  # nothing lost
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket="not-created-yet")
    assert uploader.flush(spool) and not list(spool.glob("*.mcap"))


def test_a_log_cut_off_by_a_kill_is_set_aside_never_uploaded(params, tmp_path):
    spool, landing = tmp_path / "spool", tmp_path / "landing"
    recorder = recorder_in_place(params, spool, episodes_per_file=10)
    run_shover(params, recorder, 1)
    recorder.current.stream.flush()  # the process dies here: no footer is ever written
    cut = recorder.current.path
    uploader = LandingUploader(str(landing), tmp_path / "sent")
    assert uploader.set_aside_unclosed(spool) == [spool / ".unclosed" / cut.name]
    assert not list((spool / "captures").glob("*.json"))  # its captures went with it
    assert uploader.flush(spool) and not landing.exists()
