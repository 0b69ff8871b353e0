"""Hardware trials on request, run by the cell process's TrialRunner against a folder channel:
arms interleaved, trial metadata on every log, logs uploaded at each look of the gate."""

from __future__ import annotations

import dataclasses
import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory

from edge.channels import open_channel, upload_bundle
from edge.integrity import sha256_bytes
from edge.trials import Signing, new_request_id, publish_request, trials_target, withdraw_request
from pipelines.contract import schema
from refcell.cell import Cell
from refcell.process.clock import CellClock
from refcell.process.line import Line
from refcell.process.trials import TrialRunner
from refcell.process.uploader import LandingUploader
from refcell.world import load_world
from tests.edge.signed import EXPIRY_S, enrolled, keys_for
from tests.refcell.conftest import START, policy_files, publish_policy

CELL = "cell-07"
EPISODES_PER_ARM = 3


class Rig:
    """A channel with a production model, a candidate and a trial request; a cell's line,
    uploader and trial runner on a box folder."""

    def __init__(self, params, tmp_path: Path, policy_folder: Path, episodes_per_shift: int):
        self.channel_dir, self.landing = tmp_path / "channel", tmp_path / "landing"
        self.box, self.params, self.tmp_path = tmp_path / "box", params, tmp_path
        self.channel = open_channel(self.channel_dir)
        incumbent = publish_policy(self.channel_dir, CELL, policy_folder, 1)
        candidate, candidate_bytes = self._candidate()
        self.bundles = {"candidate": candidate["bundle_id"], "incumbent": incumbent["bundle_id"]}
        incumbent_bytes = self.channel.get_bytes(
            f"{CELL}/bundles/{incumbent['bundle_id']}/manifest.json"
        )
        self.keys = keys_for(self.channel_dir)
        self.signing = Signing(self.keys, EXPIRY_S)
        enrolled(str(self.channel_dir), self.keys, CELL, self.box)  # as the edge box does
        now = datetime.now(UTC)
        self.document = {
            "request_id": new_request_id(CELL),
            "cell_id": CELL,
            "episodes_per_arm": EPISODES_PER_ARM,
            "arms": {
                "candidate": {
                    "bundle_id": candidate["bundle_id"],
                    "manifest_sha256": sha256_bytes(candidate_bytes),
                },
                "incumbent": {
                    "bundle_id": incumbent["bundle_id"],
                    "manifest_sha256": sha256_bytes(incumbent_bytes),
                },
            },
            "created_at": now.isoformat(),
            "deadline": (now + timedelta(hours=2)).isoformat(),
        }
        self.request = publish_request(self.channel, self.document, self.signing)
        self.stop = threading.Event()
        clock = CellClock(1e6, int(START.timestamp() * 1e9), self.stop)
        world = Cell(load_world("line"), params.cell)
        self.line = Line(world, clock, self.box, episodes_per_shift, seed=3)
        self.runner = self.new_runner(str(self.landing))

    def new_runner(self, landing: str) -> TrialRunner:
        uploader = LandingUploader(landing, self.box / "uploaded")
        return TrialRunner(
            str(self.channel_dir),
            self.params.cell,
            self.params.record,
            self.box,
            self.line,
            uploader,
            self.stop,
            poll_s=0.0,
        )

    def _candidate(self):
        import torch

        from pipelines.training import PolicyConfig, PolicyNet, save_policy

        torch.manual_seed(1)
        folder = save_policy(
            PolicyNet(PolicyConfig(hidden=[8], version="cand")), self.tmp_path / "cand"
        )
        return upload_bundle(
            self.channel,
            CELL,
            policy_files(folder),
            {"model_name": "pusher-policy", "model_version": 2},
        )

    @property
    def request_id(self) -> str:
        return self.request["request_id"]


@pytest.fixture
def rig(params, tmp_path, policy_folder) -> Rig:
    return Rig(params, tmp_path, policy_folder, episodes_per_shift=4)


def landed_episodes(landing: Path) -> list[dict]:
    """One row per episode in the landed logs: its id and its file's `realloop.cell` keys."""
    rows = []
    for path in sorted(landing.glob("*.mcap")):
        with path.open("rb") as stream:
            reader = make_reader(stream, decoder_factories=[DecoderFactory()])
            meta = {m.name: m.metadata for m in reader.iter_metadata()}[schema.METADATA_NAME]
            for *_, message in reader.iter_decoded_messages(topics=[schema.TOPIC_EVENTS]):
                event = json.loads(message.data)
                if event["event"] == "end":
                    rows.append({"episode_id": event["episode_id"], "file": path.name, **meta})
    return sorted(rows, key=lambda row: row["episode_id"])


def test_arms_alternate_and_every_log_names_request_arm_and_attempt(rig):
    assert rig.runner.next_request()["request_id"] == rig.request_id
    assert rig.runner.run(rig.request) == "complete"
    episodes = landed_episodes(rig.landing)
    arms = [row["trial_arm"] for row in episodes]
    assert arms == ["candidate", "incumbent"] * EPISODES_PER_ARM  # interleaved, in slot order
    assert {row["trial_request_id"] for row in episodes} == {rig.request_id}
    assert len({row["trial_attempt"] for row in episodes}) == 1
    for row in episodes:
        assert row["policy_version"] == rig.bundles[row["trial_arm"]]
    files = {(row["file"], row["trial_arm"]) for row in episodes}
    assert len({name for name, _ in files}) == len(files)  # an arm's logs are its own
    assert len({row["shift_id"] for row in episodes}) == 2  # 6 episodes in shifts of 4
    assert (rig.box / "trials" / f"{rig.request_id}.done").is_file()
    assert rig.runner.next_request() is None  # done here: never rerun


def test_a_withdrawn_request_is_abandoned_and_nothing_of_it_uploaded(rig):
    run = rig.line.run

    def withdraw_after_two(*args, **kwargs):
        result = run(*args, **kwargs)
        if rig.line.shift is None or rig.line.shift.used >= 2:
            withdraw_request(rig.channel, CELL, rig.request_id, "test: timed out", rig.signing)
        return result

    rig.line.run = withdraw_after_two
    assert rig.runner.run(rig.request) == "withdrawn"
    assert not rig.landing.exists()
    assert not list((rig.box / "trials").glob(f"{rig.request_id}/*"))  # partial files deleted
    assert not (rig.box / "trials" / f"{rig.request_id}.done").exists()


def test_each_planned_look_uploads_the_logs_so_far_and_a_withdrawal_keeps_them(rig):
    """A sequential gate's request: the loop can judge at each look and stop the trials."""
    request = {
        **rig.request,
        "gate": {"alpha": 0.05, "margin": 0.02, "looks": 3, "futility_power": 0.0},
    }  # looks after 1, 2, 3 pairs; no futility stop, and 2 pairs never show efficacy
    forced_outcomes(rig, {"safety_stop": None}, {})  # the untrained candidate may hit a limit
    run = rig.line.run
    seen: list[int] = []

    def withdraw_in_the_second_look(*args, **kwargs):
        result = run(*args, **kwargs)
        seen.append(len(landed_episodes(rig.landing)) if rig.landing.exists() else 0)
        if len(seen) == 3:  # the gate decided on the first look's pair
            withdraw_request(rig.channel, CELL, rig.request_id, "test: gate decided", rig.signing)
        return result

    rig.line.run = withdraw_in_the_second_look
    assert rig.runner.run(request) == "withdrawn"
    assert seen == [0, 0, 2]  # the first pair went up at its look, during the third episode
    landed = landed_episodes(rig.landing)
    assert [row["trial_arm"] for row in landed] == ["candidate", "incumbent"]
    assert not list((rig.box / "trials").glob(f"{rig.request_id}/*"))  # the rest deleted


def forced_outcomes(rig, candidate: dict, incumbent: dict) -> list[str]:
    """Make the line report each arm's episodes with these fields (success, safety stop),
    as if the arms did so; returns the arms run, in order."""
    run, arms = rig.line.run, []

    def forced(slot, controller, recorder, operator, kind):
        result = run(slot, controller, recorder, operator, kind)
        arm = "candidate" if len(arms) % 2 == 0 else "incumbent"
        arms.append(arm)
        return dataclasses.replace(result, **(candidate if arm == "candidate" else incumbent))

    rig.line.run = forced
    return arms


def test_the_cell_stops_its_trials_at_the_look_where_the_sequential_test_decided(rig):
    """The robot stops at the gate's decision even when the loop is too busy to look: a
    candidate failing every episode against an incumbent that never fails is futile at the
    first of four looks (10 of 40 episodes per arm), and nothing more runs."""
    request = publish_request(
        rig.channel,
        {
            **rig.document,
            "request_id": new_request_id(CELL),
            "episodes_per_arm": 40,
            "gate": {"alpha": 0.05, "margin": 0.02, "looks": 4, "futility_power": 0.1},
        },
        rig.signing,
    )
    arms = forced_outcomes(rig, {"success": False, "safety_stop": None}, {"success": True})
    assert rig.runner.run(request) == "complete"
    assert len(arms) == 20
    done = json.loads((rig.box / "trials" / f"{request['request_id']}.done").read_text())
    assert done["candidate"] == {
        "bundle_id": rig.bundles["candidate"],
        "episodes": 10,
        "successes": 0,
    }
    assert done["incumbent"]["episodes"] == 10 and done["incumbent"]["successes"] == 10
    assert len(landed_episodes(rig.landing)) == 20  # every episode the gate judges went up


def test_a_candidate_safety_stop_ends_the_trials_at_its_pair(rig):
    request = {
        **rig.request,
        "episodes_per_arm": 3,
        "gate": {"alpha": 0.05, "margin": 0.02, "looks": 3, "futility_power": 0.0},
    }
    arms = forced_outcomes(rig, {"safety_stop": "force limit"}, {})
    assert rig.runner.run(request) == "complete"
    assert arms == ["candidate", "incumbent"]  # the pair is finished, then nothing more


def test_a_stop_mid_attempt_uploads_nothing(rig):
    run = rig.line.run

    def stop_after_one(*args, **kwargs):
        result = run(*args, **kwargs)
        rig.stop.set()
        return result

    rig.line.run = stop_after_one
    assert rig.runner.run(rig.request) == "stopped"
    assert not rig.landing.exists()


def test_after_a_kill_the_old_attempt_is_discarded_and_a_new_one_completes(rig):
    old = rig.box / "trials" / rig.request_id / "cell-07-20261201T055000Z-00000000"
    old.mkdir(parents=True)
    (old / "cell-07_20261201T055000Z_0001.mcap").write_bytes(b"\x89MCAP0\r\n half a file")
    rig.runner.recover()
    assert not old.exists()
    assert rig.runner.next_request()["request_id"] == rig.request_id
    assert rig.runner.run(rig.request) == "complete"
    episodes = landed_episodes(rig.landing)
    assert len(episodes) == 2 * EPISODES_PER_ARM
    assert {row["trial_attempt"] for row in episodes} != {old.name}
    assert not (rig.landing / "cell-07_20261201T055000Z_0001.mcap").exists()


def test_a_recorded_attempt_whose_upload_failed_is_delivered_later(rig):
    blocked = rig.tmp_path / "not-a-folder"
    blocked.write_text("the landing zone is down")
    rig.runner = rig.new_runner(str(blocked))
    assert rig.runner.run(rig.request) == "complete"  # recorded in full...
    assert not (rig.box / "trials" / f"{rig.request_id}.done").exists()  # ...not delivered
    restarted = rig.new_runner(str(rig.landing))
    restarted.recover()
    assert (rig.box / "trials" / f"{rig.request_id}.done").is_file()
    assert len(landed_episodes(rig.landing)) == 2 * EPISODES_PER_ARM


def ran_nothing(rig) -> bool:
    return not rig.landing.exists() and rig.line.shift is None  # not one episode ran


def test_an_arm_whose_bytes_differ_from_the_signed_target_is_refused_and_not_run(rig, caplog):
    # Whoever can write to the channel swaps the candidate's weights (both copies).
    bundle = rig.channel_dir / CELL / "bundles" / rig.bundles["candidate"]
    targets = rig.channel_dir / "tuf" / "targets" / CELL / rig.bundles["candidate"]
    for model in [bundle / "model.safetensors", *targets.glob("*.model.safetensors")]:
        model.write_bytes(model.read_bytes()[:-1] + b"!")
    with caplog.at_level("ERROR", logger="realloop.cell"):
        assert rig.runner.run(rig.request) == "refused"
    assert "hash mismatch" in caplog.text and rig.request_id in caplog.text
    assert ran_nothing(rig)
    assert rig.runner.next_request() is None


def test_an_unsigned_request_is_never_seen(rig):
    """The old unsigned layout, and a trials.json target file no metadata lists: nothing."""
    withdraw_request(rig.channel, CELL, rig.request_id, "test", rig.signing)
    forged = {**rig.document, "format": 1, "request_id": new_request_id(CELL)}
    body = json.dumps({"format": 1, "requests": [forged]}).encode()
    rig.channel.put_bytes(f"{CELL}/trials/{forged['request_id']}.json", json.dumps(forged).encode())
    rig.channel.put_bytes(f"tuf/targets/{trials_target(CELL)}", body)
    rig.channel.put_bytes(f"tuf/targets/{CELL}/{sha256_bytes(body)}.trials.json", body)
    assert rig.runner.next_request() is None
    assert rig.runner.run(forged) == "refused"  # even if handed it: its list is not signed
    assert ran_nothing(rig)


def test_a_request_signed_with_an_attackers_key_is_refused(rig, caplog):
    # Even with the online timestamp, snapshot and targets keys: the cell's role signed by
    # another key fails the delegation, so the box sees no request at all.
    import shutil

    from edge.keys import generate_key

    attacker = rig.tmp_path / "attacker-keys"
    shutil.copytree(rig.keys, attacker)
    generate_key(attacker, CELL, replace=True)
    withdraw_request(rig.channel, CELL, rig.request_id, "test", rig.signing)
    forged = {**rig.document, "request_id": new_request_id(CELL)}
    publish_request(rig.channel, forged, Signing(attacker, EXPIRY_S))
    with caplog.at_level("WARNING", logger="realloop.cell"):
        assert rig.runner.next_request() is None
    assert "bad signature" in caplog.text
    assert rig.runner.run({**forged, "format": 1}) == "refused"
    assert ran_nothing(rig)
