"""The cell process in-process: its edge box follows the channel (idle until something is
published), and production shifts record in place with the active bundle's id."""

from __future__ import annotations

import dataclasses

from refcell.process import CellProcess, CellRunConfig
from refcell.process.edgebox import EdgeBox
from tests.refcell.conftest import publish_policy
from tests.refcell.test_process_trials import landed_episodes

CELL = "cell-07"


class Ticks:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_cell_idles_until_a_model_is_published_and_says_so_once_a_minute(
    tmp_path, policy_folder, caplog
):
    channel, wall = tmp_path / "channel", Ticks()
    box = EdgeBox(str(channel), CELL, tmp_path / "box", poll_s=2.0, monotonic=wall)
    idle = (
        f"{CELL}: idle, no production model on {channel} "
        f"(publish one with `realloop deploy --initial PATH --cell {CELL}`)"
    )
    with caplog.at_level("INFO", logger="realloop.cell"):
        assert box.poll() is None
        wall.t = 30.0
        assert box.poll() is None
        assert caplog.messages.count(idle) == 1
        wall.t = 61.0
        assert box.poll() is None
        assert caplog.messages.count(idle) == 2
        manifest = publish_policy(channel, CELL, policy_folder, 1)
        assert box.poll() is None  # pulls at most every poll_s: the last was at t=60
        wall.t = 63.0
        model = box.poll()
    assert model is not None and model.bundle_id == manifest["bundle_id"]
    assert f"running bundle {manifest['bundle_id']}" in caplog.text
    assert (tmp_path / "box" / "current").resolve().name == manifest["bundle_id"]


def test_production_logs_name_the_bundle_that_ran_and_land_once_closed(
    params, tmp_path, policy_folder
):
    channel, landing, box = tmp_path / "channel", tmp_path / "landing", tmp_path / "box"
    first = publish_policy(channel, CELL, policy_folder, 1)
    config = CellRunConfig(
        CELL, "cell-08", str(channel), str(landing), box, episodes_per_shift=3, speed=1e6, poll_s=0
    )
    cell = CellProcess(config, params.cell, params.record)
    for _ in range(4):  # a whole shift, and the first episode of the next
        cell.step()
    assert [row["policy_version"] for row in landed_episodes(landing)] == [first["bundle_id"]] * 3
    open_log = cell.production.recorder.current.path
    assert open_log.parent == box / "recordings" and not (landing / open_log.name).exists()
    second = publish_policy(channel, CELL, _retrained(policy_folder, tmp_path), 2)
    cell.step()  # the new bundle closes the file that names the old one
    assert (landing / open_log.name).is_file()
    summary = cell.finish()  # as on a stop: closes and uploads the open log
    versions = [row["policy_version"] for row in landed_episodes(landing)]
    assert versions == [first["bundle_id"]] * 4 + [second["bundle_id"]]
    assert summary["production_episodes"] == 5 and summary["bundle_id"] == second["bundle_id"]
    assert not list((box / "recordings").glob("*.mcap"))
    truth = (box / "recordings" / ".groundtruth").glob("*.jsonl")
    assert sum(len(p.read_text().splitlines()) for p in truth) == 5
    assert not (landing / ".groundtruth").exists()


def _retrained(folder, tmp_path):
    from pipelines.training import load_policy, save_policy

    net = load_policy(folder).net
    net.config = dataclasses.replace(net.config, version="tiny-1")
    return save_policy(net, tmp_path / "retrained")
