"""Where a cell stands before its cycle, and what its line of the cycle summary says."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows import cycle
from pipelines.training import tracking
from pipelines.training.policy import PolicyConfig, PolicyNet, load_policy, save_policy
from pipelines.training.registry import register_policy, set_production_alias
from pipelines.training.tracking import mlflow_client
from tests.edge.signed import publish_override


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    tracking.use_workspace(tmp_path)
    return tmp_path


def production_model(workspace, params, cell_id: str) -> str:
    """A registered policy under the cell's production alias, as a first deployment leaves
    it; returns its version."""
    folder = save_policy(PolicyNet(PolicyConfig(hidden=[8], version="sim-0")), workspace / "p")
    client = mlflow_client(workspace)
    run = client.create_run(client.create_experiment("deploy"))
    version = register_policy(run.info.run_id, folder, params.train.registered_model)
    set_production_alias(params.train.registered_model, f"{cell_id}-production", version)
    return version


def test_a_cycle_serves_the_fleet_or_the_one_cell_asked_for(params):
    assert cycle.fleet_cells(params) == ["cell-07", "cell-08"]  # params.yaml: the demo's fleet
    assert cycle.fleet_cells(params, "cell-12") == ["cell-12"]
    with pytest.raises(ValueError, match="not a safe name"):
        cycle.fleet_cells(params, "../cell")


def test_a_cell_without_a_production_model_is_skipped_with_the_way_out(workspace, params):
    plan = cycle.plan_cell(params, workspace, "cell-08", [])
    assert plan == {"cell": "cell-08", "skip": cycle.NO_PRODUCTION}
    assert "realloop deploy --initial" in cycle.NO_PRODUCTION


def test_a_cell_whose_channel_names_nothing_is_skipped(workspace, params):
    production_model(workspace, params, "cell-08")
    plan = cycle.plan_cell(params, workspace, "cell-08", [])
    assert "cell-08/release.json" in plan["skip"] and "deploy --initial" in plan["skip"]


def batches_of(workspace, params, cells: dict[str, str]) -> list[str]:
    """Batches (episodes files) holding one cell's episodes each: batch name → cell id."""
    folder = workspace / params.ingest.dataset / "episodes"
    folder.mkdir(parents=True, exist_ok=True)
    for batch, cell_id in cells.items():
        pq.write_table(pa.table({"cell_id": [cell_id, cell_id]}), folder / f"{batch}.parquet")
    return list(cells)


def test_a_cell_with_nothing_of_its_own_to_train_on_is_skipped(workspace, params):
    production_model(workspace, params, "cell-08")
    files = {n: workspace / "p" / n for n in ("model.safetensors", "config.json")}
    publish_override(
        workspace / params.promote.channel,
        "cell-08",
        files,
        {"model_name": "m", "model_version": 1},
        workspace / params.promote.keys,
    )
    batches = batches_of(workspace, params, {"b7": "cell-07"})
    plan = cycle.plan_cell(params, workspace, "cell-08", batches)
    assert plan["skip"] == "no validated logs from cell-08 yet: nothing to train on"


def test_a_ready_cell_has_its_base_pinned_and_its_incumbent_bundle(workspace, params):
    version = production_model(workspace, params, "cell-08")
    files = {n: workspace / "p" / n for n in ("model.safetensors", "config.json")}
    channel = workspace / params.promote.channel
    meta = {"model_name": "m", "model_version": 1}
    manifest = publish_override(channel, "cell-08", files, meta, workspace / params.promote.keys)
    batches = batches_of(workspace, params, {"b7": "cell-07", "b8": "cell-08", "c8": "cell-08"})
    plan = cycle.plan_cell(params, workspace, "cell-08", batches)
    assert plan["skip"] is None and plan["model_version"] == version
    assert plan["batches"] == ["b8", "c8"]
    assert plan["base"] == str(workspace / "models" / "cells" / "cell-08" / "base")
    assert load_policy(plan["base"]).name == plan["policy_version"] == "sim-0"
    assert plan["incumbent"]["bundle_id"] == manifest["bundle_id"] == plan["bundle_id"]
    assert cycle.plan_cell(params, workspace, "cell-07", [])["skip"] == cycle.NO_PRODUCTION


def stats(successes: int) -> dict:
    return {"n": 10, "successes": successes, "success_rate": successes / 10, "interval": [0, 1]}


@pytest.mark.parametrize(
    ("steps", "error", "outcome", "reason"),
    [
        ({"plan": {"skip": cycle.NO_PRODUCTION}}, None, cycle.SKIPPED, cycle.NO_PRODUCTION),
        ({"plan": {"skip": None}}, "fine-tune: no batches", cycle.FAILED, "fine-tune: no batches"),
        (
            {"plan": {"skip": None}, "waited": {"state": "timed out", "reason": "late"}},
            None,
            cycle.INCOMPLETE,
            "late",
        ),
        (
            {
                "plan": {"skip": None},
                "waited": {"state": "complete", "reason": None},
                "gate": {"passed": False, "reasons": ["pass: a", "FAIL: b"]}
                | {
                    "candidate": stats(5),
                    "incumbent": stats(6),
                },
                "promotion": {"promoted": False, "reasons": ["not promoted"]},
            },
            None,
            cycle.NOT_PROMOTED,
            "FAIL: b",
        ),
    ],
)
def test_each_way_a_cells_cycle_ends_is_named_with_its_reason(steps, error, outcome, reason):
    steps["trained"] = {"model_version": "4"}
    result = cycle.cell_result("cell-07", "abc.dir", steps, error)
    assert (result["outcome"], result["reason"]) == (outcome, reason)
    assert result["promoted_version"] is None and result["dataset_version"] == "abc.dir"


def test_a_promotion_names_the_promoted_version():
    steps = {
        "plan": {"skip": None, "model_version": "3"},
        "trained": {"model_version": "4"},
        "waited": {"state": "complete", "reason": None, "attempt": None, "waited_s": 12.0},
        "gate": {
            "passed": True,
            "reasons": ["pass: a"],
            "candidate": stats(9),
            "incumbent": stats(5),
        },
        "promotion": {"promoted": True, "reasons": ["pass: a", "promoted: version 4"]},
    }
    result = cycle.cell_result("cell-07", "abc.dir", steps)
    assert result["outcome"] == cycle.PROMOTED and result["promoted_version"] == "4"
    assert result["trials"]["candidate"]["successes"] == 9
    assert result["incumbent"]["model_version"] == "3" and result["waited_s"] == 12.0
