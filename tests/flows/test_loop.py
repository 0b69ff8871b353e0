"""The whole loop, end to end, on a small configuration against the real components:
Prefect's local API, MLflow's SQLite store, DVC, Great Expectations and a local edge channel.

The incumbent is a barely trained policy and the cell's safety limits are widened, so the
candidate passes the gate and the promotion path runs; the gate's failing path is covered in
tests/pipelines. Bad files in the landing folder must end in quarantine without stopping it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, realloop

pytestmark = pytest.mark.timeout(900)


def small_params(workspace: Path) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["pretrain"].update(demo_episodes=2, dagger_rounds=0, epochs=1)
    # A lenient cell: no safety stops, and a part within 8 cm of the target counts as placed,
    # so a candidate fine-tuned on 20 episodes succeeds where the untrained incumbent cannot.
    params["cell"]["safety"] = {"joint_limit_m": 0.5, "speed_mps": 5.0, "contact_force_n": 1e4}
    params["cell"].update(success_tolerance_m=0.08, settle_speed_mps=0.1)
    params["collect"]["episodes"] = 20
    params["record"]["episodes_per_file"] = 10
    params["trials"]["episodes"] = 8
    params["train"].update(epochs=60, learning_rate=0.003)
    params["gate"]["cycle_time_budget_s"] = 6.0
    path = workspace / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def bad_landing_files(landing: Path, good_log: Path) -> dict[str, str]:
    landing.mkdir(parents=True, exist_ok=True)
    (landing / "cell-07_empty.mcap").write_bytes(b"")
    (landing / "cell-07_notes.mcap").write_text("operator notes, saved with the wrong name\n")
    data = good_log.read_bytes()
    (landing / "cell-07_cut.mcap").write_bytes(data[: len(data) // 2])
    return {
        "cell-07_empty.mcap": "empty",
        "cell-07_notes.mcap": "not an MCAP",
        "cell-07_cut.mcap": "truncated",
    }


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    """Two cycles in one workspace: the first promotes, the second starts from production."""
    workspace = tmp_path_factory.mktemp("workspace")
    small_params(workspace)
    # A log from another shift, to cut into a truncated file.
    seed_log = tmp_path_factory.mktemp("seed")
    run = realloop(
        "cell",
        "record",
        "--policy",
        "expert",
        "--episodes",
        "2",
        "--out",
        str(seed_log),
        "--params",
        "params.yaml",
        "--json",
        cwd=workspace,
    )
    assert run.returncode == 0, run.stderr
    expected = bad_landing_files(workspace / "data" / "landing", next(seed_log.glob("*.mcap")))
    first = realloop("loop", "--json", cwd=workspace)
    assert first.returncode == 0, first.stderr
    second = realloop("loop", "--json", cwd=workspace)
    assert second.returncode == 0, second.stderr
    return workspace, json.loads(first.stdout), json.loads(second.stdout), expected, first.stderr


def test_summary_reports_every_stage(cycle):
    workspace, summary, _, _, stderr = cycle
    assert {"dataset_version", "gate", "channel", "cell"} <= summary.keys()
    assert summary["cell"] == "cell-07" and summary["channel"] == "data/edge-channel"
    ledger = (workspace / ".realloop" / "datasets.jsonl").read_text()
    assert summary["dataset_version"] in ledger and summary["dataset_version_with_trials"] in ledger
    assert summary["collected"]["episodes"] == 20
    # 20 collected + 2 × 8 trial episodes, all ingested; nothing else.
    assert summary["ingest"]["episodes_ingested"] == 20 + 16
    assert summary["validation"]["batches"] == summary["validation"]["passed"] == 2
    trials = summary["trials"]
    assert trials["candidate"]["n"] == trials["incumbent"]["n"] == 8
    assert trials["candidate"]["policy"] == summary["training"]["policy_version"]
    assert "Traceback" not in stderr and "database is locked" not in stderr


def test_bad_files_are_quarantined_with_reasons(cycle):
    workspace, summary, _, expected, _ = cycle
    quarantined = {Path(q["source"]).name: q["reason"] for q in summary["ingest"]["quarantined"]}
    assert set(quarantined) == set(expected)
    for name, words in expected.items():
        assert words in quarantined[name]
        assert (workspace / "data" / "quarantine" / name).is_file()
        assert (workspace / "data" / "quarantine" / f"{name}.reason.txt").is_file()


def test_gate_pass_promotes_to_the_channel_and_the_edge_box_runs_it(cycle, tmp_path):
    workspace, summary, second, _, _ = cycle
    assert summary["gate"]["passed"], summary["gate"]["reasons"]
    version = summary["training"]["model_version"]
    assert summary["promotion"]["promoted"] and summary["edge"]["model_version"] == int(version)
    # the channel now names whatever the last cycle left there: its candidate if it passed
    latest = second["training"]["model_version"] if second["gate"]["passed"] else version
    assert second["edge"]["model_version"] == int(latest)
    version = latest
    box = tmp_path / "edge-box"
    pull = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge.cli",
            "pull",
            "--channel",
            str(workspace / "data" / "edge-channel"),
            "--cell",
            "cell-07",
            "--dest",
            str(box),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pull.returncode == 0, pull.stderr
    status = subprocess.run(
        [sys.executable, "-m", "edge.cli", "status", "--dest", str(box), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    running = json.loads(status.stdout)
    assert str(running["model_version"]) == version and len(running["sha256"]) == 64
    evaluated = realloop(
        "cell",
        "eval",
        "--policy",
        running["path"],
        "--world",
        "line",
        "--episodes",
        "2",
        "--json",
        cwd=workspace,
    )
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["episodes"] == 2


def test_next_cycle_starts_from_the_production_policy(cycle):
    workspace, first, second, _, _ = cycle
    dvc_file = yaml.safe_load((workspace / "data" / "dataset.dvc").read_text())
    assert second["dataset_version_with_trials"] == dvc_file["outs"][0]["md5"][:32]
    assert second["cycle"] == 1
    assert second["incumbent"]["source"] == "registry"
    assert second["incumbent"]["model_version"] == first["training"]["model_version"]
    assert second["dataset_version"] != first["dataset_version"]


def test_lineage_from_a_model_version(cycle):
    workspace, summary, _, _, _ = cycle
    run = realloop("lineage", summary["training"]["model_version"], "--json", cwd=workspace)
    assert run.returncode == 0, run.stderr
    lineage = json.loads(run.stdout)
    assert lineage["dataset_version"] == summary["dataset_version"]
    assert lineage["mlflow_run_id"] == summary["training"]["mlflow_run_id"]
    assert lineage["params"]["train.epochs"] == "60"
    sources = {Path(s["uri"]).name: s["sha256"] for s in lineage["sources"]}
    assert len(sources) == 2  # the two logs of the collected shift
    for name, sha in sources.items():
        assert _sha256(workspace / "data" / "landing" / name) == sha
    # 8 trial episodes fit one log (10 per file) for each policy
    assert {role: len(t["sources"]) for role, t in lineage["trials"].items()} == {
        "candidate": 1,
        "incumbent": 1,
    }


def test_lineage_from_a_file(cycle):
    workspace, first, second, _, _ = cycle
    log = sorted((workspace / "data" / "landing").glob("*.mcap"))[0]
    run = realloop("lineage", str(log), "--json", cwd=workspace)
    assert run.returncode == 0, run.stderr
    lineage = json.loads(run.stdout)
    assert lineage["sha256"] == _sha256(log)
    # in every version made since it landed, and in the models of both cycles
    assert first["dataset_version"] in lineage["dataset_versions"]
    assert second["dataset_version"] in lineage["dataset_versions"]
    trained = {m["version"] for m in lineage["models"] if m["trained_on_file"]}
    assert {first["training"]["model_version"], second["training"]["model_version"]} <= trained


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
