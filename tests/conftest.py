from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipelines.contract.params import Params, load_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def params_path() -> Path:
    return ROOT / "params.yaml"


@pytest.fixture(scope="session")
def params(params_path) -> Params:
    return load_params(params_path)


# Fine-tuning on success small enough for unit tests: one iteration of the critic alone, one
# of the student, two episodes each (loop.pretrain_reinforce's keys).
TINY_REINFORCE = {
    "iterations": 2,
    "critic_warmup_iterations": 1,
    "episodes_per_iteration": 2,
    "exploration_std": 0.1,
    "anchor_weight": 0.3,
    "learning_rate": 3e-5,
}


@pytest.fixture(scope="session")
def tiny_pretrain(params):
    """Pretraining small enough for unit tests (seconds, not minutes)."""
    return dataclasses.replace(
        params.pretrain, demo_episodes=8, dagger_rounds=1, dagger_episodes=4, epochs=2
    )


def without_prefect_settings() -> dict[str, str]:
    """This process's environment without PREFECT_* settings: a child picks its own API
    (the ephemeral one, state in its workspace), not the test session's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}


def realloop(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run the `realloop` command line as users do, in `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible HTTP server (moto) on loopback, shared by the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request log in test output
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_endpoint: str) -> str:
    """Point boto3 at the loopback server with dummy credentials; no real AWS config leaks in."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REALLOOP_S3_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return s3_endpoint


@pytest.fixture
def s3_bucket(s3_env: str) -> str:
    """A fresh bucket per test on the shared server, so tests never see each other's objects."""
    import boto3

    name = f"realloop-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return name
