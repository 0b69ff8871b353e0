"""Fixtures for the tests of `realloop cell run` (refcell.process): small policies published
on a folder channel, and logs recorded in place as the cell process records them."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from refcell.cell import Cell
from refcell.recorder import CellIdentity, ShiftRecorder
from refcell.runner import run_episode
from refcell.world import load_world
from tests.edge.signed import publish_override

START = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)


class Shover:
    """Drives at the part and keeps going: the part nears the edge, so every episode leaves a
    capture (near_failure) behind."""

    name = "shover-0"

    def act(self, obs):
        direction = obs[4:6] - obs[0:2]
        return direction / max(np.linalg.norm(direction), 1e-6)


@pytest.fixture(scope="session")
def policy_folder(tmp_path_factory) -> Path:
    """A small untrained policy, saved the way the pipeline saves one."""
    import torch

    from pipelines.training import PolicyConfig, PolicyNet, save_policy

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("policy") / "tiny"
    return save_policy(PolicyNet(PolicyConfig(hidden=[16], version="tiny-0")), folder)


def policy_files(folder: Path) -> dict[str, Path]:
    return {name: folder / name for name in ("model.safetensors", "config.json")}


def publish_policy(channel: Path | str, cell_id: str, folder: Path, version: int) -> dict:
    return publish_override(
        str(channel),
        cell_id,
        policy_files(folder),
        {"model_name": "pusher-policy", "model_version": version},
    )


def recorder_in_place(params, folder: Path, **kwargs) -> ShiftRecorder:
    record = dataclasses.replace(params.record, **kwargs)
    identity = CellIdentity.from_params(params.cell, "1-0123456789ab")
    return ShiftRecorder(folder, params.cell, record, identity, START, in_place=True)


def run_shover(params, recorder: ShiftRecorder, episodes: int) -> None:
    cell = Cell(load_world("line"), params.cell)
    for index in range(episodes):
        run_episode(cell, Shover(), 5, index, episodes, observers=(recorder,))
