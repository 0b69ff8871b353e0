"""`realloop services`: the production profile, and how commands pick it up.

The first tests are quick (no server). The last one, marked `services` (run by
`make test-services`, not by `make test`), starts the real profile in a fresh workspace:
PostgreSQL, moto's S3 server, the Prefect and MLflow servers and two process workers, runs a
flow from a deployment on the work pool, and stops and restarts it all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from flows import services as sv
from tests.conftest import realloop, without_prefect_settings

ENV_LINES = (
    "PREFECT_API_URL=http://127.0.0.1:1/api\n"
    "MLFLOW_TRACKING_URI=http://127.0.0.1:2\n"
    "REALLOOP_S3_ENDPOINT_URL=http://127.0.0.1:3\n"
)


def test_services_env_fills_what_is_unset_and_never_overrides(tmp_path, monkeypatch):
    for name in sv.CLIENT_ENV_NAMES:
        monkeypatch.delenv(name, raising=False)  # restored after the test either way
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://exported:5000")
    (tmp_path / sv.ENV_FILE).parent.mkdir()
    (tmp_path / sv.ENV_FILE).write_text("# a comment\n" + ENV_LINES)

    assert sv.load_services_env(tmp_path) == ["PREFECT_API_URL", "REALLOOP_S3_ENDPOINT_URL"]
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:1/api"
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://exported:5000"
    assert sv.load_services_env(tmp_path / "elsewhere") == []


def test_configure_prefect_uses_the_workspace_profile_not_the_ephemeral_api(tmp_path):
    """A flow started from Python in a workspace with a profile talks to its servers."""
    (tmp_path / sv.ENV_FILE).parent.mkdir()
    (tmp_path / sv.ENV_FILE).write_text(ENV_LINES)
    script = (
        "import os, sys; from pathlib import Path\n"
        "from flows.prefect_env import api_url, configure_prefect\n"
        "configure_prefect(Path(sys.argv[1]))\n"
        "print(api_url(), os.environ.get('PREFECT_HOME'), os.environ['MLFLOW_TRACKING_URI'])\n"
    )
    env = {k: v for k, v in without_prefect_settings().items() if k not in sv.CLIENT_ENV_NAMES}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["http://127.0.0.1:1/api", "None", "http://127.0.0.1:2"]


def test_up_without_postgresql_says_how_to_install_it_and_starts_nothing(tmp_path):
    env = dict(os.environ, REALLOOP_PG_BIN=str(tmp_path / "no-postgres"))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "services", "up", "--s3-port", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert "apt-get install -y postgresql" in done.stderr and sv.PG_BIN_ENV in done.stderr
    assert not list(tmp_path.rglob("*.pid"))


def test_status_without_a_profile_exits_3(tmp_path):
    done = realloop("services", "status", "--json", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert json.loads(done.stdout)["parts"] == []


# --- the real profile --------------------------------------------------------------------------

CHECK_FLOW = textwrap.dedent(
    """
    import tempfile
    from pathlib import Path

    from prefect import flow, runtime


    @flow(name="services-check")
    def services_check() -> None:
        \"\"\"On a worker: an MLflow run, tagged with this flow run, with one artifact.\"\"\"
        import mlflow

        client = mlflow.MlflowClient()  # MLFLOW_TRACKING_URI: the worker's environment
        found = client.get_experiment_by_name("services-check")
        experiment = found.experiment_id if found else client.create_experiment("services-check")
        run = client.create_run(experiment, tags={"flow_run_id": str(runtime.flow_run.id)})
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "hello.txt").write_text("from a worker")
            client.log_artifact(run.info.run_id, str(Path(folder) / "hello.txt"))
        client.set_terminated(run.info.run_id)
    """
)
DEPLOY_AND_RUN = textwrap.dedent(
    """
    import json, sys
    from prefect import flow
    from prefect.deployments import run_deployment

    flow.from_source(source=sys.argv[1], entrypoint="check_flow.py:services_check").deploy(
        name="check", work_pool_name=sys.argv[2], print_next_steps=False, ignore_warnings=True
    )
    run = run_deployment("services-check/check", timeout=300)
    print(json.dumps({"id": str(run.id), "state": run.state.type.value}))
    """
)


@pytest.fixture
def workspace():
    """A fresh workspace the postgres user can enter (pytest's tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="realloop-services-"))
    folder.chmod(0o755)
    yield folder
    realloop("services", "down", cwd=folder)
    shutil.rmtree(folder, ignore_errors=True)


def _timed(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = realloop(*args, cwd=cwd)
    assert done.returncode in (0, 3), done.stderr
    return done, time.monotonic() - started


def _run_flow_on_the_pool(workspace: Path) -> str:
    """Deploy a flow from the workspace, run it on the pool, return the flow run id."""
    (workspace / "check_flow.py").write_text(CHECK_FLOW)
    env = without_prefect_settings() | sv.load_profile(workspace).client_env()
    done = subprocess.run(
        [sys.executable, "-c", DEPLOY_AND_RUN, str(workspace), sv.WORK_POOL],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["state"] == "COMPLETED", run
    return run["id"]


def _flow_run_in_postgres(profile: sv.Profile, flow_run_id: str) -> str | None:
    import psycopg2

    connection = psycopg2.connect(
        host="127.0.0.1",
        port=profile.ports["postgres"],
        user=sv.DB_ROLE,
        password=profile.password,
        dbname="prefect",
    )
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT state_type FROM flow_run WHERE id = %s", (flow_run_id,))
            row = cursor.fetchone()
    finally:
        connection.close()
    return row and row[0]


def _mlflow_run(profile: sv.Profile, flow_run_id: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=profile.url("mlflow"))
    experiment = client.get_experiment_by_name("services-check")
    runs = client.search_runs([experiment.experiment_id], f"tags.flow_run_id = '{flow_run_id}'")
    assert len(runs) == 1
    return runs[0], [a.path for a in client.list_artifacts(runs[0].info.run_id)]


@pytest.mark.services
def test_services_up_runs_flows_on_workers_and_keeps_data_across_down_up(workspace):
    ports = ["--postgres-port", "0", "--s3-port", "0", "--prefect-port", "0", "--mlflow-port", "0"]
    up, up_s = _timed("services", "up", "--json", *ports, cwd=workspace)
    report = json.loads(up.stdout)
    assert report["all_up"], report
    assert [p["part"] for p in report["parts"]] == [
        "postgres",
        "s3",
        "prefect",
        "mlflow",
        *sv.WORKERS,
    ]
    env_file = (workspace / sv.ENV_FILE).read_text()
    profile = sv.load_profile(workspace)
    assert f"PREFECT_API_URL={profile.url('prefect')}/api" in env_file
    assert f"MLFLOW_TRACKING_URI={profile.url('mlflow')}" in env_file
    assert f"REALLOOP_S3_ENDPOINT_URL={profile.url('s3')}" in env_file

    pool = sv.prefect_api(profile, f"work_pools/{sv.WORK_POOL}")
    assert pool["type"] == "process"
    assert sv.online_workers(profile) == set(sv.WORKERS)

    flow_run_id = _run_flow_on_the_pool(workspace)
    assert _flow_run_in_postgres(profile, flow_run_id) == "COMPLETED"
    run, artifacts = _mlflow_run(profile, flow_run_id)
    assert artifacts == ["hello.txt"]
    keys = [o["Key"] for o in sv.s3_client(profile).list_objects_v2(Bucket=sv.BUCKET)["Contents"]]
    assert f"mlflow/{run.info.experiment_id}/{run.info.run_id}/artifacts/hello.txt" in keys

    again, again_s = _timed("services", "up", "--json", cwd=workspace)  # idempotent
    assert [p["pid"] for p in json.loads(again.stdout)["parts"]] == [
        p["pid"] for p in report["parts"]
    ]

    _, down_s = _timed("services", "down", cwd=workspace)
    assert not (workspace / sv.ENV_FILE).exists()
    status, _ = _timed("services", "status", "--json", cwd=workspace)
    assert status.returncode == 3
    assert {p["state"] for p in json.loads(status.stdout)["parts"]} == {"down"}
    assert all(sv.port_free(port) for port in profile.ports.values())

    _, restart_s = _timed("services", "up", cwd=workspace)
    assert _flow_run_in_postgres(profile, flow_run_id) == "COMPLETED"
    assert sv.prefect_api(profile, f"flow_runs/{flow_run_id}")["state_type"] == "COMPLETED"
    assert _mlflow_run(profile, flow_run_id)[1] == ["hello.txt"]
    print(f"up {up_s:.1f} s, up again {again_s:.1f} s, down {down_s:.1f} s, up {restart_s:.1f} s")
