"""Sim pretraining: behaviour cloning from the expert, then DAgger rounds, all in a
domain-randomized sim. The result is the sim policy the line will humble."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge.runtime import stacked_inputs
from pipelines.contract.params import CellParams, PretrainParams
from pipelines.training import EpochMetrics, Policy, PolicyConfig, PolicyNet, fit, seed_everything
from pipelines.training.reinforce import Step, fine_tune_on_success
from refcell.cell import Cell
from refcell.expert import Expert
from refcell.runner import Controller, StepRecord, run_episode
from refcell.world import World, randomized

Progress = Callable[[str, int, int], None]  # (phase, done, total)


def collect_labelled(
    cell: Cell,
    controller: Controller,
    params: PretrainParams,
    first_episode: int,
    episodes: int,
    progress: Progress | None = None,
    phase: str = "",
) -> tuple[np.ndarray, np.ndarray, float]:
    """Run `controller` in randomized sim; label every visited state with the expert. The
    observations come stacked `params.history` frames deep, as the student will see them."""
    observations, labels, successes = [], [], 0

    def keep(_cell: Cell, record: StepRecord) -> None:
        episode.append(record.observation)
        labels.append(record.expert)

    for offset in range(episodes):
        episode: list[np.ndarray] = []
        index = first_episode + offset
        world = randomized(
            cell.world, params.randomization, np.random.default_rng([params.seed, index])
        )
        result = run_episode(
            cell,
            controller,
            params.seed,
            index,
            episodes,
            world=world,
            observers=(keep,),
            label_with_expert=True,
        )
        successes += result.success
        observations.append(stacked_inputs(np.stack(episode), params.history))
        if progress:
            progress(phase, offset + 1, episodes)
    return np.concatenate(observations), np.stack(labels), successes / max(episodes, 1)


def pretrain(*args, **kwargs) -> PolicyNet:
    """The sim-pretrained policy alone: `pretrain_with_observations` without the observations."""
    net, _ = pretrain_with_observations(*args, **kwargs)
    return net


def pretrain_with_observations(
    sim_world: World,
    cell_params: CellParams,
    params: PretrainParams,
    progress: Progress | None = None,
    on_epoch: Callable[[EpochMetrics], None] | None = None,
    version: str = "sim-0",
    trained_on: dict | None = None,
) -> tuple[PolicyNet, np.ndarray]:
    """Behaviour cloning plus DAgger in the sim, and the observations it trained on (the edge
    export's parity check and OOD statistics: pipelines.training.onnx_export). `sim_world` may
    be the plain sim or a calibrated one (refcell.world.calibrated_world)."""
    seed_everything(params.seed)
    net = PolicyNet(
        PolicyConfig(
            hidden=list(params.hidden),
            history=params.history,
            output_gain=params.output_gain,
            ensemble=params.ensemble,
            version=version,
            trained_on={
                "world": "sim",
                "seed": params.seed,
                **(trained_on or {}),
                "part_footprints_m": part_footprints(sim_world),
            },
        )
    )
    cell = Cell(sim_world, cell_params)
    obs, labels, _ = collect_labelled(
        cell, Expert(), params, 0, params.demo_episodes, progress, "expert demos"
    )
    train = dict(
        batch_size=params.batch_size,
        learning_rate=params.learning_rate,
        learning_rate_schedule=params.learning_rate_schedule,
        seed=params.seed,
    )
    fit(net, obs, labels, epochs=params.epochs, on_epoch=on_epoch, **train)
    round_, rate = 0, 0.0
    while _another_round(params, round_, rate):
        first = params.demo_episodes + round_ * params.dagger_episodes
        new_obs, new_labels, rate = collect_labelled(
            cell,
            Policy(net),
            params,
            first,
            params.dagger_episodes,
            progress,
            f"dagger {round_ + 1}/{max(params.dagger_rounds, round_ + 1)}",
        )
        obs, labels = np.concatenate([obs, new_obs]), np.concatenate([labels, new_labels])
        net.config.trained_on[f"dagger_{round_ + 1}_success"] = rate
        fit(net, obs, labels, epochs=max(params.epochs // 2, 1), on_epoch=on_epoch, **train)
        round_ += 1
    net.config.trained_on["samples"] = len(obs)
    if params.reinforce and params.reinforce.iterations:
        after_imitation = params.demo_episodes + round_ * params.dagger_episodes
        reinforce_in_sim(net, cell, params, after_imitation, progress)
    return net, obs


def reinforce_in_sim(
    net: PolicyNet,
    cell: Cell,
    params: PretrainParams,
    first_episode: int,
    progress: Progress | None,
) -> None:
    """Fine-tune the imitation student on its own success in `cell`'s randomized sim, on
    episodes after the ones imitation used; what it did goes into the policy's provenance."""
    settings = params.reinforce
    lanes = [SimEpisodes(Cell(cell.world, cell.params), params) for _ in range(settings.lanes)]
    outcome = fine_tune_on_success(net, lanes, settings, params.seed, first_episode, progress)
    net.config.trained_on["reinforce"] = {
        "iterations": settings.iterations,
        "episodes": outcome["episodes"],
        "placed_while_exploring": round(outcome["placed_while_exploring"][-1], 3),
    }


class SimEpisodes:
    """The randomized sim's episodes as reinforce.Episodes. The reward: the part's progress
    toward the target (potential-based shaping, so it changes no optimum, only how soon the
    student hears of one), one for placing it, minus one for losing it or a safety stop; a
    timeout earns nothing more, so with discounting a later placement is worth less."""

    PROGRESS_PER_M = 10.0
    PLACED, LOST = 1.0, -1.0

    def __init__(self, cell: Cell, params: PretrainParams):
        self.cell, self.params = cell, params

    def start(self, index: int) -> np.ndarray:
        draw = np.random.default_rng([self.params.seed, index])
        world = randomized(self.cell.world, self.params.randomization, draw)
        self.cell.reset(self.params.seed, index, self.params.dagger_episodes, world=world)
        self.distance = self._distance()
        return self.cell.observation()

    def step(self, command: np.ndarray) -> Step:
        result = self.cell.step(command)
        distance = self._distance()
        reward = self.PROGRESS_PER_M * (self.distance - distance)
        self.distance = distance
        lost = result.done and result.failure not in (None, "timeout")  # or a safety stop
        reward += self.PLACED if result.success else self.LOST if lost else 0.0
        return Step(self.cell.observation(), reward, result.done, result.success)

    @property
    def elapsed(self) -> float:
        return self.cell.step_index / self.cell.params.max_steps

    def _distance(self) -> float:
        state = self.cell.true_state()
        return float(np.linalg.norm(state.part - state.target))


def part_footprints(world: World) -> list[float]:
    """The footprints (m) of the parts `world` draws: the edge box's part screen
    (pipelines.training.ood) hands any other part to the fallback."""
    return sorted({round(2 * part.size_m, 4) for part in world.parts})


def _another_round(params: PretrainParams, done: int, success: float) -> bool:
    """`dagger_rounds` always; then, up to `dagger_max_rounds`, while the student's success
    in its own sim (the last round's) is below `dagger_target_success`."""
    if done < params.dagger_rounds:
        return True
    return done < params.dagger_max_rounds and success < params.dagger_target_success


def calibrated_setup(
    params: PretrainParams, calibration: str | Path
) -> tuple[World, PretrainParams, dict]:
    """(world, pretrain params, policy identity) for pretraining in the sim a calibration file
    describes: its estimates in the sim, its randomization ranges, its own delay distribution."""
    import dataclasses

    from pipelines.contract.params import RandomizationParams
    from pipelines.ingest import sha256_file
    from refcell.world import calibrated_world

    world, ranges = calibrated_world(calibration)
    merged = {**dataclasses.asdict(params.randomization), **ranges, "latency_steps": None}
    randomization = RandomizationParams(**merged)
    identity = {
        "version": "sim-cal-0",
        "trained_on": {"world": "calibrated sim", "calibration": sha256_file(calibration)},
    }
    return world, dataclasses.replace(params, randomization=randomization), identity


def pretrain_in_calibrated_sim(
    calibration: Path, cell_params: CellParams, params: PretrainParams, version: str
) -> tuple[PolicyNet, np.ndarray]:
    """params `simulator.pretrain` (pipelines.release.prescreen.SimPretrain): the loop's
    calibrated candidate."""
    world, calibrated, identity = calibrated_setup(params, calibration)
    return pretrain_with_observations(
        world, cell_params, calibrated, version=version, trained_on=identity["trained_on"]
    )


def success_in_calibrated_sim(
    policy: Path, calibration: Path, cell_params: CellParams, episodes: int, seed: int
) -> float:
    """params `simulator.evaluate` (pipelines.release.prescreen.SimEvaluate): the share of
    `episodes` placed in the calibrated sim, the same episodes for the same seed."""
    from pipelines.training import load_policy
    from refcell.runner import run_episodes, summarize
    from refcell.world import calibrated_world

    world, _ = calibrated_world(calibration)
    results = list(run_episodes(world, cell_params, load_policy(policy), episodes, seed))
    return summarize(results)["success_rate"]
