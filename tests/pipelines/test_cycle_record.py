"""A cycle's record for DVC and git, on the project's own dvc.yaml in a fresh workspace: the
fine-tuned cells' stages committed so `dvc status` is clean, the metrics readable by DVC, one
git commit tagged cycle-<n>. The loop that writes these for real: tests/flows/test_loop.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipelines.contract.params import load_params
from pipelines.ingest import versioning
from pipelines.release import cycle_record
from tests.conftest import ROOT
from tests.pipelines.test_versioning import git, no_user_git_config  # noqa: F401


def copy_pipeline(root: Path, code: bool = True) -> None:
    """The project's dvc.yaml and the code files its finetune stage depends on; without
    `code`, the stage's code deps are left out of it instead: a `pipelines/` folder in the
    cwd of a `realloop` process would shadow the installed package."""
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    stage = pipeline["stages"]["finetune"]["do"]
    code_deps = [d for d in stage["deps"] if "${" not in d]
    for dep in code_deps if code else ():
        (root / dep).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / dep, root / dep)
    if code:
        shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
        return
    stage["deps"] = [d for d in stage["deps"] if d not in code_deps]
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))


def pipeline_workspace(root: Path, cells: list[str]) -> Path:
    """A git+DVC workspace with the project's pipeline and params for `cells`."""
    root.mkdir()
    versioning.ensure_workspace(root, ".realloop/dvc-remote")
    copy_pipeline(root)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["fleet"]["cells"] = cells
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def run_stage_by_hand(root: Path, params, cell: str, loss: float) -> None:
    """What the loop's fine-tune leaves: pinned inputs, the candidate, metrics and curve."""
    (root / "models" / "cells" / cell / "base").mkdir(parents=True, exist_ok=True)
    (root / "models" / "cells" / cell / "base" / "config.json").write_text("{}\n")
    (root / params.train.out / cell).mkdir(parents=True, exist_ok=True)
    (root / params.train.out / cell / "model.safetensors").write_bytes(b"weights" + cell.encode())
    cycle_record.pin_training_set(root, params, cell, "d" * 32, ["b" * 64, "a" * 64])
    folder = cycle_record.cell_folder(root, params, cell)
    (folder / "train.json").write_text(json.dumps({"final_val_loss": loss}))
    (folder / "learning_curve.csv").write_text(f"epoch,train_loss,val_loss\n0,1.0,{loss}\n")


def cell_line(cell: str, outcome: str, trained: bool = True, gated: bool = True) -> dict:
    arm = {"successes": 5, "n": 6, "success_rate": 5 / 6, "interval": [0.44, 0.97]}
    return {
        "cell": cell,
        "outcome": outcome,
        "training": {"cell_id": cell} if trained else None,
        "gate": {"passed": outcome == "promoted", "reasons": []} if gated else None,
        "trials": {"candidate": arm, "incumbent": arm | {"success_rate": 0.5}} if gated else None,
    }


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    root = pipeline_workspace(tmp_path / "ws", ["cell-07", "cell-08"])
    monkeypatch.chdir(root)  # where `dvc status` runs: DVC reads stage names against the cwd
    return root


def test_a_recorded_cycle_leaves_dvc_status_clean_and_one_tagged_commit(workspace):
    from dvc.repo import Repo

    params = load_params(workspace / "params.yaml")
    for cell, loss in (("cell-07", 0.25), ("cell-08", 0.5)):
        run_stage_by_hand(workspace, params, cell, loss)
    summary = {
        "cycle": 0,
        "cells": [
            cell_line("cell-07", "promoted"),
            cell_line("cell-08", "trials incomplete", gated=False),
            cell_line("cell-12", "skipped", trained=False, gated=False),
        ],
    }
    record = cycle_record.record_cycle(workspace, params, summary)
    assert record["stages"] == ["finetune@cell-07", "finetune@cell-08"]
    with Repo(str(workspace)) as repo:
        assert repo.status(targets=["finetune@cell-07", "finetune@cell-08"]) == {}
        metrics = repo.metrics.show()[""]["data"]
    trials = metrics["cycles/trials.json"]["data"]
    assert set(trials) == {"cell-07"}  # only a gated cell has trial numbers
    assert trials["cell-07"]["promoted"] == 1 and trials["cell-07"]["candidate_episodes"] == 6
    assert metrics["cycles/cell-08/train.json"]["data"] == {"final_val_loss": 0.5}
    assert git(workspace, "rev-parse", "cycle-0^{commit}").strip() == record["commit"]
    committed = set(git(workspace, "show", "--name-only", "--format=", record["commit"]).split())
    assert {"dvc.lock", "dvc.yaml", "params.yaml", "cycles/trials.json"} <= committed
    assert "cycles/cell-07/training-set.json" in committed
    assert not any(path.startswith("models/") for path in committed)
    assert cycle_record.record_cycle(workspace, params, summary)["commit"] is None  # no change


def test_a_cell_outside_fleet_cells_is_reported_and_a_workspace_without_dvc_yaml_untouched(
    workspace, tmp_path
):
    params = load_params(workspace / "params.yaml")
    run_stage_by_hand(workspace, params, "cell-09", 0.3)
    summary = {"cycle": 3, "cells": [cell_line("cell-09", "not promoted")]}
    record = cycle_record.record_cycle(workspace, params, summary)
    assert record["stages"] == [] and record["not_in_dvc_yaml"] == ["finetune@cell-09"]
    assert "cycles/trials.json" in git(workspace, "show", "--name-only", "cycle-3")

    bare = tmp_path / "bare"
    bare.mkdir()
    versioning.ensure_workspace(bare, ".realloop/dvc-remote")
    record = cycle_record.record_cycle(bare, params, summary)
    assert record["commit"] is None and "no dvc.yaml" in record["reason"]
    assert subprocess.run(["git", "-C", str(bare), "rev-parse", "HEAD"], check=False).returncode
    assert json.loads((bare / "cycles" / "trials.json").read_text())["cell-09"]["cycle"] == 3


def test_a_training_set_not_written_by_the_loop_is_one_line_saying_what_to_do(tmp_path):
    bad = tmp_path / "training-set.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match=r"training-set\.json: not a training set .* run a loop"):
        cycle_record.read_training_set(bad)
