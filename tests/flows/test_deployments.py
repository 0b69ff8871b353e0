"""`realloop deploy-flows`, the events realloop emits, and the loop's suspended wait.

The quick tests check the events and triggers as Prefect's own server code reads them (its
trigger matching and the way ResumeFlowRun picks the flow run to resume), the waiting records
and the deployments as built. The `services` test runs the whole shape for real: a Prefect
server and a process worker on loopback, a loop that suspends while a stand-in cell answers
its trial request, is resumed by the automation once ingest sees the trials, and completes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from flows import events, waiting
from flows.deployments import RESUME_AUTOMATION, loop_triggers, resume_automation
from flows.serve import INGEST_DEPLOYMENT, LOOP_DEPLOYMENT, REFRESH_DEPLOYMENT, build_deployments
from pipelines.contract.params import load_params


def received(event: dict):
    """An event as the server receives it, from flows.events' description of one, with the
    related resource Prefect's events worker adds from the run context (the ingest flow run
    that emitted it) after ours."""
    from prefect.server.events.schemas.events import ReceivedEvent

    ingest_run = {
        "prefect.resource.id": f"prefect.flow-run.{uuid.uuid4()}",
        "prefect.resource.role": "flow-run",
    }
    return ReceivedEvent(
        occurred=datetime.now(UTC),
        event=event["event"],
        resource={"prefect.resource.id": event["resource_id"]},
        related=[*event.get("related", []), ingest_run],
        payload=event.get("payload", {}),
        id=uuid.uuid4(),
    )


def server_trigger(trigger):
    from prefect.server.events.schemas.automations import EventTrigger

    return EventTrigger.model_validate(trigger.model_dump(include=set(EventTrigger.model_fields)))


def test_the_resume_automation_fires_on_trials_ready_and_resumes_the_waiting_run():
    from prefect.server.events.actions import _id_of_first_resource_of_kind

    loop_run = str(uuid.uuid4())
    ready = received(events.trials_ready_event(loop_run, {"cell-07-r1": "complete"}))
    automation = resume_automation()
    trigger = server_trigger(automation.trigger)
    assert trigger.covers(ready)
    assert [a.type for a in automation.actions] == ["resume-flow-run"]
    # ResumeFlowRun resumes the first prefect.flow-run resource: the loop, not the ingest run.
    assert str(_id_of_first_resource_of_kind(ready, "prefect.flow-run")) == loop_run
    other = {"event": events.INGEST_COMPLETED, "resource_id": "realloop.dataset.abc"}
    assert not trigger.covers(received(other))


def test_the_loop_starts_on_drift_and_on_edge_cases_but_not_on_every_ingest(params):
    triggers = [server_trigger(t) for t in loop_triggers(params)]
    cell_event = {"resource_id": "realloop.cell.cell-07"}
    for name in (events.DRIFT_DETECTED, events.EDGE_CASES_THRESHOLD):
        assert sum(t.covers(received(cell_event | {"event": name})) for t in triggers) == 1
    for name in (events.INGEST_COMPLETED, events.TRIALS_READY):
        assert not any(t.covers(received(cell_event | {"event": name})) for t in triggers)


def test_a_trigger_becomes_an_automation_that_runs_the_loop_deployment(params):
    deployment_id = uuid.uuid4()
    for trigger in loop_triggers(params):
        trigger.set_deployment_id(deployment_id)
        automation = trigger.as_automation()
        (action,) = automation.actions
        assert action.type == "run-deployment" and action.deployment_id == deployment_id


def test_the_edge_case_threshold_fires_once_per_crossing_and_never_when_off():
    since = {"cell-07": 12, "cell-08": 3, "cell-09": None}
    assert events.over_threshold({"cell-07": 2, "cell-08": 1}, since, 10) == ["cell-07"]
    assert events.over_threshold({"cell-07": 0}, since, 10) == []  # no new ones this run
    assert events.over_threshold({"cell-09": 4}, since, 1) == []  # unknown: left to drift
    assert events.over_threshold({"cell-07": 2}, since, 0) == []  # 0 turns it off


def test_the_ingest_event_says_what_arrived():
    result = {
        "source": "data/landing",
        "dataset_version": "v1",
        "dataset": {"new": True},
        "ingest": {"files_ingested": 2, "episodes_ingested": 20, "files_quarantined": 1},
    }
    payload = events.ingest_payload(result, {"cell-07": 3}, {"cell-07": 11}, ["r1"])
    assert payload == {
        "dataset_version": "v1",
        "new_version": True,
        "source": "data/landing",
        "new_files": 2,
        "episodes": 20,
        "quarantined": 1,
        "new_edge_cases": {"cell-07": 3},
        "edge_cases_since_production": {"cell-07": 11},
        "complete_requests": ["r1"],
    }
    json.dumps(payload)  # an event payload is JSON


def test_without_a_server_or_a_flow_run_nothing_is_emitted(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert not events.listening()
    assert events.emit(events.DRIFT_DETECTED, "realloop.cell.cell-07", {}) is False


def test_an_unreachable_server_gets_nothing_and_one_warning(monkeypatch, caplog):
    from tests.flows.test_serve import free_port

    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")  # nobody there
    assert events.emit(events.DRIFT_DETECTED, "realloop.cell.cell-07", {}) is False
    assert [r.message for r in caplog.records if "not reachable" in r.message]


def request(cell_id: str, deadline_in_s: float) -> dict:
    now = datetime.now(UTC).replace(microsecond=0)
    return {
        "request_id": f"{cell_id}-{uuid.uuid4().hex[:6]}",
        "cell_id": cell_id,
        "episodes_per_arm": 2,
        "created_at": now.isoformat(),
        "deadline": (now + timedelta(seconds=deadline_in_s)).isoformat(),
    }


def test_a_waiting_run_is_ready_when_each_request_is_settled(tmp_path, params):
    (tmp_path / params.ingest.dataset / "episodes").mkdir(parents=True)
    late, open_ = request("cell-07", -1), request("cell-08", 3600)
    waiting.save(tmp_path, "run-a", {"cell-07": late}, {"n": 1})
    waiting.save(tmp_path, "run-b", {"cell-07": late, "cell-08": open_}, {"n": 2})
    ready, complete = waiting.ready_runs(params, tmp_path)
    assert ready == {"run-a": {late["request_id"]: "timed out"}} and complete == []
    assert waiting.load(tmp_path, "run-b")["cycle"] == {"n": 2}
    waiting.discard(tmp_path, "run-a")
    assert [r["flow_run_id"] for r in waiting.records(tmp_path, params)] == ["run-b"]


def test_a_record_past_its_last_deadline_and_the_grace_is_stale(tmp_path, params):
    gone = request("cell-07", -waiting.grace_s(params) - 5)
    waiting.save(tmp_path, "run-old", {"cell-07": gone}, {})
    assert waiting.records(tmp_path, params) == []
    assert len(waiting.records(tmp_path)) == 1  # still there: the next loop removes it
    assert waiting.drop_stale(tmp_path, params) == ["run-old"] and not waiting.records(tmp_path)


def test_the_loops_state_survives_the_suspension_as_json():
    from flows.loop import _Fleet

    fleet = _Fleet(["cell-07", "cell-08"])
    fleet.steps["cell-07"] = {"plan": {"base": Path("models/x")}, "request": request("c", 9)}
    fleet.errors["cell-08"] = "plan: no production model"
    fleet.lap("ingest")
    saved = waiting.jsonable(
        {"fleet": fleet.snapshot(), "number": 3, "ingested": {"a": 1}, "validation": {"b": 2}}
    )
    again, number, ingested, validation = _Fleet.restore(saved)
    assert (number, ingested, validation) == (3, {"a": 1}, {"b": 2})
    assert again.going() == ["cell-07"] and again.steps["cell-07"]["plan"]["base"] == "models/x"
    assert again.started == fleet.started and "ingest" in again.timings


def test_the_work_pool_deployments_run_in_the_workspace_and_suspend(params_path, tmp_path):
    extra = {
        INGEST_DEPLOYMENT: {"job_variables": {"working_dir": str(tmp_path)}},
        LOOP_DEPLOYMENT: {"parameters": {"suspend_for_trials": True}, "triggers": []},
    }
    ingest, loop, refresh = build_deployments(params_path, None, extra)
    assert ingest.job_variables == {"working_dir": str(tmp_path)}
    assert loop.parameters["suspend_for_trials"] is True
    assert loop.parameters["params_path"] == str(params_path)  # the common ones kept
    assert loop.entrypoint == "flows.loop.loop_flow"
    plain_ingest, plain_loop, _ = build_deployments(params_path)  # `realloop serve`'s
    assert "suspend_for_trials" not in plain_loop.parameters and not plain_ingest.job_variables
    # The timestamp is re-signed every third of its expiry, in the same workspace.
    expiry = load_params(params_path).promote.timestamp_expiry_s
    assert refresh.name == REFRESH_DEPLOYMENT
    assert refresh.entrypoint == "flows.keys_refresh.keys_refresh_flow"
    assert refresh.schedules[0].schedule.interval.total_seconds() == expiry / 3
    assert refresh.parameters == plain_loop.parameters


def test_deploy_flows_without_a_server_says_how_to_get_one(tmp_path):
    from tests.conftest import without_prefect_settings

    run = subprocess.run(
        [sys.executable, "-m", "flows.cli", "deploy-flows", "--json"],
        cwd=tmp_path,
        env=without_prefect_settings(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("realloop: deploy-flows needs a Prefect server")
    assert len(run.stderr.strip().splitlines()) == 1


# --- the whole shape on loopback -----------------------------------------------------------


@pytest.mark.services
@pytest.mark.timeout(1200)
def test_a_deployed_loop_suspends_for_its_trials_and_the_automation_resumes_it(tmp_path):
    """drift event → loop run → trials requested → Suspended (its process gone) → the
    stand-in cell answers → the ingest deployment sees the request complete →
    realloop.trials.ready → the automation resumes the run → it gates and completes; no task
    before the wait ran twice."""
    from tests.flows.test_loop import StandInCell

    began = time.monotonic()
    workspace = loop_workspace(tmp_path)
    cell = StandInCell("cell-07", workspace, tmp_path / "cell")
    try:
        history, names = run_on_a_pool(tmp_path, workspace, cell.start)
    finally:
        cell.stopping.set()
        cell.join(timeout=60)
    assert cell.error is None, repr(cell.error)
    assert history[-1] == "Completed", (history, (tmp_path / "worker.log").read_text()[-4000:])
    assert "Suspended" in history, history
    ledger = (workspace / ".realloop" / "cycles.jsonl").read_text().splitlines()
    (summary,) = [json.loads(line) for line in ledger]
    (cell_07,) = summary["cells"]
    assert cell_07["gate"] is not None and "passed" in cell_07["gate"], cell_07  # a verdict
    # A task named per cell keeps its name; any other is <name>-<suffix>.
    kinds = [name if " " in name else name.rsplit("-", 1)[0] for name in names]
    before_the_wait = ("ingest", "validate", "plan cell-07", "fine-tune cell-07")
    for kind in (*before_the_wait, "upload candidate cell-07", "request trials cell-07"):
        assert kinds.count(kind) == 1, names  # run once, in the run before the suspension
    assert kinds.count("await-trials") == 1 and kinds.count("gate cell-07") == 1, names
    assert not list((workspace / waiting.WAITING_DIR).glob("*.json"))  # picked up, removed
    print(f"suspend/resume test: {time.monotonic() - began:.0f} s; states {history}")


def loop_workspace(tmp_path: Path) -> Path:
    """One lenient cell with its first model and a production shift (tests/flows/test_loop)."""
    import yaml

    from tests.conftest import realloop
    from tests.flows.test_loop import record_production_shift, small_params
    from tests.pipelines.test_cycle_record import copy_pipeline

    workspace = tmp_path / "workspace"
    workspace.mkdir()
    params_path = small_params(workspace)
    raw = yaml.safe_load(params_path.read_text())
    raw["fleet"]["cells"] = ["cell-07"]
    raw["trials"].update(max_episodes=4, timeout_s=600)
    raw["ingest"]["schedule_interval_s"] = 10  # the ingest deployment: how soon it sees trials
    raw["serve"]["loop_cron"] = "0 3 1 1 *"  # the floor, not due during the test
    params_path.write_text(yaml.safe_dump(raw))
    copy_pipeline(workspace, code=False)
    run = realloop("cell", "pretrain", "--json", cwd=workspace)
    assert run.returncode == 0, run.stderr
    run = realloop("deploy", "--initial", "models/sim-policy", "--cell", "cell-07", cwd=workspace)
    assert run.returncode == 0, run.stderr
    record_production_shift(workspace, "cell-07", 0)
    return workspace


def run_on_a_pool(tmp_path: Path, workspace: Path, start_cell) -> tuple[list[str], list[str]]:
    """A server and a process worker; deploy-flows; a drift event. Returns the loop run's
    state history and the names of its task runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.flows.test_serve import PREFECT, clean_env, free_port, healthy, started, wait_until

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server_args = [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server_args += ["--analytics-off", "--no-ui"]
    server_env = clean_env(PREFECT_HOME=str(tmp_path / "server-home"))
    client_env = clean_env(PREFECT_API_URL=api, PREFECT_HOME=str(tmp_path / "client-home"))
    worker_args = [str(PREFECT), "worker", "start", "--pool", "realloop", "--type", "process"]
    worker_env = client_env | {"PREFECT_WORKER_QUERY_SECONDS": "2"}
    with (
        started(server_args, tmp_path / "server.log", env=server_env, cwd=tmp_path) as server,
        temporary_settings({PREFECT_API_URL: api}),
    ):
        wait_until(lambda: healthy(api) or server.poll() is not None, 120, "the Prefect server")
        with (
            started(worker_args, tmp_path / "worker.log", env=worker_env, cwd=workspace),
            get_client(sync_client=True) as client,
        ):
            wait_until(lambda: _pool(client), 60, "the worker's pool")
            loop = deploy(workspace, client_env)
            start_cell()
            python(_EMIT_DRIFT, workspace, client_env)
            run = wait_until(lambda: _loop_run(client, loop["id"]), 120, "a loop run on drift")
            _watch(client, run.id)
            history = [s.name for s in client.read_flow_run_states(run.id)]
            only_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
            names = [t.name for t in client.read_task_runs(flow_run_filter=only_this_run)]
    return history, names


def deploy(workspace: Path, env: dict[str, str]) -> dict:
    """`realloop deploy-flows --json`; the loop deployment as it describes it."""
    printed = python(None, workspace, env, "deploy-flows", "--json")
    (workspace.parent / "deploy-flows.json").write_text(printed)  # for a reader of the run
    described = json.loads(printed)
    (loop,) = [d for d in described["deployments"] if d["name"].endswith("/retrain-loop")]
    expected = {events.DRIFT_DETECTED, events.EDGE_CASES_THRESHOLD}
    assert {e for t in loop["triggers"] for e in t["expect"]} == expected, loop
    assert loop["parameters"]["suspend_for_trials"] is True
    assert loop["job_variables"] == {"working_dir": str(workspace)}
    assert loop["concurrency"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    (ingest,) = [d for d in described["deployments"] if d["name"] == "ingest/ingest"]
    assert ingest["concurrency"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    (refresh,) = [d for d in described["deployments"] if d["name"].endswith("/keys-refresh")]
    assert refresh["schedules"] == [{"interval_s": 28800.0}]  # a third of the 1-day expiry
    assert refresh["job_variables"] == {"working_dir": str(workspace)}
    (resume,) = [a for a in described["automations"] if a["name"] == RESUME_AUTOMATION]
    assert resume["expect"] == [events.TRIALS_READY] and resume["actions"] == ["resume-flow-run"]
    return loop


def python(code: str | None, cwd: Path, env: dict[str, str], *cli: str) -> str:
    """`python -c code`, or the realloop command line with `cli`; its stdout."""
    args = ["-c", code] if code else ["-m", "flows.cli", *cli]
    run = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


_EMIT_DRIFT = (
    "from flows import events; "
    "assert events.emit(events.DRIFT_DETECTED, 'realloop.cell.cell-07', {'reasons': ['test']}); "
    "from prefect.events.worker import EventsWorker; EventsWorker.drain_all(timeout=30)"
)


def _pool(client) -> bool:
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_work_pool("realloop") is not None
    except ObjectNotFound:
        return False


def _loop_run(client, deployment_id: str):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deployment = DeploymentFilter(id=DeploymentFilterId(any_=[uuid.UUID(deployment_id)]))
    runs = client.read_flow_runs(deployment_filter=deployment)
    # Not the cron's next run, which the scheduler creates ahead as Scheduled.
    started = [r for r in runs if r.state and not r.state.is_scheduled()]
    return started[0] if started else None


def _watch(client, flow_run_id, timeout_s: float = 900) -> None:
    """Until the run is final."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = client.read_flow_run(flow_run_id).state
        if state and state.is_final():
            return
        time.sleep(2)
    raise AssertionError(f"loop run not final after {timeout_s:.0f} s")
