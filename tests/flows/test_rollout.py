"""Staged rollout (flows/rollout.py) in a real Prefect flow run: the canary's health window
is judged from episodes that land while it waits (the poll writes them to the episodes table,
as ingest would); the followers get the canary's version only after a passing window, and a
failed window rolls the canary back. Promote and rollback are stand-in tasks here that record
what they were asked (the real ones publish signed releases: tests/edge, the slow loop test)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.flow_runs import resume_flow_run

from flows import rollout
from pipelines.release.rollout import _SCAN_COLUMNS, EPISODES_SCHEMA

CANARY, FOLLOWERS, BUNDLE = "cell-07", ["cell-08", "cell-09"], "bundle-v5"
STEPS = {
    "plan": {"cell": CANARY, "model_version": "4"},
    "trained": {"model_version": "5"},
    "gate": {"passed": True, "candidate": {"interval": [0.5, 0.9]}},
    "promotion": {"promoted": True, "bundle": {"bundle_id": BUNDLE}},
}
asked: dict[str, list] = {"promote": [], "roll_back": []}


@task
def promote(params, workspace, cell_id, trained, gate_record, decision=None) -> dict:
    asked["promote"].append((cell_id, trained["model_version"], decision))
    return {"promoted": True, "reasons": ["promoted"], "bundle": {"bundle_id": BUNDLE}}


@task
def roll_back(params, workspace, cell_id, to_version, decision) -> dict:
    asked["roll_back"].append((cell_id, to_version, decision))
    return {"rolled_back": True}


@flow
def rolling(params, root, outcomes: list[list[dict]]) -> dict:
    """The rollout stage; each poll lands the next batch of canary episodes."""
    batches = iter(outcomes)

    def poll() -> list:
        batch = next(batches, None)
        if batch is not None:
            land(root / params.ingest.dataset, batch)
        return []

    steps = {CANARY: dict(STEPS)}
    record = rollout.roll_out(params, root, steps[CANARY], FOLLOWERS, poll, promote, roll_back)
    return record


def land(dataset, rows: list[dict]) -> None:
    folder = dataset / "episodes"
    folder.mkdir(parents=True, exist_ok=True)
    n = len(list(folder.glob("*.parquet")))
    start = datetime(2026, 12, 3, 6, tzinfo=UTC) + timedelta(hours=n)
    full = [
        {
            "episode_id": f"b{n}-{i}",
            "cell_id": CANARY,
            "policy_version": BUNDLE,
            "start_time": start + timedelta(minutes=i),
            "success": True,
            "safety_stops": 0,
            "trial_request_id": None,
        }
        | row
        for i, row in enumerate(rows)
    ]
    schema = pa.schema([EPISODES_SCHEMA.field(name) for name in _SCAN_COLUMNS])
    pq.write_table(pa.Table.from_pylist(full, schema=schema), folder / f"batch-{n}.parquet")


@pytest.fixture
def fleet_params(params):
    fleet = dataclasses.replace(params.fleet, cells=(CANARY, *FOLLOWERS), canary=CANARY)
    return dataclasses.replace(
        params,
        fleet=dataclasses.replace(fleet, health_timeout_s=1),
        edge=dataclasses.replace(params.edge, health_episodes=4),
        trials=dataclasses.replace(params.trials, poll_s=0.05),
    )


@pytest.fixture(autouse=True)
def clear_asked():
    for calls in asked.values():
        calls.clear()


def test_a_fleet_cycle_with_a_canary_trains_it_alone(fleet_params, params):
    assert rollout.cycle_cells(fleet_params, None) == [CANARY]
    assert rollout.followers(fleet_params, None) == FOLLOWERS
    # A cycle for one named cell is that cell's own: no rollout.
    assert rollout.cycle_cells(fleet_params, "cell-08") == ["cell-08"]
    assert rollout.followers(fleet_params, "cell-08") == []
    # Without a canary, every cell gets its own candidate, as before.
    assert rollout.cycle_cells(params, None) == list(params.fleet.cells)
    assert rollout.followers(params, None) == []


def test_a_healthy_window_rolls_the_version_out_to_the_other_cells(fleet_params, tmp_path):
    # Two polls: 2 episodes, then 2 more (one failure): 3/4 >= floor 0.5, no stop.
    record = rolling(fleet_params, tmp_path, [[{}, {}], [{"success": False}, {}]])
    assert record["window"]["state"] == "passed" and record["state"] == "rolled out"
    assert record["window"]["successes"] == 3 and record["window"]["episodes"] == 4
    assert sorted((c, v) for c, v, _ in asked["promote"]) == [(c, "5") for c in FOLLOWERS]
    decision = asked["promote"][0][2]
    assert decision["kind"] == "rollout" and decision["by"] == "realloop"
    assert "canary cell-07: health window passed: 3/4 successes" in decision["reason"]
    assert {c: s["outcome"] for c, s in record["cells"].items()} == dict.fromkeys(
        FOLLOWERS, "rolled out"
    )
    assert asked["roll_back"] == []


def test_a_safety_stop_on_the_canary_stops_the_rollout_and_rolls_it_back(fleet_params, tmp_path):
    record = rolling(fleet_params, tmp_path, [[{}, {"safety_stops": 1}]])
    assert record["window"]["state"] == "failed"
    assert asked["promote"] == []  # no follower got it
    ((cell, to, decision),) = asked["roll_back"]
    assert (cell, to, decision["kind"]) == (CANARY, "4", "rollback")
    assert "1 safety stops (0 allowed)" in decision["reason"]
    assert record["cells"][CANARY]["outcome"] == "rolled back"
    assert "rolled back to version 4" in record["cells"][CANARY]["reason"]
    for follower in FOLLOWERS:
        assert record["cells"][follower]["outcome"] == "not rolled out"
        assert record["cells"][follower]["reason"].startswith("rollout stopped: canary cell-07")


def test_no_whole_window_by_the_deadline_stops_the_rollout_without_a_rollback(
    fleet_params, tmp_path
):
    record = rolling(fleet_params, tmp_path, [[{}]])  # one episode, then nothing
    assert record["window"]["state"] == "timed out"
    assert "1 of 4 episodes" in record["window"]["reason"]
    assert "not whole by the deadline (1 s)" in record["window"]["reason"]
    assert asked["promote"] == [] and asked["roll_back"] == []
    assert CANARY not in record["cells"]  # it keeps the version
    assert record["state"] == "stopped, canary keeps the version (health window not whole)"


def test_a_canary_not_promoted_this_cycle_rolls_nothing_out(fleet_params, tmp_path):
    steps = {CANARY: {"plan": {"cell": CANARY}, "promotion": {"promoted": False}}}
    record = rollout.stage(fleet_params, tmp_path, None, steps, list, promote, False)
    assert record["state"] == "not started" and asked["promote"] == []
    assert steps["cell-08"]["rollout"]["outcome"] == "not rolled out"
    assert "canary cell-07 was not promoted this cycle" in steps["cell-09"]["rollout"]["reason"]
    # A cycle for one named cell has no rollout stage at all.
    assert rollout.stage(fleet_params, tmp_path, CANARY, steps, list, promote, False) is None


def test_the_summary_says_how_each_cell_ended():
    from flows import cycle

    follower = cycle.cell_result(
        "cell-08", "abc.dir", {"rollout": rollout._step("rolled out", "canary ok", "5")}
    )
    assert (follower["outcome"], follower["promoted_version"]) == ("rolled out", "5")
    assert cycle._result_cell(follower) == "rolled out version 5"
    rejected = {
        "plan": {"cell": CANARY},
        "trained": {"model_version": "5"},
        "waited": {"state": "complete"},
        "gate": {"passed": True, "reasons": [], "candidate": {}, "incumbent": {}},
        "approval": {
            "approved": False,
            "by": "ana",
            "at": "2026-12-03T16:00:00+00:00",
            "reason": "too few trials",
        },
    }
    cell = cycle.cell_result(CANARY, "abc.dir", rejected)
    assert cell["outcome"] == "not promoted" and cell["promoted_version"] is None
    assert cell["reason"] == "not signed off (ana, 2026-12-03T16:00:00+00:00): too few trials"
    window = {"reason": "health window failed: 1/2 successes", "state": "failed"}
    line = cycle.rollout_line(
        {"canary": CANARY, "model_version": "5", "state": "stopped", "window": window}
    )
    assert line == (
        "rollout of version 5 from canary cell-07: stopped (health window failed: 1/2 successes)"
    )


# --- end to end: a fleet cycle with a sign-off and a canary ------------------------------


class CanaryProduction(threading.Thread):
    """The canary's production once the loop promoted a new version there: a short shift run
    by the promoted model (operator on), its logs uploaded whole, labelled with the release."""

    def __init__(self, workspace, initial_version: str, episodes: int, failing: bool = False):
        super().__init__(name="canary production", daemon=True)
        self.workspace, self.initial, self.episodes = workspace, initial_version, episodes
        self.failing = failing  # the canary's line turned hostile: no part lands within 1 mm
        self.error: BaseException | None = None
        self.bundle_id: str | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.wait(1.0):
                if self.promoted():
                    self.shift()
                    return
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.error = exc

    def promoted(self) -> bool:
        from flows.cycle import edge_channel_status
        from pipelines.contract.params import load_params

        params = load_params(self.workspace / "params.yaml")
        edge = edge_channel_status(params, CANARY, self.workspace)
        if edge is None or str(edge["model_version"]) == str(self.initial):
            return False
        self.version, self.bundle_id = str(edge["model_version"]), edge["bundle_id"]
        return True

    def shift(self) -> None:
        from pipelines.contract.params import load_params
        from pipelines.training import download_policy, load_policy
        from refcell.shift import record_shift
        from refcell.world import load_world

        params = load_params(self.workspace / "params.yaml")
        model = params.train.registered_model
        folder = download_policy(
            model, self.version, self.workspace / "canary-model", workspace=self.workspace
        )
        staging = self.workspace / "canary-staging"
        cell = dataclasses.replace(params.cell, cell_id=CANARY)
        if self.failing:
            cell = dataclasses.replace(cell, success_tolerance_m=0.001)
        shift = record_shift(
            load_world("line"),
            cell,
            params.record,
            load_policy(folder),
            self.episodes,
            staging,
            seed=9100,
            interventions=True,
            policy_version=self.bundle_id,
            shift_start=datetime.now(UTC).replace(microsecond=0) + timedelta(hours=3),
        )
        landing = self.workspace / params.ingest.landing
        for log in map(Path, shift["files"]):
            hidden = landing / f".{log.name}.upload"
            shutil.copy(log, hidden)
            hidden.rename(landing / log.name)


def sign_off_when_paused(api: str, seen: dict, stop: threading.Event) -> threading.Thread:
    """A person in the UI: approves the loop's paused run once, keeping what the form said."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def answer() -> None:
        with temporary_settings({PREFECT_API_URL: api}):
            while not stop.wait(1.0):
                with get_client(sync_client=True) as client:
                    paused = [r for r in client.read_flow_runs() if r.state and r.state.is_paused()]
                    if not paused:
                        continue
                    keyset = paused[0].state.state_details.run_input_keyset
                    seen["form"] = client.read_flow_run_input(paused[0].id, keyset["description"])
                resume_flow_run(
                    paused[0].id,
                    run_input={"approve": True, "by": "ana", "reason": "trials look right"},
                )
                return

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def fleet_cycle(tmp_path: Path, failing: bool) -> tuple[dict, dict, dict]:
    """A fleet cycle of `realloop loop` against a Prefect server on loopback: cell-07 the
    canary (trials answered by a stand-in cell, sign-off given through the API, production
    after its promotion), cell-08 the follower. The summary, the form seen, the deploys."""
    from tests.conftest import realloop
    from tests.flows.test_loop import StandInCell, record_production_shift, small_params
    from tests.flows.test_serve import PREFECT, clean_env, free_port, healthy, started, wait_until
    from tests.pipelines.test_cycle_record import copy_pipeline

    workspace = tmp_path / "workspace"
    workspace.mkdir()
    raw = yaml.safe_load(small_params(workspace).read_text())
    raw["fleet"].update(cells=[CANARY, "cell-08"], canary=CANARY, health_timeout_s=600)
    raw["promote"].update(require_approval=True, approval_timeout_s=600)
    raw["edge"].update(health_episodes=4, health_max_episodes=4)  # the canary's shift: one look
    raw["gate"]["margin"] = 0.5  # 6 trial episodes per arm: the candidate passes, as intended here
    (workspace / "params.yaml").write_text(yaml.safe_dump(raw))
    copy_pipeline(workspace, code=False)
    assert realloop("cell", "pretrain", "--json", cwd=workspace).returncode == 0
    deployed = {}
    for cell_id in (CANARY, "cell-08"):
        run = realloop(
            "deploy", "--initial", "models/sim-policy", "--cell", cell_id, "--json", cwd=workspace
        )
        assert run.returncode == 0, run.stderr
        deployed[cell_id] = json.loads(run.stdout)
    record_production_shift(workspace, CANARY, 0)

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server = [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    stop, seen = threading.Event(), {}
    cell = StandInCell(CANARY, workspace, tmp_path / "cell")
    production = CanaryProduction(workspace, deployed[CANARY]["model_version"], 4, failing)
    with started(
        [*server, "--analytics-off", "--no-ui"],
        tmp_path / "server.log",
        env=clean_env(PREFECT_HOME=str(tmp_path / "server-home")),
        cwd=tmp_path,
    ) as process:
        wait_until(lambda: healthy(api) or process.poll() is not None, 120, "the Prefect server")
        for thread in (cell, production):
            thread.start()
        signer = sign_off_when_paused(api, seen, stop)
        try:
            loop = subprocess.run(
                [sys.executable, "-m", "flows.cli", "loop", "--json"],
                cwd=workspace,
                env=clean_env(PREFECT_API_URL=api, PREFECT_HOME=str(tmp_path / "client-home")),
                capture_output=True,
                text=True,
                timeout=900,
            )
        finally:
            stop.set()
            for thread in (cell, production):
                thread.stopping.set()
                thread.join(timeout=60)
            signer.join(timeout=10)
    assert loop.returncode == 0, loop.stderr[-3000:]
    assert cell.error is None and production.error is None, (cell.error, production.error)
    return json.loads(loop.stdout), seen, deployed


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_fleet_cycle_signs_off_the_canary_and_rolls_out_after_its_window(tmp_path):
    summary, seen, _ = fleet_cycle(tmp_path, failing=False)
    by_cell = {c["cell"]: c for c in summary["cells"]}
    canary, follower = by_cell[CANARY], by_cell["cell-08"]
    assert canary["outcome"] == "promoted", (canary["reason"], canary["gate"])
    assert canary["approval"]["approved"] is True and canary["approval"]["by"] == "ana"
    assert f"Promote version {canary['promoted_version']} to {CANARY}?" in seen["form"]
    assert summary["rollout"]["window"]["state"] == "passed", summary["rollout"]
    assert follower["outcome"] == "rolled out", follower["reason"]
    assert follower["promoted_version"] == canary["promoted_version"]
    assert follower["training"] is None  # it trained nothing: the canary's model reached it
    assert follower["edge"]["model_version"] == int(canary["promoted_version"])
    assert follower["edge"]["decision"] == "rollout"
    assert canary["edge"]["decision"] == "approval"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_failed_window_rolls_the_canary_back_and_reaches_no_other_cell(tmp_path):
    summary, _, deployed = fleet_cycle(tmp_path, failing=True)
    by_cell = {c["cell"]: c for c in summary["cells"]}
    canary, follower = by_cell[CANARY], by_cell["cell-08"]
    window = summary["rollout"]["window"]
    assert window["state"] == "failed" and window["successes"] < window["episodes"], window
    before = deployed[CANARY]["model_version"]
    assert canary["outcome"] == "rolled back", canary["reason"]
    assert f"rolled back to version {before}" in canary["reason"]
    assert canary["edge"]["model_version"] == int(before)
    assert canary["edge"]["decision"] == "rollback"
    rollback = summary["rollout"]["rollback"]["decision"]
    assert rollback["kind"] == "rollback" and "health window failed" in rollback["reason"]
    assert follower["outcome"] == "not rolled out"
    assert follower["edge"]["bundle_id"] == deployed["cell-08"]["bundle_id"]  # untouched
