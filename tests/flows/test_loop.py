"""One cycle of `realloop loop` over three cells that it meets only through storage.

Each cell has its first model deployed (`realloop deploy --initial`) and a production shift in
the landing folder. Two stand-in cells run in threads of this test: they watch the folder
channel for trial requests, verify both arms' bundles and answer with trial logs recorded by
the reference cell's recorder, the request's keys added to the logs' metadata. cell-08 first
uploads part of an attempt (as a cell that crashed mid-upload might), then a whole one. The
third cell never answers. The loop runs as users run it, in a subprocess.

The incumbent is a barely trained policy and the cells are lenient (no safety stops, 8 cm
counts as placed), so each answered candidate passes the gate and the promotion path runs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from edge import agent
from edge.channels import open_channel
from edge.trials import fetch_arm, open_requests, read_history
from pipelines.contract.params import load_params
from pipelines.ingest import sha256_file
from tests.conftest import ROOT, realloop, without_prefect_settings
from tests.edge.signed import enrolled
from tests.pipelines.test_cycle_record import copy_pipeline
from tests.pipelines.test_ingest_helpers import raw_copy

pytestmark = pytest.mark.timeout(900)

ANSWERING, SILENT = ("cell-07", "cell-08"), "cell-09"
EPISODES_PER_ARM = 6
TIMEOUT_S, POLL_S = 100, 3


def small_params(workspace: Path) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["pretrain"].update(demo_episodes=2, dagger_rounds=0, epochs=1)
    # A lenient cell: no safety stops, and a part within 8 cm of the target counts as placed,
    # so a candidate fine-tuned on 20 episodes succeeds where the untrained incumbent cannot.
    params["cell"]["safety"] = {"joint_limit_m": 0.5, "speed_mps": 5.0, "contact_force_n": 1e4}
    params["cell"].update(success_tolerance_m=0.08, settle_speed_mps=0.1)
    params["record"]["episodes_per_file"] = 10
    params["fleet"]["cells"] = [*ANSWERING, SILENT]
    params["trials"].update(max_episodes=EPISODES_PER_ARM, timeout_s=TIMEOUT_S, poll_s=POLL_S)
    params["train"].update(epochs=60, learning_rate=0.003)
    # One look, at the cap: each attempt is judged whole (tests/pipelines test the early
    # stops). Six episodes per arm cannot show "no worse by 2 points"; a lenient margin, as
    # the cell is lenient, lets the promotion path run (2/6 against 0/6 passes).
    params["gate"].update(cycle_time_budget_s=6.0, looks=1, margin=0.3)
    path = workspace / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


class StandInCell(threading.Thread):
    """A cell on the other side of the channel: answers each trial request once, with the
    arms' logs uploaded whole (copied to a dot-file, then renamed, as the contract says)."""

    def __init__(self, cell_id: str, workspace: Path, work: Path, cut_first: bool = False):
        super().__init__(name=f"stand-in {cell_id}", daemon=True)
        self.cell_id, self.workspace, self.work, self.cut_first = (
            cell_id,
            workspace,
            work,
            cut_first,
        )
        params = load_params(workspace / "params.yaml")
        self.params = params
        self.channel = open_channel(workspace / params.promote.channel)
        self.landing = workspace / params.ingest.landing
        self.answered: dict[str, dict] = {}  # request id → attempt → arm → (episode ids, logs)
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                for request in open_requests(self.channel, self.cell_id):
                    if request["request_id"] not in self.answered:
                        self.answer(request)
                self.stopping.wait(0.5)
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.error = exc

    def answer(self, request: dict) -> None:
        from pipelines.training import load_policy

        box = self.work / "box" / request["request_id"]
        arms = {
            arm: (load_policy(fetch_arm(self.channel, self.cell_id, spec, box)), spec["bundle_id"])
            for arm, spec in request["arms"].items()
        }
        n = request["episodes_per_arm"]
        attempts = {}
        if self.cut_first:
            attempts["attempt-1"] = self.upload(request, "attempt-1", arms, n - 2, 0)
        attempts["attempt-2"] = self.upload(request, "attempt-2", arms, n, 60)
        self.answered[request["request_id"]] = attempts

    def upload(self, request: dict, attempt: str, arms: dict, episodes: int, minute: int):
        from refcell.shift import record_shift
        from refcell.world import load_world

        cell = dataclasses.replace(self.params.cell, cell_id=self.cell_id)
        start = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=minute)
        recorded = {}
        for k, (arm, (policy, bundle_id)) in enumerate(sorted(arms.items())):
            staging = self.work / "staging" / f"{attempt}-{arm}"
            shift = record_shift(
                load_world("line"),
                cell,
                self.params.record,
                policy,
                episodes,
                staging,
                seed=7000 + minute + k,
                interventions=False,
                policy_version=bundle_id,
                shift_start=start + timedelta(seconds=k),
            )
            keys = {"trial_request_id": request["request_id"], "trial_arm": arm}
            logs = [self.land(Path(f), keys | {"trial_attempt": attempt}) for f in shift["files"]]
            truth = Path(shift["ground_truth"]).read_text().splitlines()
            recorded[arm] = ([json.loads(line)["episode_id"] for line in truth], logs)
        return recorded

    def land(self, log: Path, metadata: dict) -> str:
        hidden = self.landing / f".{log.name}.upload"
        raw_copy(log, hidden, cell_metadata=metadata)
        hidden.rename(self.landing / log.name)
        return sha256_file(self.landing / log.name)


def record_production_shift(workspace: Path, cell_id: str, index: int) -> None:
    """What each cell uploaded before the cycle: a shift with the operator on."""
    from pipelines.training import load_policy
    from refcell.shift import record_shift
    from refcell.world import load_world

    params = load_params(workspace / "params.yaml")
    record_shift(
        load_world("line"),
        dataclasses.replace(params.cell, cell_id=cell_id),
        params.record,
        load_policy(workspace / params.pretrain.out),
        20,
        workspace / params.ingest.landing,
        seed=100 + index,
        interventions=True,
        policy_version="sim",
        shift_start=datetime(2026, 12, 1, 6, tzinfo=UTC) + timedelta(hours=index),
    )


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    workspace = tmp_path_factory.mktemp("workspace")
    small_params(workspace)
    copy_pipeline(workspace, code=False)  # dvc.yaml: the loop records finetune@<cell> stages
    run = realloop("cell", "pretrain", "--json", cwd=workspace)
    assert run.returncode == 0, run.stderr
    deployed = {}
    for index, cell_id in enumerate((*ANSWERING, SILENT)):
        run = realloop(
            "deploy", "--initial", "models/sim-policy", "--cell", cell_id, "--json", cwd=workspace
        )
        assert run.returncode == 0, run.stderr
        deployed[cell_id] = json.loads(run.stdout)
        record_production_shift(workspace, cell_id, index)
    landing = workspace / "data" / "landing"
    (landing / "cell-07_empty.mcap").write_bytes(b"")  # a bad upload: quarantined, no stop
    work = tmp_path_factory.mktemp("cells")
    cells = [StandInCell(c, workspace, work / c, cut_first=c == "cell-08") for c in ANSWERING]
    for cell in cells:
        cell.start()
    started = time.monotonic()
    try:
        run = realloop("loop", "--json", cwd=workspace)
    finally:
        for cell in cells:
            cell.stopping.set()
            cell.join(timeout=60)
    took = time.monotonic() - started
    assert run.returncode == 0, run.stderr
    for cell in cells:
        assert cell.error is None, repr(cell.error)
    summary = json.loads(run.stdout)
    by_cell = {c["cell"]: c for c in summary["cells"]}
    answered = {c.cell_id: c.answered for c in cells}
    return workspace, summary, by_cell, answered, deployed, run.stderr, took


def test_each_answering_cell_gets_one_promotion_on_its_own_track(cycle, tmp_path):
    workspace, summary, by_cell, _, deployed, stderr, _ = cycle
    assert [c["cell"] for c in summary["cells"]] == [*ANSWERING, SILENT]
    channel = workspace / "data" / "edge-channel"
    for cell_id in ANSWERING:
        cell = by_cell[cell_id]
        assert cell["outcome"] == "promoted", (cell["reason"], cell["gate"])
        version = cell["promoted_version"]
        assert cell["training"]["cell_id"] == cell_id
        assert cell["incumbent"]["model_version"] == deployed[cell_id]["model_version"]
        assert cell["edge"]["model_version"] == int(version)
        assert cell["promotion"]["alias"] == f"{cell_id}-production"
        box = tmp_path / cell_id
        enrolled(str(channel), workspace / ".realloop" / "keys", cell_id, box)
        pulled = agent.pull(box)
        assert pulled["action"] == "activated" and pulled["model_version"] == int(version)
    versions = {by_cell[c]["promoted_version"] for c in ANSWERING}
    assert len(versions) == len(ANSWERING)  # a candidate per cell
    assert "Traceback" not in stderr and "database is locked" not in stderr


def test_each_cell_trains_on_its_own_logs_only(cycle):
    workspace, _, by_cell, _, _, _, _ = cycle
    for cell_id in ANSWERING:
        run = realloop("lineage", by_cell[cell_id]["promoted_version"], "--json", cwd=workspace)
        assert run.returncode == 0, run.stderr
        lineage = json.loads(run.stdout)
        assert {s["cell_id"] for s in lineage["sources"]} == {cell_id}
        assert len(lineage["sources"]) == 2  # its production shift: 20 episodes, 10 per log


def test_the_gate_judged_exactly_the_requests_complete_attempt(cycle):
    workspace, _, by_cell, answered, _, _, _ = cycle
    for cell_id in ANSWERING:
        cell = by_cell[cell_id]
        [(request_id, attempts)] = answered[cell_id].items()
        assert cell["trial_request"]["request_id"] == request_id
        assert cell["attempt"]["attempt"] == "attempt-2"  # never the cut one (cell-08)
        for arm in ("candidate", "incumbent"):
            episodes, logs = attempts["attempt-2"][arm]
            assert cell["attempt"]["episodes"][arm] == episodes
            assert len(episodes) == EPISODES_PER_ARM == cell["trials"][arm]["n"]
            assert cell["attempt"]["sources"][arm] == logs
            bundle = cell["trial_request"]["arms"][arm]["bundle_id"]
            assert cell["trials"][arm]["policy"] == bundle  # the arm ran the bundle asked for
        run = realloop("lineage", cell["promoted_version"], "--json", cwd=workspace)
        trials = json.loads(run.stdout)["trials"]
        for arm in ("candidate", "incumbent"):
            assert [s["sha256"] for s in trials[arm]["sources"]] == attempts["attempt-2"][arm][1]


def test_a_cells_trials_are_requested_before_the_next_cell_is_built(cycle):
    """The cell trials its candidate on its robot while the loop builds the next cell's."""
    from pipelines.training.tracking import mlflow_client

    workspace, _, by_cell, _, _, _, _ = cycle
    client = mlflow_client(workspace)
    requested = datetime.fromisoformat(by_cell["cell-07"]["trial_request"]["created_at"])
    next_build = client.get_run(by_cell["cell-08"]["training"]["mlflow_run_id"]).info.start_time
    assert requested < datetime.fromtimestamp(next_build / 1000, UTC)


def test_a_cell_that_never_answers_ends_trials_incomplete_with_its_request_withdrawn(cycle):
    workspace, _, by_cell, _, deployed, _, took = cycle
    cell = by_cell[SILENT]
    assert cell["outcome"] == "trials incomplete" and "withdrawn" in cell["reason"]
    assert cell["gate"] is None and cell["promotion"] is None and cell["promoted_version"] is None
    assert TIMEOUT_S <= cell["waited_s"] <= TIMEOUT_S + POLL_S + 60
    assert took < TIMEOUT_S + 600
    channel = open_channel(workspace / "data" / "edge-channel")
    assert open_requests(channel, SILENT) == []
    request_id = cell["trial_request"]["request_id"]
    events = [e["action"] for e in read_history(channel, SILENT) if e["subject"] == request_id]
    assert events == ["trial_requested", "trial_withdrawn"]
    # the cell keeps running what it ran
    assert cell["edge"]["bundle_id"] == deployed[SILENT]["bundle_id"]


def test_the_summary_covers_the_data_and_the_ledger_keeps_it(cycle):
    workspace, summary, _, _, _, _, _ = cycle
    ledger = (workspace / ".realloop" / "datasets.jsonl").read_text()
    assert (
        summary["dataset_version"] in ledger and summary["dataset_version_after_trials"] in ledger
    )
    quarantined = {Path(q["source"]).name for q in summary["ingest"]["quarantined"]}
    assert quarantined == {"cell-07_empty.mcap"}
    # 3 × 20 production episodes, then each answering cell's trial logs, all ingested
    trial_episodes = 2 * EPISODES_PER_ARM * 2 + 2 * (EPISODES_PER_ARM - 2)
    assert summary["ingest"]["episodes_ingested"] == 60 + trial_episodes
    # The silent cell's request goes out while the candidates stage still runs (the next
    # cell's build), and its deadline counts from then: the wait for it spans the rest of
    # that stage and the "await trials" one, not the latter alone.
    timings = summary["timings_s"]
    assert summary["ingest"]["runs"] >= 2
    assert timings["candidates"] + timings["await trials"] >= TIMEOUT_S
    lines = (workspace / ".realloop" / "cycles.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["cycle"] == 0


def test_the_human_summary_has_a_row_per_cell(cycle):
    from rich.console import Console

    from flows.cycle import print_cycle

    console = Console(width=160, record=True)
    print_cycle(cycle[1], console.print)
    text = console.export_text()
    for cell_id in (*ANSWERING, SILENT):
        assert cell_id in text
    assert "promoted version" in text and "trials incomplete" in text


def test_the_cycle_leaves_artifacts_and_says_what_each_stage_did(cycle):
    from flows.cycle import cell_rows

    workspace, summary, by_cell = cycle[:3]
    env = without_prefect_settings()
    run = subprocess.run(
        [sys.executable, "-m", "tests.flows.prefect_record", str(workspace)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(run.stdout)
    assert {"retrain-loop", "await-trials", "ingest"} <= set(record["runs"].values())
    by_key: dict[str, list[dict]] = {}
    for artifact in record["artifacts"]:
        by_key.setdefault(artifact["key"], []).append(artifact)

    [table] = [a["data"] for a in by_key["cycle-summary"] if "### cycle 0:" in a["data"]]
    for row in cell_rows(summary):  # the terminal's rows, each cell with its verdict
        assert "| " + " | ".join(row.values()) + " | " in table
    for cell_id in ANSWERING:
        run_id = by_cell[cell_id]["training"]["mlflow_run_id"]
        assert f"PASSED | promoted version {by_cell[cell_id]['promoted_version']} |" in table
        assert f"MLflow run {run_id} in sqlite:///" in table
        [gate] = by_key[f"{cell_id}-gate"]
        successes = by_cell[cell_id]["trials"]["candidate"]["successes"]
        assert "gate PASSED" in gate["data"] and f"{successes}/{EPISODES_PER_ARM} " in gate["data"]
        assert run_id in by_key[f"{cell_id}-mlflow-run"][0]["data"]
    assert f"{SILENT}-gate" not in by_key and "Data Docs" in table
    [cells] = [c for c in (json.loads(a["data"]) for a in by_key["cycle-cells"]) if len(c) == 3]
    assert [(c["cell"], c["outcome"]) for c in cells] == [
        (c, by_cell[c]["outcome"]) for c in (*ANSWERING, SILENT)
    ]
    waited = {r["cell"]: r["state"] for r in json.loads(by_key["trials-wait"][0]["data"])}
    assert waited == {"cell-07": "complete", "cell-08": "complete", SILENT: "timed out"}
    docs = [a["data"] for a in by_key["data-docs"]]  # a link artifact is markdown
    assert docs and all("(file://" in d and d.endswith("index.html)") for d in docs)
    assert len(by_key["ingest-report"]) >= 2  # the first ingest and the polls'

    logs = "\n".join(record["logs"])
    for sentence in (
        "ingested ",
        "validated ",
        "cell-07: production model version ",
        "cell-07: fine-tuned on ",
        "cell-08: trials complete (attempt-2)",
        "cell-07: gate PASS: candidate ",
        f"cell-08: promoted version {by_cell['cell-08']['promoted_version']} as bundle ",
        f"{SILENT}: trials incomplete: ",
        f"{SILENT}: trial request {by_cell[SILENT]['trial_request']['request_id']} withdrawn",
        "cycle 0: 3 cell(s): promoted: cell-07, cell-08; trials incomplete: cell-09",
    ):
        assert sentence in logs, sentence


def test_dvc_sees_the_cycle_its_stages_up_to_date_its_metrics_and_learning_curves(cycle):
    workspace, summary = cycle[0], cycle[1]
    cells = (*ANSWERING, SILENT)  # the silent cell was fine-tuned too
    stages = [f"finetune@{c}" for c in cells]
    assert summary["dvc"]["stages"] == stages

    def dvc(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "dvc", *args], cwd=workspace, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert json.loads(dvc("status", "--json", *stages)) == {}
    metrics = json.loads(dvc("metrics", "show", "--json"))[""]["data"]
    trials = metrics["cycles/trials.json"]["data"]
    assert sorted(trials) == list(ANSWERING)  # gated cells only
    for cell in ANSWERING:
        assert trials[cell]["candidate_episodes"] == EPISODES_PER_ARM and trials[cell]["promoted"]
    for cell in cells:
        trained = summary_cell(summary, cell)["training"]
        written = metrics[f"cycles/{cell}/train.json"]["data"]
        assert written["final_val_loss"] == trained["final_val_loss"]
        curve = (workspace / "cycles" / cell / "learning_curve.csv").read_text().splitlines()
        assert curve[0] == "epoch,train_loss,val_loss" and len(curve) == 1 + 60  # train.epochs
    [head] = [row for row in json.loads(dvc("exp", "show", "--json")) if row["rev"] != "workspace"]
    assert head["rev"] == summary["dvc"]["commit"]
    shown = head["data"]["metrics"]["cycles/trials.json"]["data"]
    assert shown["cell-07"]["candidate_success_rate"] == trials["cell-07"]["candidate_success_rate"]
    plots = json.loads(dvc("plots", "show", "--json", "--split"))["data"]
    assert {f"cycles/{c}/learning_curve.csv" for c in cells} <= set(plots)


def summary_cell(summary: dict, cell_id: str) -> dict:
    return next(c for c in summary["cells"] if c["cell"] == cell_id)


@pytest.mark.slow  # a second loop run (~20 s); the fleet cycle's skip is in test_cycle.py
def test_a_cell_asked_for_without_a_production_model_is_skipped_with_the_way_out(cycle):
    run = realloop("loop", "--cell", "cell-12", "--json", cwd=cycle[0])
    assert run.returncode == 0, run.stderr
    [cell] = json.loads(run.stdout)["cells"]
    assert (cell["cell"], cell["outcome"]) == ("cell-12", "skipped")
    assert "realloop deploy --initial" in cell["reason"]
