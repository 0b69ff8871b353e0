"""Failure-mode triage: signals on hand-made episodes, the rule order, and accuracy against
the reference cell's ground truth on recorded shifts (the slow test is the issue's gate)."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bench.triage import print_score as _print_score
from bench.triage import score, score_shift
from pipelines.contract import schema
from pipelines.ingest.landing import ingest_landing
from pipelines.ingest.store import read_dataset
from pipelines.quality.triage import (
    CLASSES,
    CONTROL,
    NOVEL_PART,
    PERCEPTION,
    PHYSICS,
    SAFETY,
    Counterfactual,
    Signals,
    SnapshotPart,
    TriageReport,
    classify,
    episode_signals,
    logged_starts,
    part_kinds,
    read_snapshot,
    triage,
    triage_dataset,
)
from pipelines.quality.triage.counterfactual import START_FRAMES
from pipelines.quality.triage.snapshots import snapshot_evidence
from pipelines.training import PolicyConfig, PolicyNet, save_policy
from tests.conftest import ROOT

SIM_POLICY = ROOT / "models" / "sim-policy"
START = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)


# --- hand-made episodes ----------------------------------------------------------------------


def _tables(
    episode_id: str,
    part_xy,
    pusher_xy,
    action,
    velocity,
    *,
    yaw=None,
    confidence=0.95,
    extent=0.060,
    success=False,
    safety_stop_kind=None,
):
    n = len(part_xy)
    yaw = np.zeros(n) if yaw is None else yaw
    conf = np.broadcast_to(np.asarray(confidence, dtype=float), (n,))
    vec = lambda rows, k: pa.array([list(map(float, r)) for r in rows], pa.list_(pa.float32(), k))  # noqa: E731
    steps = pa.table(
        {
            "episode_id": [episode_id] * n,
            "step": pa.array(range(n), pa.int32()),
            "time_s": np.arange(n) * 0.05,
            "joint_position": vec(pusher_xy, 2),
            "joint_velocity": vec(velocity, 2),
            "part_pose": vec(np.column_stack([part_xy, yaw]), 3),
            "part_confidence": pa.array(conf, pa.float32()),
            "action": vec(action, 2),
            "intervention": [False] * n,
            "corrected_action": pa.array([None] * n, pa.list_(pa.float32(), 2)),
        },
        schema=schema.STEPS_SCHEMA,
    )
    stops = int(safety_stop_kind is not None)
    episode = {
        "episode_id": episode_id,
        "cell_id": "cell-07",
        "robot_serial": "r",
        "policy_version": "p",
        "sensor_calibration_id": "c",
        "software_version": "s",
        "source_uri": "u",
        "source_sha256": "0" * 64,
        "source_chunk": None,
        "ingest_run_id": "run",
        "ingested_at": START,
        "realloop_version": "0",
        "start_time": START,
        "target": [0.15, 0.0],
        "part_extent_m": [extent, extent],
        "success": success,
        "failure_cause": None if success else ("safety_stop" if stops else "timeout"),
        "safety_stops": stops,
        "safety_stop_kind": safety_stop_kind,
        "interventions": 0,
        "steps": n,
        "cycle_time_s": n * 0.05,
        "edge_case": False,
        "edge_case_reasons": None,
        "attachments": None,
    }
    return pa.Table.from_pylist([episode], schema=schema.EPISODES_SCHEMA), steps


def _push(
    lag: int,
    n: int = 100,
    seed: int = 0,
    pose_noise=0.001,
    offset=(0.0, 0.0),
    extent=0.060,
    slide=False,
):
    """A pusher driven by a smooth random command that reaches the drives `lag` steps late,
    pushing a part it touches; the camera sees the part with noise and an offset."""
    rng = np.random.default_rng(seed)
    command = np.clip(np.cumsum(rng.normal(0, 0.15, (n, 2)), axis=0), -1, 1)
    velocity = np.zeros((n, 2))
    velocity[lag:] = command[: n - lag] * 0.30
    pusher = np.cumsum(velocity, axis=0) * 0.05 - 0.1
    contact = 0.012 + extent / 2
    part = pusher + np.array([contact + 0.002, 0.0])  # resting just ahead of the pusher
    if slide:  # halfway, the part glides 10 cm ahead of the pusher within 25 steps
        part[n // 2 :, 0] += np.minimum(np.arange(n - n // 2) * 0.004, 0.1)
    perceived = part + np.asarray(offset) + rng.normal(0, pose_noise, (n, 2))
    return perceived, pusher, command, velocity


def _signals_of(tables, params) -> Signals:
    return episode_signals(*tables, params.cell, params.triage)[0]


@pytest.mark.parametrize("lag", [1, 3, 5])
def test_latency_is_the_lag_of_best_correlation(params, lag):
    perceived, pusher, command, velocity = _push(lag)
    s = _signals_of(_tables("e-1", perceived, pusher, command, velocity), params)
    assert s.latency_steps == lag
    assert s.tracking_error_mps < 1e-6


def test_camera_offset_shows_as_the_pusher_inside_the_part(params):
    clean = _signals_of(_tables("e-1", *_push(1, offset=(0.0, 0.0))), params)
    offset = _signals_of(_tables("e-1", *_push(1, offset=(-0.02, 0.0))), params)
    assert clean.penetration_m < 0.004
    assert offset.penetration_m == pytest.approx(0.02, abs=0.004)


def test_pose_jitter_estimates_the_camera_noise(params):
    for noise in (0.002, 0.006):
        perceived, pusher, command, velocity = _push(1, n=120, pose_noise=noise)
        far = pusher + np.array([0.2, 0.0])  # the pusher well clear of the part
        s = _signals_of(_tables("e-1", perceived, far, command, velocity), params)
        assert s.pose_jitter_m == pytest.approx(noise, rel=0.3)


def test_a_box_turns_a_cylinder_does_not(params):
    rng = np.random.default_rng(1)
    turning = np.linspace(0, 1.2, 100) + rng.normal(0, 0.05, 100)
    still = rng.normal(0, 0.05, 100)
    box = _signals_of(_tables("e-1", *_push(1), yaw=turning, extent=0.056), params)
    cylinder = _signals_of(_tables("e-1", *_push(1), yaw=still), params)
    assert box.yaw_turn_rad > params.triage.max_part_turn_rad > cylinder.yaw_turn_rad
    assert box.extent_offset_m == pytest.approx(-0.004, abs=1e-6)


@pytest.mark.parametrize("offset", [0.008, -0.008])
def test_push_gap_is_the_camera_offset_along_the_push(params, offset):
    """Pushed along +x, a camera offset along x shows as the gap between the pusher and the
    part's edge while they move together: positive ahead, negative (inside) behind."""
    n = 100
    velocity = np.tile([0.10, 0.0], (n, 1))  # the pusher drives the part along +x
    pusher = np.column_stack([np.arange(n) * 0.005 - 0.2, np.zeros(n)])
    contact = params.cell.pusher_radius_m + 0.060 / 2
    rng = np.random.default_rng(3)
    part = pusher + np.array([contact + offset, 0.0]) + rng.normal(0, 0.001, (n, 2))
    s = _signals_of(_tables("e-1", part, pusher, velocity / 0.30, velocity), params)
    assert s.push_gap_m == pytest.approx(offset, abs=0.002)
    assert s.penetration_m == pytest.approx(max(0.0, -offset), abs=0.003)


def test_no_push_no_push_gap(params):
    perceived, pusher, command, velocity = _push(1)
    far = pusher - np.array([0.2, 0.0])  # the pusher never near the part
    s = _signals_of(_tables("e-1", perceived, far, command, velocity), params)
    assert np.isnan(s.push_gap_m)


def test_a_part_running_ahead_of_the_pusher_slides(params):
    still = _signals_of(_tables("e-1", *_push(1, pose_noise=0.0005)), params)
    sliding = _signals_of(_tables("e-1", *_push(1, pose_noise=0.0005, slide=True)), params)
    assert still.slide_m < 0.01 < params.triage.max_slide_m < sliding.slide_m


def _healthy(**changes) -> Signals:
    base = dict(
        episode_id="e-1",
        steps=120,
        success=False,
        failure_cause="timeout",
        safety_stops=0,
        safety_stop_kind=None,
        interventions=0,
        part_extent_m=0.060,
        extent_offset_m=0.0,
        yaw_turn_rad=0.2,
        confidence_mean=0.95,
        confidence_min=0.9,
        pose_jitter_m=0.002,
        penetration_m=0.002,
        push_gap_m=0.001,
        latency_steps=1.0,
        tracking_error_mps=0.02,
        slide_m=0.002,
        final_distance_m=0.05,
    )
    return Signals(**(base | changes))


@pytest.mark.parametrize(
    ("changes", "expected", "rule"),
    [
        (
            {"safety_stops": 1, "safety_stop_kind": "speed", "confidence_mean": 0.3},
            SAFETY,
            "safety_stop",
        ),
        (
            {"extent_offset_m": 0.03, "latency_steps": 4.0},
            NOVEL_PART,
            "novel_part_with_healthy_perception",
        ),
        # a larger part whose extra size the camera's offset cancels: not the part's fault
        (
            {"extent_offset_m": 0.03, "push_gap_m": -0.008, "latency_steps": 4.0},
            CONTROL,
            "control_off",
        ),
        # no pushing steps to tell which way the camera is offset: the part is not blamed
        (
            {"extent_offset_m": 0.03, "push_gap_m": float("nan"), "latency_steps": 4.0},
            CONTROL,
            "control_off",
        ),
        # a part that turns like a box is listed, never blamed on its own
        ({"yaw_turn_rad": 2.0, "latency_steps": 4.0}, CONTROL, "control_off"),
        ({"yaw_turn_rad": 2.0, "slide_m": 0.075}, PHYSICS, "strongest_evidence"),
        # a novel part seen by an unhealthy camera: perception comes first
        ({"extent_offset_m": 0.03, "penetration_m": 0.03}, PERCEPTION, "perception_off"),
        (
            {"confidence_mean": 0.6, "latency_steps": 4.0, "slide_m": 0.15},
            PERCEPTION,
            "perception_off",
        ),
        ({"pose_jitter_m": 0.01}, PERCEPTION, "perception_off"),
        ({"latency_steps": 4.0, "slide_m": 0.15}, CONTROL, "control_off"),
        ({"tracking_error_mps": 0.08}, CONTROL, "control_off"),
        ({"slide_m": 0.15}, PHYSICS, "physics_off"),
        ({"slide_m": 0.075, "latency_steps": 1.5}, PHYSICS, "strongest_evidence"),
    ],
)
def test_rules_in_order(params, changes, expected, rule):
    verdict = classify(_healthy(**changes), params.triage)
    assert (verdict.failure_class, verdict.rule) == (expected, rule)
    assert verdict.evidence, "a verdict names the signals that decided it"
    if rule != "strongest_evidence":
        assert all(e.strength > 1 for e in verdict.evidence)
    shaped = abs(changes.get("extent_offset_m", 0.0)) > 0.0035 or changes.get("yaw_turn_rad", 0) > 1
    if shaped and expected != NOVEL_PART:
        assert NOVEL_PART in verdict.also, "the part's shape is still shown to people"


def test_a_blamed_part_names_the_push_gap(params):
    verdict = classify(_healthy(extent_offset_m=0.03, push_gap_m=0.006), params.triage)
    assert [e.signal for e in verdict.evidence] == ["extent_offset_m"]
    assert verdict.evidence[0].detail.startswith("push_gap_m 0.0060 >=")


# --- snapshots: the part as the image shows it, the camera's offset --------------------------

FACE, PART_BLUE, NAVY = (237, 237, 237), (31, 119, 180), (0, 0, 128)


def _snapshot(centre_m, radius_m, half_width_m=0.30, size=(360, 480)) -> bytes:
    """A snapshot drawn like the cell's: the table's grey face in a white figure, the true part
    as a filled disc, a dark line across it (an occluding outline), a part-coloured legend
    swatch outside the table."""
    from PIL import Image

    image = np.full((*size, 3), 255, dtype=np.uint8)
    top, left, side = 80, 50, 250  # the table's pixels
    image[top : top + side, left : left + side] = FACE
    px = side / (2 * half_width_m)
    rows, cols = np.mgrid[0 : size[0], 0 : size[1]]
    cx, cy = left + (centre_m[0] + half_width_m) * px, top + (half_width_m - centre_m[1]) * px
    image[np.hypot(cols + 0.5 - cx, rows + 0.5 - cy) <= radius_m * px] = PART_BLUE
    image[int(cy) - 1 : int(cy) + 1, left : left + side] = NAVY
    image[20:30, 400:420] = PART_BLUE
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("centre", "radius"), [((0.05, -0.08), 0.045), ((-0.2, 0.1), 0.028)])
def test_a_snapshot_shows_where_the_part_is_and_how_large(centre, radius):
    part = read_snapshot(_snapshot(centre, radius), 0.30)
    assert part is not None
    # a pixel is 2.4 mm: the fitted circle is good to half of one
    assert abs(part.x_m - centre[0]) < 0.0012 and abs(part.y_m - centre[1]) < 0.0012
    assert abs(part.radius_m - radius) < 0.0015


def test_an_unreadable_or_empty_snapshot_measures_nothing(tmp_path):
    assert read_snapshot(b"not a png", 0.30) is None
    assert read_snapshot(tmp_path / "missing.png", 0.30) is None
    from PIL import Image

    blank = io.BytesIO()
    Image.new("RGB", (480, 360), FACE).save(blank, format="PNG")
    assert read_snapshot(blank.getvalue(), 0.30) is None  # a table, no part


def _shift_of_lights(offset_at, n_episodes=30, steps=5):
    """Episodes at confidences 0.6..0.95, each with one snapshot: the true part at the origin,
    perceived at the camera's offset for that light."""
    tables, snapshots = [], []
    for i, light in enumerate(np.linspace(0.6, 0.95, n_episodes)):
        offset = offset_at(light)
        part = np.tile(offset, (steps, 1))
        still = np.zeros((steps, 2))
        tables.append(_tables(f"e-{i:02d}", part, still - 0.1, still, still, confidence=light))
        snapshots.append((f"e-{i:02d}", 2, SnapshotPart(0.0, 0.0, 0.03, 40)))
    episodes = pa.concat_tables([t[0] for t in tables])
    return episodes, pa.concat_tables([t[1] for t in tables]), snapshots


def test_the_camera_offset_is_fitted_against_the_light(params):
    def offset_at(light):  # the line's camera: the offset grows as the light (confidence) drops
        return np.array([0.012 + 0.045 * (0.93 - light), -0.006 + 0.022 * (0.93 - light)])

    episodes, steps, snapshots = _shift_of_lights(offset_at)
    ids = episodes.column("episode_id").to_pylist()
    evidence = snapshot_evidence(snapshots, steps, ids, params.triage)
    lights = np.linspace(0.6, 0.95, len(ids))
    for episode_id, light in zip(ids, lights, strict=True):
        radius, offset = evidence[episode_id]
        assert radius == 0.03
        assert offset == pytest.approx(np.linalg.norm(offset_at(light)), abs=1e-4)
    few = dataclasses.replace(params.triage, min_snapshots=len(ids) + 1)
    assert all(np.isnan(o) for _, o in snapshot_evidence(snapshots, steps, ids, few).values())


@pytest.mark.parametrize(
    ("changes", "expected", "rule"),
    [
        # a larger part, in light where the camera's offset is small, the offset along the push
        # adding to its extra size: the part; even when the pusher appears inside it
        (
            {"part_radius_m": 0.0446, "push_gap_m": 0.009, "penetration_m": 0.015},
            NOVEL_PART,
            "novel_part_with_small_camera_offset",
        ),
        # the same part where the camera's offset is past what a standard part tolerates
        (
            {"part_radius_m": 0.0446, "push_gap_m": 0.009, "camera_offset_m": 0.026},
            PERCEPTION,
            "perception_off",
        ),
        # ...or where the camera's offset along the push cancels its extra size
        ({"part_radius_m": 0.0446, "push_gap_m": -0.009}, PERCEPTION, "perception_off"),
        # a box (smaller in its snapshot) that did not swing round: the part
        (
            {"part_radius_m": 0.0276, "yaw_turn_rad": 1.2},
            NOVEL_PART,
            "novel_part_with_small_camera_offset",
        ),
        # a box chased round the table: a cylinder would have been too
        ({"part_radius_m": 0.0276, "yaw_turn_rad": 2.1}, PERCEPTION, "perception_off"),
        # a standard part in the snapshot: never the part, whatever the camera measured
        ({"part_radius_m": 0.0296, "extent_offset_m": 0.03}, PERCEPTION, "perception_off"),
        # no snapshot of this episode: the camera's extent measurement decides the kind
        (
            {"extent_offset_m": 0.03, "push_gap_m": 0.004},
            NOVEL_PART,
            "novel_part_with_small_camera_offset",
        ),
    ],
)
def test_snapshot_rules(params, changes, expected, rule):
    seen = {"camera_offset_m": 0.016, "penetration_m": 0.012} | changes
    verdict = classify(_healthy(**seen), params.triage)
    assert (verdict.failure_class, verdict.rule) == (expected, rule)
    if expected == NOVEL_PART:
        signals = [e.signal for e in verdict.evidence]
        assert signals[-1] == "camera_offset_m" and all(e.strength > 1 for e in verdict.evidence)


def test_novel_part_episodes_for_data_selection(params):
    """Every episode with another part, failed or not, and every failure blamed on a part."""
    parts = []
    for i, extent in enumerate([0.060, 0.090, 0.061, 0.052]):
        still = np.zeros((5, 2))
        parts.append(
            _tables(f"e-{i}", still, still - 0.1, still, still, extent=extent, success=True)
        )
    episodes = pa.concat_tables([p[0] for p in parts])
    seen = {"e-2": (0.0446, 0.016)}  # its snapshot shows a larger part than the camera measured
    kinds = part_kinds(episodes, seen, params.triage)
    assert kinds == {"e-0": "standard", "e-1": "larger", "e-2": "larger", "e-3": "smaller"}
    blamed = classify(_healthy(episode_id="e-9", extent_offset_m=0.03), params.triage)
    report = TriageReport(5, [blamed], {}, [], kinds)
    assert report.novel_part_episodes() == ["e-1", "e-2", "e-3", "e-9"]


# --- replay with a standard part (triage/counterfactual.py) ---------------------------------


@pytest.mark.parametrize(
    ("changes", "expected", "rule"),
    [
        # a standard part placed from this start in most replays: the part, even where the
        # camera's offset is past rule 2's limit or cancels the extra size along the push
        (
            {"camera_offset_m": 0.021, "standard_part_success": 0.75},
            NOVEL_PART,
            "novel_part_replayed",
        ),
        (
            {"push_gap_m": -0.009, "standard_part_success": 0.875},
            NOVEL_PART,
            "novel_part_replayed",
        ),
        # a standard part failed as well: not the part, though rule 2's proxies blame it
        ({"standard_part_success": 0.25}, PERCEPTION, "perception_off"),
        ({"standard_part_success": 0.6}, PERCEPTION, "perception_off"),  # not above the limit
    ],
)
def test_a_replay_decides_for_the_episodes_it_ran_on(params, changes, expected, rule):
    larger = {"part_radius_m": 0.0446, "push_gap_m": 0.009, "camera_offset_m": 0.016}
    verdict = classify(_healthy(penetration_m=0.012, **(larger | changes)), params.triage)
    assert (verdict.failure_class, verdict.rule) == (expected, rule)
    if expected == NOVEL_PART:
        assert verdict.evidence[-1].signal == "standard_part_success"
        assert all(e.strength > 1 for e in verdict.evidence)


def test_a_logged_start_is_the_first_frames_of_the_episode():
    perceived = np.array([[0.010, 0.020]] * 8) + np.linspace(-0.002, 0.002, 8)[:, None]
    pusher = np.tile([-0.1, 0.05], (8, 1)) + np.arange(8)[:, None] * 0.001
    episodes, steps = _tables("e-1", perceived, pusher, np.zeros((8, 2)), np.zeros((8, 2)))
    [start] = logged_starts(episodes, steps, {"e-1": 0.8}, ["e-1"])
    assert start.pusher == pytest.approx(pusher[0])
    assert start.part == pytest.approx(perceived[:START_FRAMES].mean(axis=0), abs=1e-6)
    assert start.target == pytest.approx(episodes.column("target")[0].as_py())
    assert start.confidence == 0.8
    with pytest.raises(ValueError, match="e-2: no first step"):
        logged_starts(episodes, steps, {"e-2": 0.8}, ["e-2"])


def test_triage_replays_the_failures_of_other_parts_in_good_light(params, small_shift):
    """Every failure of another part with a small camera offset, and only those, goes to the
    plug-in; what it returns decides them."""
    root, _ = small_shift
    asked: list = []

    def replay(policy, calibration, cell, starts, draws, seed):
        asked.extend(starts)
        assert draws == params.triage.replay_draws
        return [1.0] * len(starts)

    counterfactual = Counterfactual(replay, Path("policy"), Path("calibration.yaml"))
    args = (params.cell, params.triage, params.record.capture_window_steps)
    captures = root / "data" / "landing" / "captures"
    report = triage_dataset(root / "data" / "dataset", captures, *args, counterfactual)
    plain = triage_dataset(root / "data" / "dataset", captures, *args)
    expected = {
        e
        for e, s in plain.signals.items()
        if plain.parts[e] in ("larger", "smaller")
        and s.safety_stops == 0
        and s.camera_offset_m <= params.triage.replay_max_camera_offset_m
    }
    assert expected, "the small shift has failures of other parts in good light"
    assert {s.episode_id for s in asked} == expected and report.replayed() == len(expected)
    blamed = {v.episode_id for v in report.verdicts if v.rule == "novel_part_replayed"}
    assert blamed == expected
    # episodes another policy ran are not judged by this one
    asked.clear()
    other = dataclasses.replace(counterfactual, policy_version="cycle-7")
    report = triage_dataset(root / "data" / "dataset", captures, *args, other)
    assert asked == [] and report.replayed() == 0


# --- recorded shifts -------------------------------------------------------------------------


def _policy(params, tmp_path_factory):
    """The repository's sim policy, else a small one pretrained here (minutes, not hours)."""
    from pipelines.training.policy import Policy, load_policy
    from refcell.pretrain import pretrain
    from refcell.world import load_world

    if (SIM_POLICY / "model.safetensors").is_file():
        return load_policy(SIM_POLICY)
    small = dataclasses.replace(
        params.pretrain, demo_episodes=60, dagger_rounds=2, dagger_episodes=40, epochs=20
    )
    return Policy(pretrain(load_world("sim"), params.cell, small))


def _record_and_ingest(params, root: Path, policy, episodes: int, seed: int) -> dict:
    from refcell.shift import record_shift
    from refcell.world import load_world

    landing = root / "data" / "landing"
    summary = record_shift(
        load_world("line"),
        params.cell,
        params.record,
        policy,
        episodes,
        landing,
        seed,
        interventions=False,
        policy_version=policy.name,
        shift_start=START,
    )
    report = ingest_landing(
        landing,
        root / "data" / "dataset",
        root / "data" / "quarantine",
        params.cell,
        params.ingest,
        "run-1",
    )
    assert report.as_dict()["episodes_ingested"] == episodes
    return summary


def _truth(summary: dict) -> dict[str, str | None]:
    rows = [json.loads(line) for line in Path(summary["ground_truth"]).read_text().splitlines()]
    return {r["episode_id"]: r["true_cause"] for r in rows}


@pytest.fixture(scope="module")
def small_shift(params, tmp_path_factory):
    """A small recorded and ingested shift, once per module: the fast tests' fixture."""
    root = tmp_path_factory.mktemp("triage-small")
    policy = _policy(params, tmp_path_factory)
    summary = _record_and_ingest(params, root, policy, episodes=40, seed=31)
    return root, summary


def test_every_failure_and_capture_gets_a_class(params, small_shift):
    root, summary = small_shift
    report = triage_dataset(
        root / "data" / "dataset",
        root / "data" / "landing" / "captures",
        params.cell,
        params.triage,
        params.record.capture_window_steps,
    )
    episodes, _ = read_dataset(root / "data" / "dataset")
    failed = [e for e in episodes.to_pylist() if not e["success"]]
    assert len(report.verdicts) == len(failed) > 0
    assert {v.episode_id for v in report.verdicts} == {e["episode_id"] for e in failed}
    stopped = {e["episode_id"] for e in failed if e["safety_stops"]}
    assert {v.episode_id for v in report.verdicts if v.failure_class == SAFETY} == stopped
    captures = sum(len(e["edge_case_reasons"] or []) for e in episodes.to_pylist())
    assert len(report.captures) == captures == len(summary["captures"])
    assert all(c["class"] in CLASSES and c["step"] is not None for c in report.captures)
    ranks = [c["rank"] for c in report.captures]
    assert ranks == list(range(1, len(ranks) + 1))
    # failed episodes' captures come first, and take their episode's verdict
    outcome = [c["episode_failed"] for c in report.captures]
    assert outcome == sorted(outcome, reverse=True)
    verdicts = {v.episode_id: v.failure_class for v in report.verdicts}
    for capture in report.captures:
        if capture["episode_failed"]:
            assert capture["class"] == verdicts[capture["episode_id"]]
            assert capture["decided_by"] == "episode"
        else:
            assert capture["decided_by"] == "window"
    # With the trained sim policy, most failures are put where the ground truth puts them.
    # The small policy pretrained here when models/sim-policy is absent (a fresh clone) fails
    # for reasons the real one does not, so the agreement bar applies to the real one only.
    if (SIM_POLICY / "config.json").is_file():
        truth = _truth(summary)
        agree = sum(truth[v.episode_id] == v.failure_class for v in report.verdicts)
        assert agree / len(report.verdicts) >= 0.8


def test_captures_of_a_successful_episode_are_judged_on_their_window(params):
    perceived, pusher, command, velocity = _push(3, n=100, offset=(-0.02, 0.0))
    perceived[:60] = pusher[:60] + np.array([0.2, 0.0])  # far from the part until step 60
    episodes, steps = _tables("e-1", perceived, pusher, command, velocity, success=True)
    episodes = episodes.set_column(
        episodes.schema.get_field_index("edge_case_reasons"),
        "edge_case_reasons",
        pa.array([["low_confidence"]], pa.list_(pa.string())),
    )
    from pipelines.quality.triage import CaptureRef

    early = triage(
        episodes,
        steps,
        params.cell,
        params.triage,
        [CaptureRef("e-1", "low_confidence", 40, None, None)],
        40,
    )
    whole = triage(episodes, steps, params.cell, params.triage)
    assert early.verdicts == [] and early.captures[0]["decided_by"] == "window"
    assert early.captures[0]["class"] == CONTROL  # before the push: only the late commands
    assert whole.captures[0]["class"] == PERCEPTION  # the push shows the camera's offset
    assert whole.captures[0]["priority"] == "low"


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "triage", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_triage_command_reports_counts_worst_and_queue(params, params_path, small_shift):
    root, _ = small_shift
    run = _cli("--params", str(params_path), "--json", cwd=root)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert set(report["counts"]) == set(CLASSES)
    assert sum(report["counts"].values()) == report["failed_episodes"]
    for cls, rows in report["worst"].items():
        assert len(rows) == min(report["counts"][cls], params.triage.worst_per_class)
        for row in rows:
            assert row["class"] == cls and row["evidence"] and "signals" in row
    assert report["captures"] == len(report["queue"]) > 0
    human = _cli("--params", str(params_path), cwd=root)
    assert human.returncode == 0 and "review queue" in human.stdout


def test_triage_command_fails_in_one_line_without_a_dataset(params_path, tmp_path):
    run = _cli("--params", str(params_path), "--json", cwd=tmp_path)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("realloop: ") and len(run.stderr.strip().splitlines()) == 1


def test_triage_command_replays_with_a_policy_and_a_calibration(params_path, small_shift, tmp_path):
    root, _ = small_shift
    policy = save_policy(PolicyNet(PolicyConfig()), tmp_path / "policy")
    calibration = tmp_path / "sim-calibration.yaml"
    calibration.write_text("world:\n  lighting: {amplitude: 1.0}\n")
    both = ("--policy", str(policy), "--calibration", str(calibration))
    run = _cli("--params", str(params_path), *both, "--json", cwd=root)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["replayed"] > 0
    human = _cli("--params", str(params_path), *both, cwd=root)
    assert f"{report['replayed']} failures replayed with the standard part" in human.stdout


@pytest.mark.parametrize(
    "args",
    [("--policy", "models/sim-policy"), ("--calibration", "sim-calibration.yaml")],
)
def test_triage_command_wants_policy_and_calibration_together(params_path, small_shift, args):
    root, _ = small_shift
    run = _cli("--params", str(params_path), *args, "--json", cwd=root)
    assert run.returncode == 1 and run.stdout == ""
    assert (
        run.stderr.startswith("realloop: ")
        and "--policy and --calibration go together" in run.stderr
    )
    assert len(run.stderr.strip().splitlines()) == 1


def test_triage_command_names_a_missing_or_wrong_policy_or_calibration(
    params_path, small_shift, tmp_path
):
    root, _ = small_shift
    policy, calibration = tmp_path / "policy", tmp_path / "sim-calibration.yaml"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    calibration.write_text("world: {}\n")
    not_calibration = tmp_path / "params.yaml"
    not_calibration.write_text("cell: {}\n")
    for args, message in [
        ((tmp_path / "elsewhere", calibration), "elsewhere: not a policy folder"),
        ((policy, tmp_path / "none.yaml"), "none.yaml: no such file"),
        ((policy, not_calibration), "params.yaml: no `world:` section"),
    ]:
        paths = ("--policy", str(args[0]), "--calibration", str(args[1]))
        run = _cli("--params", str(params_path), *paths, "--json", cwd=root)
        assert run.returncode == 1 and run.stdout == "" and message in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


# --- the gate: precision on a full shift -----------------------------------------------------

GATE_EPISODES, GATE_SEED = 1000, 4242  # seed chosen before the rules were scored on it
MIN_CASES, MIN_PRECISION = 20, 0.80
# Every class with at least MIN_CASES true cases but novel_part is held to MIN_PRECISION,
# episodes and captures alike. novel_part is not: whether a standard part would have made it
# where a novel one failed is close to a coin flip in the light where the part can be to
# blame (docs/triage.md, "Limits"); it is held to finding more of the novel-part failures
# with the snapshots than without them (its precision is printed, and bench/triage reports it).


@pytest.mark.slow
def test_precision_against_ground_truth_on_a_recorded_shift(params, tmp_path_factory):
    root = tmp_path_factory.mktemp("triage-gate")
    policy = _policy(params, tmp_path_factory)
    summary = _record_and_ingest(params, root, policy, GATE_EPISODES, GATE_SEED)
    truth = Path(summary["ground_truth"])
    title = f"{GATE_EPISODES} episodes, seed {GATE_SEED}, policy {policy.name}"
    scored = {}
    for snapshots in (False, True):
        pairs = score_shift(params, root, truth, snapshots)
        scored[snapshots] = {kind: score(p) for kind, p in pairs.items()}
        for kind, found in scored[snapshots].items():
            _print_score(f"{title}: {kind} of failed episodes, snapshots {snapshots}", found)
    for found in scored[True].values():
        gated = {c: m for c, m in found["classes"].items() if m["support"] >= MIN_CASES}
        assert PERCEPTION in gated and SAFETY in gated, found["classes"]
        for cls, m in gated.items():
            if cls != NOVEL_PART:
                assert m["precision"] is not None and m["precision"] >= MIN_PRECISION, (cls, m)
    seen, unseen = (scored[k]["episodes"]["classes"][NOVEL_PART] for k in (True, False))
    assert seen["recall"] > unseen["recall"], (seen, unseen)
    # The replay with a standard part in the sim calibrated from this shift (docs/triage.md,
    # "Replaying with a standard part") blames the part more precisely than rule 2, and keeps
    # perception's precision.
    folder = save_policy(policy.net, tmp_path_factory.mktemp("gate-policy") / "policy")
    replayed = score(score_shift(params, root, truth, True, folder)["episodes"])
    _print_score(f"{title}: episodes of failed episodes, replayed", replayed)
    found = replayed["classes"]
    assert found[NOVEL_PART]["precision"] > seen["precision"], (found[NOVEL_PART], seen)
    assert found[PERCEPTION]["precision"] >= MIN_PRECISION, found[PERCEPTION]
