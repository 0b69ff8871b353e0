"""A loop cycle that builds all three candidates for a cell against the reference cell, ranks
them offline and trials only the best (flows/candidates.py): the cell uploaded two shifts, the
newer held out of fine-tuning for the pre-screen; it calibrates the sim.

The cycle is slow (a calibration, a small pretrain, two fine-tunes and trials: minutes), so in
`make test-all`; the parts are unit-tested in tests/pipelines/test_prescreen.py, and how the
summary shows them here (quick).
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import TINY_REINFORCE, realloop
from tests.pipelines.test_cycle_record import copy_pipeline

pytestmark = pytest.mark.timeout(1500)

CELL = "cell-07"
ALL = ["incumbent_finetune", "calibrated", "calibrated_finetune"]


def candidate_params(workspace) -> None:
    from tests.flows.test_loop import small_params

    path = small_params(workspace)
    params = yaml.safe_load(path.read_text())
    params["fleet"]["cells"] = [CELL]
    # Twenty episodes a shift: calibrate from them (the figures need 50-300).
    params["calibrate"].update(min_episodes=20, episodes=40)
    params["loop"].update(
        candidates=ALL,
        heldout_shifts=1,
        pretrain_demo_episodes=10,
        pretrain_dagger_rounds=0,
        pretrain_epochs=3,
        # the student paid for success too (seconds)
        pretrain_reinforce=TINY_REINFORCE,
        sim_eval_episodes=5,
        calibrate_episodes=20,  # the newest shift
    )
    path.write_text(yaml.safe_dump(params))


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    from tests.flows.test_loop import StandInCell, record_production_shift

    workspace = tmp_path_factory.mktemp("workspace")
    candidate_params(workspace)
    copy_pipeline(workspace, code=False)
    run = realloop("cell", "pretrain", "--json", cwd=workspace)
    assert run.returncode == 0, run.stderr
    run = realloop(
        "deploy", "--initial", "models/sim-policy", "--cell", CELL, "--json", cwd=workspace
    )
    assert run.returncode == 0, run.stderr
    for index in (0, 1):  # two shifts, an hour apart: the second is the newest
        record_production_shift(workspace, CELL, index)
    stand_in = StandInCell(CELL, workspace, tmp_path_factory.mktemp("cell"))
    stand_in.start()
    try:
        run = realloop("loop", "--json", cwd=workspace)
    finally:
        stand_in.stopping.set()
        stand_in.join(timeout=60)
    assert run.returncode == 0, run.stderr
    assert stand_in.error is None, repr(stand_in.error)
    summary = json.loads(run.stdout)
    [cell] = summary["cells"]
    return workspace, summary, cell, stand_in


@pytest.mark.slow
def test_three_candidates_are_built_ranked_and_only_the_best_is_trialled(cycle):
    _, _, cell, stand_in = cycle
    prescreen = cell["prescreen"]
    built = prescreen["candidates"]
    assert sorted(c["name"] for c in built) == sorted(ALL), built
    assert all("error" not in c for c in built)
    assert [c["rank"] for c in built] == [1, 2, 3]
    assert [c["selected"] for c in built] == [True, False, False]
    assert all(c["score"] is not None and c["sim_success"] is not None for c in built)
    assert all(c["action_mse"] is not None for c in built)  # on the held-out shift
    scores = [c["score"] for c in built]
    assert scores == sorted(scores, reverse=True)
    assert len({c["model_version"] for c in built}) == 3
    best = built[0]
    assert prescreen["trialled"]["name"] == best["name"]
    assert cell["training"]["model_version"] == best["model_version"]
    [request_id] = stand_in.answered  # one trial request: the selected candidate's
    assert cell["trial_request"]["request_id"] == request_id
    assert (
        cell["trials"]["candidate"]["policy"]
        == cell["trial_request"]["arms"]["candidate"]["bundle_id"]
    )


@pytest.mark.slow
def test_the_newest_shift_is_held_out_of_every_fine_tune(cycle):
    from pipelines.release.prescreen import batch_shifts

    workspace, _, cell, _ = cycle
    split = cell["prescreen"]["split"]
    assert len(split["heldout_shifts"]) == 1 and len(split["train_shifts"]) == 1
    assert split["heldout_shifts"][0] > split["train_shifts"][0]  # the newest
    assert prescreen_examples(cell) > 0
    pinned = json.loads((workspace / "cycles" / CELL / "training-set.json").read_text())
    assert len(pinned["batches"]) == split["train_batches"] == 2  # one shift: 20 episodes
    for candidate in cell["prescreen"]["candidates"]:
        if candidate["name"] == "calibrated":
            continue  # trained on no line data
        run = realloop("lineage", str(candidate["model_version"]), "--json", cwd=workspace)
        assert run.returncode == 0, run.stderr
        sources = [s["sha256"] for s in json.loads(run.stdout)["sources"]]
        shifts = batch_shifts(workspace / "data" / "dataset", sources)
        assert set().union(*shifts.values()) == set(split["train_shifts"]), candidate["name"]


def prescreen_examples(cell: dict) -> int:
    return cell["prescreen"]["heldout_examples"]


@pytest.mark.slow
def test_the_calibration_is_cached_by_its_hash_and_named_by_the_candidates(cycle):
    workspace, _, cell, _ = cycle
    calibration = cell["prescreen"]["calibration"]
    assert (
        calibration["path"]
        == f"models/calibrated/{CELL}/{calibration['hash']}/sim-calibration.yaml"
    )
    folder = workspace / "models" / "calibrated" / CELL / calibration["hash"]
    assert (folder / "sim-calibration.yaml").is_file()
    config = json.loads((folder / "policy" / "config.json").read_text())
    # imitation, then paid for success in the same calibrated sim (loop.pretrain_reinforce)
    assert config["trained_on"]["reinforce"]["iterations"] == 2
    assert config["trained_on"]["reinforce"]["episodes"] == 4
    current = json.loads((workspace / "models/calibrated" / CELL / "current.json").read_text())
    assert current == {"hash": calibration["hash"]}
    # The sim follows the line as it is now: calibrated from the newest shift, the held-out one.
    written = yaml.safe_load((folder / "sim-calibration.yaml").read_text())
    assert written["provenance"]["shifts"] == cell["prescreen"]["split"]["heldout_shifts"]
    for candidate in cell["prescreen"]["candidates"]:
        expected = None if candidate["name"] == "incumbent_finetune" else calibration["hash"]
        assert (candidate["calibration"] or {}).get("hash") == expected


@pytest.mark.slow
def test_mlflow_has_a_child_run_per_candidate_with_its_prescreen(cycle):
    from pipelines.training.tracking import mlflow_client

    workspace, summary, cell, _ = cycle
    client = mlflow_client(workspace)
    experiment = client.get_experiment_by_name("realloop-finetune")
    [parent] = client.search_runs(
        [experiment.experiment_id], "tags.`realloop.stage` = 'cycle'", max_results=5
    )
    assert parent.info.run_name == f"cycle {summary['cycle']} {CELL}"
    for candidate in cell["prescreen"]["candidates"]:
        run = client.get_run(candidate["mlflow_run_id"])
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["realloop.candidate"] == candidate["name"]
        assert run.data.tags["dataset_version"] == cell["dataset_version"]
        metrics = run.data.metrics
        assert metrics["prescreen/score"] == pytest.approx(candidate["score"])
        assert metrics["prescreen/rank"] == candidate["rank"]
        assert metrics["prescreen/selected"] == (1.0 if candidate["selected"] else 0.0)
        if candidate["calibration"]:
            assert run.data.tags["calibration.hash"] == candidate["calibration"]["hash"]
            digest = candidate["calibration"]["hash"]  # the path as the workspace names it:
            expected = f"models/calibrated/{CELL}/{digest}/sim-calibration.yaml"
            assert run.data.tags["calibration.path"] == candidate["calibration"]["path"] == expected


@pytest.mark.slow
def test_the_summary_records_the_trialled_score_against_its_trials(cycle):
    workspace, summary, cell, _ = cycle
    assert cell["trials"]["candidate"]["n"] > 0
    correlation = summary["prescreen_correlation"]
    assert (
        correlation["n"] == 1 and correlation["rho"] is None and "need 3" in correlation["reason"]
    )
    trials = json.loads((workspace / "cycles" / "trials.json").read_text())
    assert trials[CELL]["prescreen_score"] == pytest.approx(cell["prescreen"]["trialled"]["score"])


# --- quick: how the summary and the records show the candidates ----------------------------


def cell_with_candidates() -> dict:
    ranked = [
        {"name": "calibrated", "model_version": "5", "rank": 1, "selected": True, "score": 0.91,
         "sim_success": 0.9, "action_agreement": None},
        {"name": "incumbent_finetune", "model_version": "4", "rank": 2, "selected": False,
         "score": None},
    ]  # fmt: skip
    failed = {"name": "calibrated_finetune", "error": "calibration: 12 line episodes"}
    return {
        "cell": CELL,
        "gate": {"passed": True, "reasons": []},
        "outcome": "promoted",
        "trials": {
            arm: {"success_rate": 0.9, "interval": [0.8, 0.95], "n": 60}
            for arm in ("candidate", "incumbent")
        },
        "prescreen": {"candidates": [*ranked, failed], "trialled": ranked[0]},
    }


def test_the_human_summary_lists_each_candidate_and_the_one_trialled():
    from flows.cycle import candidate_notes, prescreen_lines

    notes = candidate_notes(cell_with_candidates())
    assert notes == [
        f"{CELL} candidate calibrated (version 5): rank 1, score 0.910, sim 0.900; trialled",
        f"{CELL} candidate incumbent_finetune (version 4): rank 2, unscored",
        f"{CELL} candidate calibrated_finetune: not built (calibration: 12 line episodes)",
    ]
    found = {"rho": 0.5, "p_value": 0.2, "n": 8, "reason": None}
    assert prescreen_lines(found) == [
        "pre-screen vs trials: Spearman rho 0.50 (p 0.2) over 8 trialled candidates"
    ]
    assert "need 3" in prescreen_lines({"rho": None, "reason": "1 ...: need 3", "n": 1})[0]


def test_trials_json_keeps_the_trialled_score_and_dvc_commits_only_a_run_finetune_stage():
    from pipelines.release.cycle_record import _stage_ran, trial_metrics

    cell = cell_with_candidates()
    assert trial_metrics(cell, 3)["prescreen_score"] == 0.91
    assert _stage_ran(cell)  # incumbent_finetune was built
    cell["prescreen"]["candidates"] = cell["prescreen"]["candidates"][:1]
    assert not _stage_ran(cell)  # calibrated alone: finetune@<cell> did not run
    assert _stage_ran({"training": {"model_version": "1"}})  # a summary from before


def test_a_pretrain_runs_in_a_process_of_its_own_and_its_errors_come_back():
    import os

    from flows.candidates import in_child_process

    assert in_child_process(os.getpid) != os.getpid()
    with pytest.raises(ValueError, match="invalid literal"):
        in_child_process(int, "not a number")


@pytest.mark.parametrize(
    ("threads", "cells", "cores", "expected"),
    [(None, 1, 2, 2), (None, 3, 2, 1), (None, 2, 8, 4), (3, 3, 2, 3)],
)
def test_pretrains_side_by_side_share_the_cores(monkeypatch, threads, cells, cores, expected):
    from dataclasses import replace

    from flows import candidates
    from pipelines.contract.params import load_params
    from tests.conftest import ROOT

    params = load_params(ROOT / "params.yaml")
    params = replace(params, train=replace(params.train, threads=threads))
    monkeypatch.setattr(candidates.os, "cpu_count", lambda: cores)
    assert candidates._pretrain_threads(params, cells) == expected
