"""Ground truth for failure triage: why did a line episode really fail?

Only refcell can answer, by counterfactual: replay the same episode (same seeds, same
controller) with one line difference switched back to sim, and see which one rescues it.
"""

from __future__ import annotations

import dataclasses

from refcell.cell import Cell
from refcell.runner import Controller, EpisodeResult, Operator, run_episode
from refcell.world import World

FAILURE_CLASSES = ("perception", "control", "physics", "novel_part", "safety")


def counterfactual_worlds(line: World, sim: World) -> dict[str, World]:
    """The line with one failure class removed, in the order causes are credited."""
    R = dataclasses.replace
    return {
        "novel_part": R(line, parts=sim.parts),
        "perception": R(line, perception=sim.perception, lighting=sim.lighting),
        "control": R(
            line,
            latency=sim.latency,
            sensors=sim.sensors,
            physics=R(line.physics, joint_damping=sim.physics.joint_damping),
        ),
        "physics": R(line, physics=R(sim.physics, joint_damping=line.physics.joint_damping)),
    }


def true_failure_cause(
    cell: Cell,
    sim: World,
    controller: Controller,
    seed: int,
    result: EpisodeResult,
    shift_episodes: int,
    operator: Operator | None,
) -> str:
    """One of FAILURE_CLASSES for a failed episode."""
    if result.safety_stop:
        return "safety"
    best, best_distance = None, float("inf")
    for cause, world in counterfactual_worlds(cell.world, sim).items():
        if cause == "novel_part" and result.part_variant == sim.parts[0].name:
            continue
        replay = run_episode(
            cell, controller, seed, result.episode_index, shift_episodes, operator, world=world
        )
        if replay.success:
            return cause
        if replay.final_distance_m < best_distance:
            best, best_distance = cause, replay.final_distance_m
    return best or "control"
