"""Shared fixtures for the edge tests: fake bundles, the CLI, signing keys, a real S3 server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edge.channels import generate_keypair, publish_bundle
from edge.cli import main

Publish = Callable[..., dict[str, Any]]
RunCli = Callable[..., "CliResult"]


class CliResult:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def json(self) -> dict[str, Any]:
        return json.loads(self.stdout)

    def expect_error(self, *fragments: str) -> str:
        """Assert the command failed with one `realloop-edge: ...` line naming all fragments."""
        assert self.code != 0, self.stdout
        assert "Traceback" not in self.stderr
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, self.stderr
        assert lines[0].startswith("realloop-edge: ")
        for fragment in fragments:
            assert fragment in lines[0], lines[0]
        return lines[0]


@pytest.fixture
def channel(tmp_path: Path) -> str:
    return str(tmp_path / "channel")


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    return tmp_path / "box"


@pytest.fixture
def cell() -> str:
    return "cell-7"


@pytest.fixture
def publish(tmp_path: Path, cell: str) -> Publish:
    """publish(channel, version, signing_key=None): a fake bundle whose bytes depend on version."""

    def _publish(channel: str, version: int, signing_key: Path | None = None) -> dict[str, Any]:
        source = tmp_path / f"source-v{version}"
        source.mkdir(exist_ok=True)
        (source / "model.safetensors").write_bytes(f"weights-v{version}".encode() * 100)
        (source / "config.json").write_text(json.dumps({"hidden": [64, 64], "version": version}))
        metadata = {
            "model_name": "pusher-policy",
            "model_version": version,
            "dataset_version": f"data-{version}",
            "mlflow_run_id": f"run{version}",
            "gate": {"passed": True, "success_rate": 0.9},
        }
        files = {name: source / name for name in ("model.safetensors", "config.json")}
        return publish_bundle(channel, cell, files, metadata, signing_key=signing_key)

    return _publish


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    """Run realloop-edge in-process (fast): cli("status", "--dest", d) -> CliResult."""

    def _run(*args: str | Path) -> CliResult:
        code = main([str(arg) for arg in args])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return _run


@pytest.fixture
def cli_process() -> RunCli:
    """Run realloop-edge as a real subprocess, as the edge box's systemd unit would."""

    def _run(*args: str | Path) -> CliResult:
        command = [sys.executable, "-m", "edge.cli", *map(str, args)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        return CliResult(done.returncode, done.stdout, done.stderr)

    return _run


@pytest.fixture
def keypair(tmp_path: Path) -> tuple[Path, Path]:
    private, public = tmp_path / "signing.pem", tmp_path / "signing.pub.pem"
    generate_keypair(private, public)
    return private, public


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
