from __future__ import annotations

import dataclasses
import subprocess
import sys
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


@pytest.fixture(scope="session")
def tiny_pretrain(params):
    """Pretraining small enough for unit tests (seconds, not minutes)."""
    return dataclasses.replace(
        params.pretrain, demo_episodes=8, dagger_rounds=1, dagger_episodes=4, epochs=2
    )


def realloop(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run the `realloop` command line as users do, in `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
