"""`realloop serve` against a real Prefect server on loopback: deployments, schedules, a run."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

PREFECT = Path(sys.executable).with_name("prefect")
# The CLI layer itself, whether or not flows/cli.py has registered it yet.
SERVE_CODE = "import typer; from flows.serve_cli import serve_command; typer.run(serve_command)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return {**env, "DO_NOT_TRACK": "1", **extra}


@contextmanager
def started(args: list[str], log: Path, **kwargs):
    """A process in its own session, so teardown reaches whatever it spawned."""
    with log.open("w") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )
    try:
        yield process
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(timeout=20)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader (a flow run still exiting): stop what is left.
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def wait_until(check, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def write_params(tmp_path: Path) -> Path:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key in ("landing", "dataset", "quarantine"):
        raw["ingest"][key] = str(tmp_path / "data" / key)
    (tmp_path / "data" / "landing").mkdir(parents=True)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.slow  # a real serve process and an ingest run: ~40 s
@pytest.mark.timeout(300)
def test_serve_registers_schedules_and_runs_ingest(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipelines.contract.params import load_params

    params_path = write_params(tmp_path)
    params = load_params(params_path)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server_env = clean_env(PREFECT_HOME=str(tmp_path / "server-home"))
    server_args = [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server_args += ["--analytics-off", "--no-ui"]
    serve_env = clean_env(
        PREFECT_API_URL=api,
        PREFECT_HOME=str(tmp_path / "client-home"),
        PREFECT_RUNNER_POLL_FREQUENCY="2",  # pick up the triggered run quickly
    )
    serve_args = [sys.executable, "-c", SERVE_CODE, "--params", str(params_path)]

    with (
        started(server_args, tmp_path / "server.log", env=server_env, cwd=tmp_path) as server,
        temporary_settings({PREFECT_API_URL: api}),
    ):
        wait_until(lambda: healthy(api) or server.poll() is not None, 90, "the Prefect server")
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]

        serve_log = tmp_path / "serve.log"
        with started(serve_args, serve_log, env=serve_env, cwd=tmp_path) as serve:
            with get_client(sync_client=True) as client:

                def deployment(name: str):
                    assert serve.poll() is None, serve_log.read_text()[-3000:]
                    try:
                        return client.read_deployment_by_name(name)
                    except ObjectNotFound:  # not registered yet
                        return None

                ingest = wait_until(lambda: deployment("ingest/ingest"), 60, "deployments")
                loop = wait_until(lambda: deployment("retrain-loop/retrain-loop"), 10, "loop")

                (ingest_schedule,) = [s.schedule for s in ingest.schedules]
                assert ingest_schedule.interval.total_seconds() == (
                    params.ingest.schedule_interval_s
                )
                (loop_schedule,) = [s.schedule for s in loop.schedules]
                assert loop_schedule.cron == params.serve.loop_cron
                assert loop_schedule.timezone == params.serve.timezone
                for served in (ingest, loop):
                    assert served.parameters == {
                        "params_path": str(params_path),
                        "workspace": str(tmp_path),
                    }

                run = run_deployment("ingest/ingest", timeout=120, poll_interval=1)
                assert run.state is not None and run.state.is_completed(), (
                    f"{run.state}\n{serve_log.read_text()[-3000:]}"
                )

                def task_runs():
                    only_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
                    return client.read_task_runs(flow_run_filter=only_this_run)

                wait_until(task_runs, 20, "the ingest run's task runs")

            serve.send_signal(signal.SIGTERM)
            assert serve.wait(timeout=30) == 0, serve_log.read_text()[-3000:]

        output = serve_log.read_text()
        assert output.startswith("serving ingest every"), output[:500]
        assert "Traceback" not in output, output[-3000:]


def test_the_ingest_schedule_can_read_an_s3_prefix(params_path):
    from flows.serve import INGEST_DEPLOYMENT, LOOP_DEPLOYMENT, build_deployments

    deployments = {d.name: d for d in build_deployments(params_path, "s3://cell-logs/cell-07/")}
    assert deployments[INGEST_DEPLOYMENT].parameters["source"] == "s3://cell-logs/cell-07/"
    assert "source" not in deployments[LOOP_DEPLOYMENT].parameters
    default = {d.name: d for d in build_deployments(params_path)}
    assert "source" not in default[INGEST_DEPLOYMENT].parameters  # the landing folder
