"""Shared fixtures for the edge tests: fake bundles, the CLI, signing keys (the S3 server
fixtures are in tests/conftest.py: the cell tests use them too)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
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
