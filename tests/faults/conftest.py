"""The fault suite's production profile: one `realloop services up` (PostgreSQL, the S3 store,
the Prefect and MLflow servers, two process workers) on free loopback ports in a fresh
workspace, shared by the suite's tests; each fault test takes a part down and brings it back
with `realloop services up`, as an operator would, and leaves the profile whole.

REALLOOP_FAULTS_WORKSPACE names a workspace whose profile is already up (kept afterwards): the
suite then skips its own `up` and `down`, for quick runs while working on one fault.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from flows import services as sv
from tests.conftest import realloop, without_prefect_settings
from tests.flows.test_services import _flow_run_in_postgres  # noqa: F401 - the tests' helper

# Heartbeats from every flow run the workers start: what lets the server tell a flow run whose
# worker was killed (a zombie) from one that is still running (tests/faults/test_worker_killed.py).
HEARTBEAT_S = "31"  # Prefect's lowest accepted value is 30
EPOCHS = 23  # flushed to MLflow as 10 + 10 + 3 (EpochLogger's flush_every=10)


@pytest.fixture(scope="session")
def profile():
    """The running profile; brought up once, down at the end of the session."""
    kept = os.environ.get("REALLOOP_FAULTS_WORKSPACE")
    workspace = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="realloop-faults-"))
    workspace.chmod(0o755)  # the postgres user must enter it (pytest's tmp_path is private)
    heartbeat = os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", HEARTBEAT_S)
    ports = ["--postgres-port", "0", "--s3-port", "0", "--prefect-port", "0", "--mlflow-port", "0"]
    up = realloop("services", "up", "--json", *([] if kept else ports), cwd=workspace)
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["all_up"], up.stdout
    try:
        yield sv.load_profile(workspace)
    finally:
        if not kept:
            realloop("services", "down", cwd=workspace)
            shutil.rmtree(workspace, ignore_errors=True)
        if heartbeat == HEARTBEAT_S:
            os.environ.pop("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)  # ours, not the user's


def bring_back(profile: sv.Profile) -> float:
    """`realloop services up`: starts what is down, as an operator does; its seconds."""
    started = time.monotonic()
    up = realloop("services", "up", "--json", cwd=profile.workspace)
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["all_up"], up.stdout
    return time.monotonic() - started


def client_env(profile: sv.Profile) -> dict[str, str]:
    """The environment of a realloop command in the profile's workspace."""
    return without_prefect_settings() | profile.client_env()


@pytest.fixture
def in_profile(profile, monkeypatch):
    """This process as a client of the profile (boto3, MLflow), restored after the test."""
    for name, value in profile.client_env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return profile


def train_and_register(params, workspace: Path, cell_id: str, seed: int, after_epoch=None):
    """A fine-tuning run recorded as the retrain stage records it (tests/pipelines/
    test_tracking.py's `trained`), its policy registered; (run id, version, policy folder).
    `after_epoch(epoch)` runs after each epoch is handed to the logger (a fault's moment)."""
    from pipelines.training import register_policy
    from pipelines.training.tracking import EpochLogger, log_learning_curve, start_finetune_run
    from pipelines.training.train import EpochMetrics
    from tests.pipelines.test_tracking import DATASET_VERSION, PROFILE, tiny_policy

    folder = workspace / "models" / cell_id / f"seed-{seed}"
    tiny_policy(folder, seed)
    history = [EpochMetrics(e, 1.0 / (e + 1), 1.5 / (e + 1)) for e in range(EPOCHS)]
    train = params.train
    with start_finetune_run(
        workspace, train.experiment, train, DATASET_VERSION, "data/dataset", PROFILE,
        run_name=f"finetune {cell_id}", cell_id=cell_id,
    ) as run:  # fmt: skip
        with EpochLogger(run.info.run_id, flush_every=10) as logger:
            for metrics in history:
                logger(metrics)
                if after_epoch is not None:
                    after_epoch(metrics.epoch)
        log_learning_curve(history)
        version = register_policy(
            run.info.run_id, folder, train.registered_model, {"cell_id": cell_id}
        )
    return run.info.run_id, version, folder


DEPLOY = """
import sys
from prefect import flow
flow.from_source(source=sys.argv[1], entrypoint=sys.argv[2]).deploy(
    name=sys.argv[3], work_pool_name=sys.argv[4], print_next_steps=False, ignore_warnings=True
)
"""


def deploy_fault_flow(profile: sv.Profile, name: str) -> str:
    """tests/faults/fault_flows.py:steps deployed on the pool as `fault-steps/<name>`, from a
    copy in the workspace (the workers' source); its deployment id."""
    import subprocess
    import sys

    source = profile.workspace / "fault-flows"
    source.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).with_name("fault_flows.py"), source / "fault_flows.py")
    done = subprocess.run(
        [sys.executable, "-c", DEPLOY, str(source), "fault_flows.py:steps", name, sv.WORK_POOL],
        cwd=profile.workspace, env=client_env(profile), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return sv.prefect_api(profile, f"deployments/name/fault-steps/{name}")["id"]


def start_run(profile: sv.Profile, deployment_id: str, **parameters) -> str:
    run = sv.prefect_api(
        profile, f"deployments/{deployment_id}/create_flow_run", {"parameters": parameters}
    )
    return run["id"]


def wait_for_state(profile: sv.Profile, flow_run_id: str, states: set[str], timeout_s: float):
    """Poll the server until the flow run is in one of `states`; the run as the API says."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            run = sv.prefect_api(profile, f"flow_runs/{flow_run_id}")
            if run["state_type"] in states:
                return run
        except OSError:
            run = None  # the server is restarting: ask again
        assert time.monotonic() < deadline, f"flow run {flow_run_id}: {run and run['state_type']}"
        time.sleep(1)


def step_lines(out: Path) -> list[dict]:
    log = out / "steps.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
