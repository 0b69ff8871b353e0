"""Fault: the worker running a flow is killed mid-flow.

realloop's ingest deployment (`realloop deploy-flows`, from the installed package) runs on the
profile's pool over 40 landed logs. Once a few are in the manifest, the worker that took the
run and the flow-run process it started are killed with SIGKILL, as when their machine or
container dies (a process worker starts each flow run in a session of its own, so killing the
worker alone leaves the run going). Nobody is left to report the run: the server learns of it
from its missing heartbeats (flows/recovery.py: `deploy-flows` registers the automation), marks
it Crashed and schedules it again; the surviving worker runs it to the end. `realloop services
up` restarts the dead worker, as a supervisor would.

No data lost, none doubled: every log ingested exactly once (the rerun skips those the dead
run finished, by sha256), one dataset version holding every source.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import yaml

from flows import recovery
from flows import services as sv
from pipelines.ingest import sha256_file, versioning
from pipelines.ingest.store import read_manifest
from tests.conftest import ROOT
from tests.faults.conftest import HEARTBEAT_S, bring_back, client_env, start_run, wait_for_state

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]
LOGS = 40


def ingest_workspace(root, profile) -> tuple:
    """A git+DVC workspace with LOGS distinct logs landed, its deployments on the pool."""
    from bench.fleet_ingest import _variant
    from bench.ingest_incremental import _record_base

    root.mkdir()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["ingest"]["schedule_interval_s"] = 86400  # no scheduled tick during the test
    params["serve"]["loop_cron"] = "0 3 1 1 *"
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    versioning.ensure_workspace(root, ".realloop/dvc-remote")
    base = _record_base(root.parent / "recorded", 2, ROOT / "params.yaml")
    landing = root / "data" / "landing"
    for index in range(LOGS):
        _variant(base, landing, f"cell-{index % 4 + 7:02d}", index)
    env = client_env(profile) | {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": HEARTBEAT_S}
    deployed = _realloop_json(root, env, "deploy-flows", "--json")
    (ingest,) = [d for d in deployed["deployments"] if d["name"] == "ingest/ingest"]
    return ingest["id"], deployed


def test_a_killed_worker_run_is_crashed_retried_and_completes_with_each_log_once(profile, tmp_path):
    workspace = tmp_path / "workspace"
    deployment, deployed = ingest_workspace(workspace, profile)
    names = {a["name"] for a in deployed["automations"]}
    assert {recovery.CRASH_AUTOMATION, recovery.RERUN_AUTOMATION} <= names, names
    dataset = workspace / "data" / "dataset"
    flow_run_id = start_run(profile, deployment)
    _wait(lambda: len(read_manifest(dataset)) >= 3, 300, "3 logs ingested")

    run = sv.prefect_api(profile, f"flow_runs/{flow_run_id}")
    flow_pid = int(str(run["infrastructure_pid"]).rsplit(":", 1)[-1])
    worker_pid = _parent(flow_pid)
    (worker,) = [w for w in sv.WORKERS if sv.running_pid(profile, w) == worker_pid]
    killed_at, done_before = time.monotonic(), len(read_manifest(dataset))
    for pid in (worker_pid, flow_pid):
        os.killpg(pid, signal.SIGKILL)
    bring_back(profile)  # the supervisor restarts the worker; either one may rerun the run

    run = wait_for_state(profile, flow_run_id, {"COMPLETED"}, timeout_s=600)
    recovered_s = time.monotonic() - killed_at
    states = sv.prefect_api(profile, f"flow_run_states/?flow_run_id={flow_run_id}")
    history = [state["name"] for state in sorted(states, key=lambda state: state["timestamp"])]
    assert "Crashed" in history and "AwaitingRetry" in history, history
    assert history.index("Crashed") < history.index("AwaitingRetry")
    assert history[-1] == "Completed" and history.count("Crashed") == 1, history
    assert run["run_count"] >= 2, run

    landed = {sha256_file(path) for path in (workspace / "data" / "landing").glob("*.mcap")}
    stored = {path.stem for path in (dataset / "episodes").glob("*.parquet")}
    assert len(landed) == LOGS and stored == landed  # every log's episodes in the dataset
    rows = read_manifest(dataset)
    ingested = [r["sha256"] for r in rows if r["result"] == "ingested"]
    assert len(ingested) == len(set(ingested)), rows  # none ingested twice
    # A log the dead run published but had not recorded yet gets its "ingested" line from
    # the rerun (pipelines/ingest/store.py: record_unrecorded): every log has exactly one.
    assert set(ingested) == landed, rows
    recovered = [r for r in rows if r["result"] == "ingested" and r["reason"]]
    assert not [r for r in rows if r["result"] == "quarantined"], rows
    versions = versioning.list_versions(workspace)
    assert len(versions) == 1, versions  # one version, no duplicate of a half-run
    assert set(versioning.version_sources(workspace, versions[0].version)) == landed
    print(
        f"killed {worker} after {done_before}/{LOGS} logs; crashed, retried and completed "
        f"{recovered_s:.0f} s later; recorded by the rerun: {len(recovered)}; "
        f"states {history}"
    )


def _realloop_json(cwd, env, *args: str) -> dict:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def _wait(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)
