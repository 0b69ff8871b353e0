"""The sim's side of fine-tuning on success (refcell.pretrain.SimEpisodes, reinforce_in_sim):
what an episode pays, and the pretrain that ends with it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipelines.contract.params import ReinforceParams
from pipelines.training import save_policy
from refcell.cell import Cell
from refcell.expert import Expert
from refcell.pretrain import SimEpisodes, pretrain_with_observations
from refcell.world import load_world
from tests.conftest import TINY_REINFORCE

FEW = ReinforceParams(**TINY_REINFORCE)


def distance(cell: Cell) -> float:
    state = cell.true_state()
    return float(np.linalg.norm(state.part - state.target))


def test_an_episode_pays_for_progress_and_for_placing(params, tiny_pretrain):
    cell = Cell(load_world("sim"), params.cell)
    episodes, expert = SimEpisodes(cell, tiny_pretrain), Expert()
    episodes.start(5)
    start, paid, step = distance(cell), 0.0, None
    while step is None or not step.done:
        step = episodes.step(expert.act(cell.true_state()))
        paid += step.reward
        assert episodes.elapsed == cell.step_index / params.cell.max_steps
    assert step.success
    progress = SimEpisodes.PROGRESS_PER_M * (start - distance(cell))
    assert paid == pytest.approx(progress + SimEpisodes.PLACED)


def test_each_episode_is_its_own_draw_of_the_randomized_sim(params, tiny_pretrain):
    cell = Cell(load_world("sim"), params.cell)
    episodes = SimEpisodes(cell, tiny_pretrain)
    episodes.start(0)
    first = cell.episode_world.physics
    episodes.start(1)
    assert cell.episode_world.physics != first
    episodes.start(0)
    assert cell.episode_world.physics == first  # the same index, the same draw


def test_the_pretrain_ends_with_the_fine_tune_on_success(tmp_path, params, tiny_pretrain):
    sim = load_world("sim")
    imitation, _ = pretrain_with_observations(sim, params.cell, tiny_pretrain)
    paid, _ = pretrain_with_observations(
        sim, params.cell, dataclasses.replace(tiny_pretrain, reinforce=FEW)
    )
    assert paid.config.trained_on["reinforce"]["iterations"] == 2
    assert paid.config.trained_on["reinforce"]["episodes"] == 4
    assert "reinforce" not in imitation.config.trained_on
    moved = [
        not torch.equal(a, b)
        for a, b in zip(imitation.parameters(), paid.parameters(), strict=True)
    ]
    assert any(moved)
    save_policy(paid, tmp_path / "paid")  # its provenance is plain JSON
