"""The reference cell on the box's runtime: steps the OOD screen refuses go to the operator and
are logged (a `fallback` event, an `ood` capture that ingest takes); a model that fails its
health check after activation is rolled back, reported, and not pulled again."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory

from edge.rotation import init_keys
from pipelines.contract import schema
from pipelines.contract.params import EdgeParams
from pipelines.quality import CAPTURE_REASONS
from refcell.process import CellProcess, CellRunConfig
from refcell.process.health import HealthWindow, attested_lower_bound
from tests.edge.signed import EXPIRY_S, attest, passing_predicate, publish_signed
from tests.edge.test_runtime import edge_bundle

CELL = "cell-07"


@pytest.fixture(scope="module")
def onnx_folder(tmp_path_factory) -> Path:
    return edge_bundle(tmp_path_factory.mktemp("onnx") / "policy")


def publish_folder(
    tmp_path: Path, folder: Path, version: int, lower_bound: float | None = None
) -> dict:
    """Every file of the policy folder as a signed release: gated with an attested candidate
    interval starting at `lower_bound`, or (None) a named override with no interval."""
    files = {path.name: path for path in sorted(folder.iterdir())}
    metadata = {"model_name": "pusher-policy", "model_version": version}
    keys, channel = tmp_path / "keys", str(tmp_path / "channel")
    if lower_bound is None:
        decision = {"kind": "override", "by": "test", "at": "2026-12-01", "reason": "first"}
        return publish_signed(channel, keys, CELL, files, metadata, decision)
    predicate = passing_predicate()
    predicate["arms"]["candidate"]["interval"] = [lower_bound, 1.0]
    attestation = attest(keys, files["model.safetensors"], predicate)
    return publish_signed(channel, keys, CELL, files, metadata, None, attestation)


def cell_process(params, tmp_path: Path, edge: EdgeParams, episodes_per_shift: int = 2):
    config = CellRunConfig(
        CELL,
        "cell-08",
        str(tmp_path / "channel"),
        str(tmp_path / "landing"),
        tmp_path / "box",
        episodes_per_shift=episodes_per_shift,
        speed=1e6,
        poll_s=0,
        ground_truth=False,
    )
    return CellProcess(config, params.cell, params.record, edge_params=edge)


def one_episode_log(params, tmp_path: Path, edge: EdgeParams, folder: Path) -> Path:
    """Publish `folder`, run one production episode on it, and return the shift's log."""
    cell = cell_process(params, tmp_path, edge, episodes_per_shift=1)
    publish_folder(tmp_path, folder, 1)
    cell.step()
    cell.finish()
    (log,) = sorted((tmp_path / "landing").glob("*.mcap"))
    return log


def events(log: Path, kind: str) -> list[dict]:
    with log.open("rb") as stream:
        reader = make_reader(stream, decoder_factories=[DecoderFactory()])
        found = []
        for *_, message in reader.iter_decoded_messages(topics=[schema.TOPIC_EVENTS]):
            event = json.loads(message.data)
            if event["event"] == kind:
                found.append(event)
    return found


def test_steps_the_box_refuses_go_to_the_operator_and_are_logged_and_ingested(
    params, tmp_path, onnx_folder
):
    from pipelines.ingest import read_dataset
    from tests.pipelines.test_ingest_helpers import ingest

    # A confidence floor above anything the camera reports: the box refuses every step.
    edge = EdgeParams(health_episodes=50, ood_false_alarm=0.01, min_confidence=0.99, fallback=True)
    cell = cell_process(params, tmp_path, edge)
    publish_folder(tmp_path, onnx_folder, 1)
    cell.step()
    cell.step()  # the shift's last episode: its log closes and lands
    cell.finish()
    landing = tmp_path / "landing"
    (log,) = sorted(landing.glob("*.mcap"))
    fallbacks = events(log, "fallback")
    steps = sum(e["steps"] for e in events(log, "end"))
    assert len(fallbacks) == len({(e["episode_id"], e["step"]) for e in fallbacks})  # once each
    # Nearly every step: the camera's confidence is clipped at 1.0, which this floor lets
    # through, and a few such steps can pass the OOD score too (the shift's draws follow the
    # wall clock).
    assert 0.95 * steps <= len(fallbacks) <= steps
    dark = [e for e in fallbacks if e["reason"] == "low_confidence"]
    assert len(dark) > steps / 2 and all(e["confidence"] < 0.99 for e in dark)
    # A step the camera was sure of still fails the synthetic training set's OOD statistics.
    assert all(e["ood_score"] > e["ood_threshold"] for e in fallbacks if e["reason"] == "ood")
    sidecars = sorted((landing / "captures").glob("*_ood.json"))
    assert len(sidecars) == 2 and "ood" in CAPTURE_REASONS
    assert json.loads(sidecars[0].read_text())["reason"] == "ood"
    report = ingest(tmp_path, landing, params)
    assert not report.quarantined, report
    episodes, step_rows = read_dataset(tmp_path / "dataset")
    assert all("ood" in reasons for reasons in episodes["edge_case_reasons"].to_pylist())
    # The operator drove every refused step: the next fine-tune has a label on each of them.
    driven = step_rows.filter(step_rows["intervention"])
    assert driven.num_rows >= len(fallbacks)
    assert None not in driven["corrected_action"].to_pylist()


def test_a_part_none_of_the_policys_parts_resembles_goes_to_the_operator_from_its_first_step(
    params, tmp_path
):
    from pipelines.training.onnx_export import save_policy_for_edge
    from tests.pipelines.test_onnx_export import observations, tiny_net

    # A policy that only ever pushed 200 mm parts: every part on this line is new to it.
    net = tiny_net()
    net.config.trained_on = {"part_footprints_m": [0.2]}
    folder, _ = save_policy_for_edge(net, tmp_path / "policy", observations(2000), 0.01, 0.005)
    edge = EdgeParams(health_episodes=50, ood_false_alarm=0.01, min_confidence=0.0, fallback=True)
    log = one_episode_log(params, tmp_path, edge, folder)
    fallbacks = events(log, "fallback")
    (end,) = events(log, "end")
    assert [e["step"] for e in fallbacks] == list(range(end["steps"]))
    assert {e["reason"] for e in fallbacks} == {"novel_part"}
    assert all(e["ood_score"] > 0.1 and e["ood_threshold"] == 0.005 for e in fallbacks)
    captures = tmp_path / "landing" / "captures"
    (sidecar,) = captures.glob("*_novel_part.json")
    assert not list(captures.glob("*_ood.json")) and "novel_part" in CAPTURE_REASONS
    note = json.loads(sidecar.read_text())["operator_note"]
    assert "part footprint" in note and "mm from every part the policy trained on" in note
    from pipelines.ingest import read_dataset
    from tests.pipelines.test_ingest_helpers import ingest

    report = ingest(tmp_path, tmp_path / "landing", params)
    assert not report.quarantined, report
    episodes, steps = read_dataset(tmp_path / "dataset")
    assert "novel_part" in episodes["edge_case_reasons"].to_pylist()[0]
    assert all(steps["intervention"].to_pylist())  # the operator drove every step


def test_with_the_fallback_off_the_policy_drives_every_step(params, tmp_path, onnx_folder):
    edge = EdgeParams(health_episodes=50, ood_false_alarm=0.01, min_confidence=0.99, fallback=False)
    log = one_episode_log(params, tmp_path, edge, onnx_folder)
    assert events(log, "fallback") == [] and events(log, "end")
    assert not list((tmp_path / "landing" / "captures").glob("*_ood.json"))


def test_a_model_that_fails_its_health_check_is_rolled_back_reported_and_refused(
    params, tmp_path, policy_folder, onnx_folder
):
    edge = EdgeParams(health_episodes=2, ood_false_alarm=0.01, min_confidence=0.0, fallback=True)
    # An operator who never takes over: the untrained model's failures stay its own.
    absent = dataclasses.replace(params.record.operator, takeover_after_steps=10**6)
    params = dataclasses.replace(params, record=dataclasses.replace(params.record, operator=absent))
    cell = cell_process(params, tmp_path, edge, episodes_per_shift=10)
    box = tmp_path / "box"
    good = publish_folder(tmp_path, onnx_folder, 1)
    cell.step()
    # The gate saw this candidate succeed every time: anything less in production fails it.
    # (An untrained torch policy: an older bundle without the runtime's files.)
    bad = publish_folder(tmp_path, policy_folder, 2, lower_bound=1.0)
    cell.step()  # pulls it and runs the health window's first episode
    assert attested_lower_bound(box / "releases" / bad["bundle_id"]) == 1.0
    if cell.production.health.verdict is None:  # a safety stop would have ended it already
        assert cell.box.model.bundle_id == bad["bundle_id"] and cell.box.model.screen is None
        cell.step()  # the window's second episode
    assert cell.box.model.bundle_id == good["bundle_id"] and cell.box.model.screen is not None
    assert (box / "current").resolve().name == good["bundle_id"]
    (rollback,) = cell.production.rollbacks
    assert rollback["bundle_id"] == bad["bundle_id"] and rollback["restored"] == good["bundle_id"]
    verdict = rollback["verdict"]
    assert "below its trial interval's lower end 100%" in verdict or "safety stop" in verdict
    refused = json.loads((box / "refused.json").read_text())
    assert refused == {"bundle_ids": [bad["bundle_id"]]}
    for _ in range(2):  # the channel still names the bad bundle: the box keeps the good one
        cell.step()
        assert cell.box.model.bundle_id == good["bundle_id"]
    newer = publish_folder(tmp_path, onnx_folder, 3)
    cell.step()
    assert cell.box.model.bundle_id == newer["bundle_id"]
    assert json.loads((box / "refused.json").read_text()) == {"bundle_ids": []}
    summary = cell.finish()
    assert summary["rollbacks"] == cell.production.rollbacks
    (sidecar,) = (tmp_path / "landing" / "captures").glob("*_rollback.json")
    note = json.loads(sidecar.read_text())["operator_note"]
    assert f"from {bad['bundle_id']} to {good['bundle_id']}" in note


def test_the_health_window_fails_at_a_safety_stop_or_below_the_interval_else_passes():
    window = HealthWindow("b-1", 3, lower_bound=0.6)
    assert window.record(True, None) is None
    assert "1 safety stops (0 allowed) (safety stop: force)" in window.record(True, "force")
    assert window.record(False, None) is None  # judged already: the window is closed
    low = HealthWindow("b-2", 3, lower_bound=0.6)
    assert [low.record(s, None) for s in (True, False)] == [None, None]
    failed = low.record(False, None)  # 1 of 3: below 0.6, known before the window is whole
    assert "health window failed: 1/3 successes" in failed and "after activating b-2" in failed
    unreachable = HealthWindow("b-5", 5, lower_bound=0.8)  # 4 of 5 needed
    assert [unreachable.record(False, None) for _ in range(2)][-1] is not None
    fine = HealthWindow("b-3", 2, lower_bound=0.5)
    assert [fine.record(s, None) for s in (True, False)] == [None, None]
    assert fine.verdict == "passed"
    unattested = HealthWindow("b-4", 1, lower_bound=None)
    assert unattested.record(False, None) is None and unattested.verdict == "passed"


def test_the_box_watches_a_window_a_little_below_its_floor_before_it_rolls_back():
    doubtful = HealthWindow("b-6", 4, lower_bound=0.8, episodes_most=8)
    assert [doubtful.record(s, None) for s in (True, True, True, False)] == [None] * 4
    assert doubtful.verdict is None  # 3 of 4 is below 0.8, but not significantly
    assert [doubtful.record(True, None) for _ in range(4)] == [None] * 4
    assert doubtful.verdict == "passed"  # 7 of 8
    assert doubtful.as_record()["episodes_most"] == 8
    short = HealthWindow("b-7", 4, lower_bound=0.8, episodes_most=8)
    reasons = [short.record(s, None) for s in (True, True, True, False, True, False)]
    assert reasons[:-1] == [None] * 5  # a second failure: 7 of 8 can no longer be reached
    assert "4/6 successes" in reasons[-1] and "7 of 8 successes needed" in reasons[-1]


def test_the_lower_bound_is_read_from_the_attestation(tmp_path):
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"weights")
    init_keys(tmp_path / "keys", None, EXPIRY_S)
    (tmp_path / "attestation.json").write_bytes(attest(tmp_path / "keys", model))
    assert attested_lower_bound(tmp_path) == 0.8  # passing_predicate's candidate interval
    (tmp_path / "attestation.json").unlink()  # an override: no trial interval
    assert attested_lower_bound(tmp_path) is None
    assert attested_lower_bound(tmp_path / "missing") is None


def test_edge_params_are_in_params_yaml(params):
    assert dataclasses.asdict(params.edge).keys() == {
        "health_episodes",
        "ood_false_alarm",
        "min_confidence",
        "fallback",
        "footprint_tolerance_m",
        "health_max_episodes",
    }
