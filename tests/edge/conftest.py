"""Shared fixtures for the edge tests: signing keys, fake signed releases, an enrolled box, the
CLI (the S3 server fixtures are in tests/conftest.py: the cell tests use them too)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edge.cli import main
from tests.edge.signed import enrolled, publish_signed

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
def keys(tmp_path: Path) -> Path:
    return tmp_path / "keys"


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    return tmp_path / "box"


@pytest.fixture
def cell() -> str:
    return "cell-7"


def fake_policy(folder: Path, version: int) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(f"weights-v{version}".encode() * 100)
    (folder / "config.json").write_text(json.dumps({"hidden": [64, 64], "version": version}))
    return {name: folder / name for name in ("model.safetensors", "config.json")}


@pytest.fixture
def publish(tmp_path: Path, cell: str, keys: Path) -> Publish:
    """publish(channel, version, decision=None, attestation=None, cell=...): a signed release
    of a fake policy whose bytes depend on version (gated, with a passing attestation)."""

    def _publish(channel: str, version: int, decision=None, attestation=None, cell=cell):
        files = fake_policy(tmp_path / f"source-v{version}", version)
        metadata = {
            "model_name": "pusher-policy",
            "model_version": version,
            "dataset_version": f"data-{version}",
            "mlflow_run_id": f"run{version}",
        }
        return publish_signed(channel, keys, cell, files, metadata, decision, attestation)

    return _publish


@pytest.fixture
def enroll_box(keys: Path, cell: str) -> Callable[[str, Path], Path]:
    """enroll_box(channel, box): the box enrolled for the cell with the keys' root.json."""
    return lambda channel, box: enrolled(channel, keys, cell, box)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    """Run realloop-edge in-process (fast): cli("status", "--box", d) -> CliResult."""

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
