"""bench.student_switches: the expert's own rollouts make no error against its labels, and a
student that is not the expert does; the expert's mode is the one it acts in."""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import torch

from bench.student_switches import episode_rows, summary
from pipelines.contract.params import load_params
from pipelines.training.policy import Policy, PolicyConfig, PolicyNet
from refcell.cell import Cell, TrueState
from refcell.expert import Expert, push_frame
from refcell.world import load_world


def _state(pusher) -> TrueState:
    return TrueState(
        pusher=np.array(pusher),
        pusher_velocity=np.zeros(2),
        part=np.array([0.0, 0.0]),
        part_yaw=0.0,
        part_velocity=np.zeros(2),
        target=np.array([0.2, 0.0]),
        part_size_m=0.015,
    )


def test_the_expert_pushes_from_behind_the_part_and_goes_around_from_beside_it():
    behind, beside = _state([-0.03, 0.0]), _state([0.0, 0.05])
    assert push_frame(behind).pushing and not push_frame(beside).pushing
    assert Expert().act(behind)[0] > 0.9  # pushing: flat out toward the target, along +x
    assert Expert().act(beside)[0] < 0.0  # beside: back to the staging point behind the part


def test_against_its_own_labels_the_expert_errs_nowhere_and_an_untrained_student_does():
    params = load_params("params.yaml")
    cell = Cell(load_world("cell-07"), params.cell)
    args = Namespace(episodes=3, seed=90101)
    expert = summary(episode_rows(Expert(), cell, args))
    assert expert["mean_error_away"] == 0.0 and expert["switches_per_success"] >= 1
    torch.manual_seed(0)
    untrained = Policy(PolicyNet(PolicyConfig(hidden=[8])))
    student = summary(episode_rows(untrained, cell, args))
    assert student["mean_error_away"] > 0.1 and student["success_rate"] < expert["success_rate"]
