"""Drift and the retraining trigger: on synthetic tables where exactly one thing changes, on
hand-computed measures, and on two recorded shifts of the reference cell (sim vs line)."""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from scipy.spatial.distance import jensenshannon
from scipy.stats import fisher_exact, ks_2samp

from pipelines.contract import schema
from pipelines.quality import drift
from pipelines.quality.drift.features import (
    ACTION_LATENCY,
    CONTACT_OFFSET_X,
    CONTACT_OFFSET_Y,
    CYCLE_TIME,
    FAILURE_MODE,
    FEATURES,
    PART_SIZE,
    PERCEPTION_CONFIDENCE,
    POSE_JITTER,
    TRACKING_ERROR,
)

MAX_SPEED = 0.30  # params.yaml cell.max_speed_mps
CONTACT_M = 0.012 + 0.06 / 2  # params.yaml cell.pusher_radius_m + half the part's extent
START = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
SUCCESS_ONLY = {"none": 1.0}
FEW_FAILURES = {"none": 0.85, "timeout": 0.1, "safety_stop:speed": 0.05}


def synthetic(
    seed: int,
    episodes: int = 60,
    *,
    confidence: tuple[float, float] = (0.93, 0.02),
    pose_noise_m: float = 0.002,
    latencies: tuple[int, ...] = (0,),
    tracking_noise_mps: float = 0.01,
    steps: tuple[int, int] = (50, 80),
    failures: dict[str, float] = FEW_FAILURES,
    edge_cases: int = 0,
    camera_bias_m: tuple[float, float] = (0.0, 0.0),
    part_sizes_m: tuple[float, ...] = (0.06,),
    prefix: str = "cell-07-20261201T060000Z",
) -> tuple[pa.Table, pa.Table]:
    """(episodes, steps) conforming to the schema. Commands are smooth sines; the measured
    velocity is the command `latency` steps late (episode i gets latencies[i % len]; plus the
    one row by which any response shows), plus noise. For the first half of an episode the
    pusher stays far from a still part, so pose changes are noise; for the second it pushes
    the part (on its contact circle, moving towards it), which the camera sees off by its
    bias. Episode i's part is part_sizes_m[i % len], measured with the camera's 2 mm noise
    per axis (drawn apart, so that the other draws do not depend on it)."""
    rng = np.random.default_rng(seed)
    rng_extents = np.random.default_rng([seed, 1])
    extents = [
        (part_sizes_m[i % len(part_sizes_m)] + rng_extents.normal(0.0, 0.002, 2)).tolist()
        for i in range(episodes)
    ]
    ep_rows: dict[str, list] = {f.name: [] for f in schema.EPISODES_SCHEMA}
    st_rows: dict[str, list] = {f.name: [] for f in schema.STEPS_SCHEMA}
    modes, shares = list(failures), list(failures.values())
    for index in range(episodes):
        episode_id = f"{prefix}-{index:05d}"
        n = int(rng.integers(*steps))
        latency = latencies[index % len(latencies)]
        t = np.arange(n)[:, None]
        action = 0.8 * np.sin(rng.uniform(0.15, 0.4, 2) * t + rng.uniform(0, 2 * np.pi, 2))
        velocity = rng.normal(0.0, tracking_noise_mps, (n, 2))
        velocity[1 + latency :] += action[: n - 1 - latency] * MAX_SPEED
        part = rng.normal(0.0, pose_noise_m, (n, 2))
        pusher = np.array([0.25, -0.25]) + rng.normal(0.0, 0.001, (n, 2))
        pushing = np.arange(n) >= n // 2
        heading = velocity / np.maximum(np.linalg.norm(velocity, axis=1, keepdims=True), 1e-9)
        pusher[pushing] = -CONTACT_M * heading[pushing]  # the part sits at the origin
        part[pushing] = rng.normal(0.0, 0.002, (pushing.sum(), 2)) + camera_bias_m
        conf = np.clip(rng.normal(*confidence, n), 0.0, 1.0)
        mode = str(rng.choice(modes, p=shares))
        stop_kind = mode.partition(":")[2] or None
        edge = index < edge_cases
        _append(
            ep_rows,
            episode_id=episode_id,
            cell_id="cell-07",
            robot_serial="GX-1",
            policy_version="policy-1",
            sensor_calibration_id="cal-1",
            software_version="sw-1",
            source_uri=f"file:///landing/{prefix}.mcap",
            source_sha256="0" * 64,
            source_chunk=None,
            ingest_run_id="run-1",
            ingested_at=START,
            realloop_version="test",
            start_time=START,
            target=[0.1, 0.1],
            part_extent_m=extents[index],
            success=mode == "none",
            failure_cause=None if mode == "none" else ("safety_stop" if stop_kind else mode),
            safety_stops=int(stop_kind is not None),
            safety_stop_kind=stop_kind,
            interventions=0,
            steps=n,
            cycle_time_s=n / 20,
            edge_case=edge,
            edge_case_reasons=["low_confidence"] if edge else None,
            attachments=None,
            trial_request_id=None,
            trial_arm=None,
            trial_attempt=None,
        )
        for i in range(n):
            _append(
                st_rows,
                episode_id=episode_id,
                step=i,
                time_s=i / 20,
                joint_position=pusher[i].tolist(),
                joint_velocity=velocity[i].tolist(),
                part_pose=[*part[i].tolist(), 0.0],
                part_confidence=float(conf[i]),
                action=action[i].tolist(),
                intervention=False,
                corrected_action=None,
            )
    return (
        pa.Table.from_pydict(ep_rows, schema=schema.EPISODES_SCHEMA),
        pa.Table.from_pydict(st_rows, schema=schema.STEPS_SCHEMA),
    )


def _append(rows: dict[str, list], **values) -> None:
    for name, value in values.items():
        rows[name].append(value)


@pytest.fixture(scope="module")
def baseline_tables():
    return synthetic(seed=1)


def drifted(result) -> set[str]:
    return {f.name for f in result.features if f.drifted}


# --- synthetic tables ---------------------------------------------------------------------------


def test_identical_distributions_neither_drift_nor_trigger(params, baseline_tables):
    result = drift.detect_drift(baseline_tables, synthetic(seed=2), params.cell, params.drift)
    assert drifted(result) == set()
    assert all(f.assessed for f in result.features)
    assert result.trigger is False and result.reasons == []
    assert result.new_edge_cases == 0


@pytest.mark.parametrize(
    ("feature", "shift"),
    [
        (PERCEPTION_CONFIDENCE, {"confidence": (0.80, 0.05)}),
        (POSE_JITTER, {"pose_noise_m": 0.005}),
        (TRACKING_ERROR, {"tracking_noise_mps": 0.025}),
        (CYCLE_TIME, {"steps": (75, 110)}),
        (FAILURE_MODE, {"failures": {"none": 0.5, "timeout": 0.3, "part_lost": 0.2}}),
    ],
)
def test_one_shifted_feature_drifts_alone(params, baseline_tables, feature, shift):
    result = drift.detect_drift(
        baseline_tables, synthetic(seed=3, **shift), params.cell, params.drift
    )
    assert drifted(result) == {feature}
    assert result.trigger is True
    assert len(result.reasons) == 1 and result.reasons[0].startswith(f"{feature} drifted: ")


@pytest.mark.parametrize("bias", [(0.015, 0.0), (0.0, -0.015)])
def test_a_knocked_camera_drifts_the_contact_offsets_and_nothing_else(
    params, baseline_tables, bias
):
    result = drift.detect_drift(
        baseline_tables, synthetic(seed=3, camera_bias_m=bias), params.cell, params.drift
    )
    assert drifted(result) and drifted(result) <= {CONTACT_OFFSET_X, CONTACT_OFFSET_Y}
    along = CONTACT_OFFSET_X if bias[0] else CONTACT_OFFSET_Y
    assert along in drifted(result)
    feature = next(f for f in result.features if f.name == along)
    shift = feature.current["median"] - feature.baseline["median"]
    assert np.sign(shift) == np.sign(sum(bias))  # the offsets move the way the camera did


def test_a_new_part_variant_drifts_the_part_size_and_nothing_else(params):
    """A fifth of the parts a new size (72 mm among 60 and 90 mm parts): the NOVEL measure sees
    the new cluster; the KS distance of the whole mixture alone would not."""
    known = (0.06, 0.06, 0.09, 0.06, 0.09)
    baseline = synthetic(seed=1, episodes=100, part_sizes_m=known)
    again = synthetic(seed=2, episodes=80, part_sizes_m=known)
    new = synthetic(seed=3, episodes=80, part_sizes_m=(*known[:4], 0.072))
    assert drifted(drift.detect_drift(baseline, again, params.cell, params.drift)) == set()
    result = drift.detect_drift(baseline, new, params.cell, params.drift)
    assert drifted(result) == {PART_SIZE}
    size = next(f for f in result.features if f.name == PART_SIZE)
    novel = next(m for m in size.measures if m.name == "novel")
    assert novel.drifted and novel.statistic == pytest.approx(16 / 80, abs=0.03)
    assert result.reasons[0].startswith(f"{PART_SIZE} drifted: NOVEL 0.2")


def test_latency_is_estimated_per_episode_and_its_shift_drifts(params, baseline_tables):
    mixed = synthetic(seed=4, latencies=(0, 1, 2, 3))
    samples = drift.extract_features(*mixed, params.cell, params.drift)
    assert samples[ACTION_LATENCY].episodes == 60
    assert samples[ACTION_LATENCY].values.tolist() == [i % 4 for i in range(60)]
    result = drift.detect_drift(
        baseline_tables, synthetic(seed=3, latencies=(3,)), params.cell, params.drift
    )
    latency = next(f for f in result.features if f.name == ACTION_LATENCY)
    assert latency.drifted and latency.baseline == {"0": 1.0} and latency.current == {"3": 1.0}
    # A late drive also tracks its commands worse: the two move together, nothing else does.
    assert drifted(result) == {ACTION_LATENCY, TRACKING_ERROR}


def test_new_edge_cases_trigger_at_the_threshold(params, baseline_tables):
    strict = dataclasses.replace(params.drift, min_new_edge_cases=20)
    below = drift.detect_drift(baseline_tables, synthetic(2, edge_cases=19), params.cell, strict)
    at = drift.detect_drift(baseline_tables, synthetic(2, edge_cases=20), params.cell, strict)
    assert below.trigger is False and below.new_edge_cases == 19
    assert at.trigger is True and at.new_edge_cases == 20 and drifted(at) == set()
    assert at.reasons == ["20 new edge-case episodes >= 20"]
    assert at.new_edge_case_reasons == {"low_confidence": 20}


def test_too_few_episodes_are_shown_but_not_judged(params, baseline_tables):
    few = synthetic(seed=3, episodes=10, confidence=(0.5, 0.05))
    result = drift.detect_drift(baseline_tables, few, params.cell, params.drift)
    confidence = next(f for f in result.features if f.name == PERCEPTION_CONFIDENCE)
    assert confidence.measures[0].drifted and not confidence.assessed
    assert not confidence.drifted and result.trigger is False


def test_plots_are_written_one_per_feature(params, baseline_tables, tmp_path):
    shifted = synthetic(seed=3, confidence=(0.8, 0.05))
    result = drift.detect_drift(baseline_tables, shifted, params.cell, params.drift, tmp_path)
    expected = [str(tmp_path / f"{f.name}.png") for f in FEATURES]
    assert result.plots == expected
    assert [f.plot for f in result.features] == expected
    for path in expected:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind


# --- the measures, against hand-computed numbers ------------------------------------------------


def test_psi_matches_the_formula_on_a_hand_computed_case():
    baseline = np.arange(1.0, 11.0)  # the median 5.5 splits it in two halves
    current = np.array([1, 2, 6, 7, 8, 9, 10, 10, 10, 10], float)  # 2 below, 8 above
    expected = (0.2 - 0.5) * math.log(0.2 / 0.5) + (0.8 - 0.5) * math.log(0.8 / 0.5)
    assert drift.population_stability_index(baseline, current, bins=2) == pytest.approx(expected)
    assert expected == pytest.approx(0.415888, abs=1e-6)
    # An empty bin counts as PSI_FLOOR of the sample, not zero (log stays finite).
    all_above = np.full(10, 9.0)
    floor = drift.PSI_FLOOR
    expected = (floor - 0.5) * math.log(floor / 0.5) + (1 - 0.5) * math.log(1 / 0.5)
    assert drift.population_stability_index(baseline, all_above, 2) == pytest.approx(expected)
    assert drift.population_stability_index(baseline, baseline, 10) == 0.0


def test_novel_counts_values_the_baseline_has_too_few_of_nearby():
    baseline = np.array([1.0, 1.1, 1.2, 5.0, 5.1, 5.2, 9.0])  # 9.0 has no other near it
    current = np.array([1.05, 5.05, 9.0, 7.0, 7.1, 3.0])  # 9.0: one near, 2 needed
    share, p = drift.novel_share(baseline, current, tolerance=0.25)
    assert share == pytest.approx(4 / 6 - 1 / 7)
    assert p == pytest.approx(fisher_exact([[4, 2], [1, 6]], alternative="greater").pvalue)


def test_ks_is_scipy_two_sample_ks():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 1, 500), rng.normal(0.3, 1, 400)
    reference = ks_2samp(a, b)
    assert drift.kolmogorov_smirnov(a, b) == (
        pytest.approx(reference.statistic),
        pytest.approx(reference.pvalue),
    )
    # By hand: [1, 2, 3] vs [2, 3, 4]: the largest gap between the step functions is 1/3.
    assert drift.kolmogorov_smirnov(np.array([1, 2, 3.0]), np.array([2, 3, 4.0]))[0] == (
        pytest.approx(1 / 3)
    )


def test_js_is_the_base_2_jensen_shannon_distance_over_categories():
    # p = (1, 0), q = (1/2, 1/2): m = (3/4, 1/4); KL(p|m) = log2(4/3),
    # KL(q|m) = 1/2 log2(2/3) + 1/2 log2(2); JSD = mean of the two; distance = sqrt(JSD).
    jsd = (math.log2(4 / 3) + 0.5 * math.log2(2 / 3) + 0.5) / 2
    distance, _ = drift.jensen_shannon(["a"] * 4, ["a", "a", "b", "b"])
    assert distance == pytest.approx(math.sqrt(jsd)) == pytest.approx(0.557923, abs=1e-6)
    base = ["none"] * 80 + ["timeout"] * 15 + ["part_lost"] * 5
    cur = ["none"] * 60 + ["timeout"] * 20 + ["part_lost"] * 15 + ["safety_stop:speed"] * 5
    categories, p, q = drift.category_counts(base, cur)
    assert categories == ["none", "part_lost", "safety_stop:speed", "timeout"]
    distance, p_value = drift.jensen_shannon(base, cur)
    assert distance == pytest.approx(jensenshannon(p, q, base=2))
    assert 0 < p_value < 0.01
    assert drift.jensen_shannon(["x"] * 3, ["x"] * 9) == (0.0, 1.0)


def test_trigger_conditions_can_be_turned_off(params, baseline_tables):
    off = dataclasses.replace(params.drift, min_drifted_features=0, min_new_edge_cases=0)
    shifted = synthetic(seed=3, confidence=(0.6, 0.05), edge_cases=60)
    result = drift.detect_drift(baseline_tables, shifted, params.cell, off)
    assert drifted(result) == {PERCEPTION_CONFIDENCE} and result.trigger is False


# --- real data: a sim shift against a line shift, through the dataset versions ------------------


@pytest.fixture(scope="module")
def two_shifts(params, tmp_path_factory):
    """A workspace with two dataset versions: a 30-episode sim shift, then a 30-episode line
    shift, recorded by the reference cell and ingested as a cell's logs would be."""
    from pipelines.ingest import versioning
    from pipelines.ingest.landing import ingest_landing
    from refcell.expert import Expert
    from refcell.shift import record_shift
    from refcell.world import load_world

    root = tmp_path_factory.mktemp("drift-ws")
    workspace = root / "ws"
    workspace.mkdir()
    gitconfig = root / "gitconfig"
    gitconfig.write_text("[user]\n\tname = test\n\temail = test@localhost\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
        env.setenv("GIT_CONFIG_NOSYSTEM", "1")
        versioning.ensure_workspace(workspace, params.ingest.remote)
        dataset = workspace / params.ingest.dataset
        versions, shas = [], []
        for day, world in enumerate(("sim", "line")):
            landing = root / f"landing-{world}"
            record_shift(
                load_world(world),
                params.cell,
                params.record,
                Expert(),
                30,
                landing,
                20 + day,
                interventions=False,
                policy_version="expert",
                shift_start=datetime(2026, 12, 1 + day, 6, tzinfo=UTC),
            )
            report = ingest_landing(
                landing, dataset, root / "quarantine", params.cell, params.ingest, f"run-{world}"
            )
            shas.append(report.ingested[0]["sha256"])
            versions.append(versioning.version_dataset(workspace, dataset, push=False).version)
    return workspace, versions, shas


def test_line_shift_drifts_from_sim_in_perception_confidence(params, two_shifts):
    workspace, versions, _ = two_shifts
    report = drift.drift_report(workspace, params)
    assert report["baseline"] == {
        "source": "first_dataset_version",
        "model_version": None,
        "dataset_version": versions[0],
        "batches": 1,
        "episodes": 30,
    }
    assert report["current"] == {"dataset_version": versions[1], "batches": 1, "episodes": 30}
    confidence = report["features"][PERCEPTION_CONFIDENCE]
    assert confidence["drifted"] and confidence["assessed"]
    assert confidence["current"]["mean"] < confidence["baseline"]["mean"] - 0.1
    psi, ks = confidence["measures"]
    assert psi["name"] == "psi" and psi["statistic"] > params.drift.psi
    assert ks["name"] == "ks" and ks["statistic"] > params.drift.ks_statistic
    assert report["trigger"] is True
    assert any(r.startswith(f"{PERCEPTION_CONFIDENCE} drifted") for r in report["reasons"])
    out = workspace / params.drift.out / versions[1]
    assert report["plots"] == [str(out / f"{f.name}.png") for f in FEATURES]
    assert all(Path(p).is_file() for p in report["plots"])
    assert json.loads((out / drift.REPORT_FILE).read_text()) == report


def test_the_production_models_training_batches_are_the_baseline(params, two_shifts):
    workspace, versions, shas = two_shifts
    trained_on_sim = {"version": "3", "dataset_version": versions[0], "training_batches": shas[:1]}
    report = drift.drift_report(workspace, params, trained_on_sim)
    assert report["baseline"]["source"] == "production"
    assert report["baseline"]["model_version"] == "3"
    assert report["current"]["batches"] == 1 and report["trigger"] is True
    # A model trained on both shifts has seen everything: no new data, nothing to judge.
    trained_on_both = {"version": "4", "dataset_version": versions[1], "training_batches": shas}
    report = drift.drift_report(workspace, params, trained_on_both)
    assert report["current"] == {"dataset_version": versions[1], "batches": 0, "episodes": 0}
    assert report["trigger"] is False and report["drifted_features"] == []
    assert not any(f["assessed"] for f in report["features"].values())


def test_realloop_drift_json_exits_zero_for_the_scheduler(params_path, two_shifts, monkeypatch):
    from typer.testing import CliRunner

    from flows.cli import app

    workspace, versions, _ = two_shifts
    monkeypatch.chdir(workspace)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    done = CliRunner().invoke(app, ["drift", "--params", str(params_path), "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert {"trigger", "reasons", "features", "new_edge_cases", "baseline", "current", "plots"} <= (
        set(report)
    )
    assert report["trigger"] is True and report["current"]["dataset_version"] == versions[1]
    assert not (workspace / "mlflow.db").exists()  # no registry: no store made to ask one


def test_the_human_summary_names_drifted_features_and_the_verdict(params, two_shifts, capsys):
    from flows.drift_cli import _print_drift

    _print_drift(drift.drift_report(two_shifts[0], params))
    text = capsys.readouterr().out
    assert "RETRAIN" in text and PERCEPTION_CONFIDENCE in text and "plots:" in text


def test_the_command_takes_its_baseline_from_the_production_alias(
    params_path, two_shifts, monkeypatch
):
    from typer.testing import CliRunner

    import pipelines.training as tracking
    from flows.cli import app

    workspace, versions, shas = two_shifts
    asked = []

    def production_version(model, alias, *, workspace=None):
        asked.append((model, alias))
        return tracking.ModelVersionInfo(model, "7", "run-7", "src", {}, [alias])

    def model_version_record(model, version, *, workspace=None):
        return {"version": version, "dataset_version": versions[0], "training_batches": shas[:1]}

    monkeypatch.chdir(workspace)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///unused.db")
    monkeypatch.setattr(tracking, "production_version", production_version)
    monkeypatch.setattr(tracking, "model_version_record", model_version_record)
    done = CliRunner().invoke(app, ["drift", "--params", str(params_path), "--json"])
    assert done.exit_code == 0, done.output
    baseline = json.loads(done.stdout)["baseline"]
    assert asked == [("realloop-policy", "cell-07-production")]
    assert baseline["source"] == "production" and baseline["model_version"] == "7"
