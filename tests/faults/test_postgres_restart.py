"""Fault: PostgreSQL restarted in the middle of a flow run.

Both servers keep their state in the profile's PostgreSQL: the Prefect server (flow and task
run states) and the MLflow server (runs, metrics). A flow run on the work pool (a task every
2 s, each logging a metric to MLflow) is running when PostgreSQL is stopped (`pg_ctl stop -m
fast`, as an upgrade or a failover does: every connection dropped) and started again 5 s later
by `realloop services up`. Requests in that window fail on the servers' side and the clients
(Prefect's, MLflow's) retry them; the run must complete with each step done once.
"""

from __future__ import annotations

import time
import uuid

import pytest

from flows import services as sv
from tests.faults.conftest import (
    _flow_run_in_postgres,
    bring_back,
    deploy_fault_flow,
    start_run,
    step_lines,
    wait_for_state,
)

pytestmark = pytest.mark.faults
STEPS, PAUSE_S, DOWN_S = 10, 2.0, 5.0


def test_a_flow_run_completes_across_a_postgres_restart_with_each_step_once(in_profile):
    from mlflow import MlflowClient

    profile = in_profile
    deployment = deploy_fault_flow(profile, "postgres-restart")
    out = profile.workspace / f"pg-{uuid.uuid4().hex[:8]}"
    out.mkdir()
    flow_run_id = start_run(profile, deployment, out=str(out), steps=STEPS, pause_s=PAUSE_S)
    _wait_for_steps(out, 3, timeout_s=180)

    assert sv.stop_postgres(profile)
    time.sleep(DOWN_S)
    back_s = bring_back(profile)
    run = wait_for_state(profile, flow_run_id, {"COMPLETED", "FAILED", "CRASHED"}, 300)

    assert run["state_type"] == "COMPLETED", run["state"]
    assert run["run_count"] == 1  # not rerun: it rode the restart out
    assert _flow_run_in_postgres(profile, flow_run_id) == "COMPLETED"
    lines = step_lines(out)
    assert sorted(line["step"] for line in lines) == list(range(STEPS)), lines  # each once
    mlflow_run_id = (out / "done").read_text()
    client = MlflowClient(profile.url("mlflow"))
    assert client.get_run(mlflow_run_id).info.status == "FINISHED"
    history = client.get_metric_history(mlflow_run_id, "step")
    assert sorted(m.step for m in history) == list(range(STEPS))
    tasks = sv.prefect_api(
        profile, "task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    )
    # Task run states reach the server as events, which its task-run recorder writes to
    # PostgreSQL; one that arrives while the database is down is dropped, and the task shows
    # Running for ever though it completed (a known Prefect limitation: PrefectHQ/prefect#19261).
    # The flow run's own states go through the API, which the client retries: they are right.
    assert len(tasks) == STEPS
    stale = [t["name"] for t in tasks if t["state_type"] != "COMPLETED"]
    assert len(stale) <= 2, stale  # only those that ended inside the outage
    print(
        f"PostgreSQL down {DOWN_S:.0f} s, back in {back_s:.1f} s; run {run['total_run_time']} s; "
        f"task states left stale by the outage: {stale or 'none'}"
    )


def _wait_for_steps(out, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(step_lines(out)) < count:
        assert time.monotonic() < deadline, f"{out}: fewer than {count} steps in {timeout_s} s"
        time.sleep(0.5)
