"""Calibration end to end: logs in, a world file's worth of estimates out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipelines.calibrate import latency as latency_fit
from pipelines.calibrate import sensing
from pipelines.calibrate.logs import LoggedEpisode, logged_episodes
from pipelines.calibrate.parts import PartGroup, fit_part_mix
from pipelines.calibrate.physics import PhysicsFit, Simulator, fit_physics
from pipelines.calibrate.sensing import Estimate
from pipelines.contract.params import CalibrateParams, CellParams

Progress = Callable[[str, int, int], None]
STAGES = ("latency", "sensors", "perception", "physics", "parts")


@dataclass(frozen=True)
class Calibration:
    world: dict  # physics, sensors, perception, lighting, latency, parts: a world file's keys
    uncertainty: dict  # the same keys: standard error of each estimate
    identified: dict[str, bool]  # dotted key -> whether the logs pin it down
    derived: dict  # combinations the logs do identify, when their parts are not
    randomization: dict  # domain-randomization ranges to pretrain with
    fit: dict = field(default_factory=dict)  # diagnostics: sizes, servo, profiles

    def as_dict(self) -> dict:
        return {
            "world": self.world,
            "uncertainty": self.uncertainty,
            "identified": self.identified,
            "derived": self.derived,
            "randomization": self.randomization,
            "fit": self.fit,
        }


def calibrate(
    episodes: pa.Table,
    steps: pa.Table,
    simulator: Simulator,
    sim_world: Mapping,
    cell: CellParams,
    params: CalibrateParams,
    progress: Progress | None = None,
) -> tuple[Calibration, dict]:
    """Fit the line from its logs; also return the intermediate fits the plots draw on."""
    tick = progress or (lambda *_: None)
    logs = _most_recent(logged_episodes(episodes, steps), params.episodes, params.min_episodes)
    if len(logs) < params.min_episodes:
        raise ValueError(
            f"{len(logs)} line episodes in the newest whole shifts (calibrate.episodes "
            f"{params.episodes}); calibration needs at least {params.min_episodes}: "
            "record and ingest more (realloop ingest)"
        )
    radius = simulator.pusher_radius_m
    free = [sensing.clear_of_part(e, radius) for e in logs]
    tick("latency", 0, len(STAGES))
    transitions = latency_fit.transitions(logs, cell.max_speed_mps, free)
    latency = latency_fit.fit_latency(transitions, [e.episode_id for e in logs])
    tick("sensors", 1, len(STAGES))
    sensors = sensing.joint_noise(logs, latency, free, cell.max_speed_mps, cell.dt)
    tick("perception", 2, len(STAGES))
    perception = {
        **sensing.perception_noise(logs, radius),
        **sensing.confidence_model(logs),
        **sensing.camera_bias(logs, radius),
    }
    tick("physics", 3, len(STAGES))
    noise = (sensors["joint_velocity_noise_mps"].value, perception["pose_noise_m"].value)
    physics = fit_physics(
        simulator, logs, latency, perception, noise, sim_world["physics"], cell.max_speed_mps
    )
    tick("parts", 4, len(STAGES))
    fitted = {k: e.value for k, e in physics.estimates.items()}
    parts = fit_part_mix(
        simulator,
        logs,
        latency.ages_by_episode,
        perception,
        fitted,
        noise,
        cell.max_speed_mps,
        yaw_noise=perception["yaw_noise_rad"].value,
    )
    tick("done", 5, len(STAGES))
    calibration = _assemble(logs, latency, sensors, perception, physics, parts, params)
    return calibration, {"logs": logs, "latency": latency, "perception": perception}


def _most_recent(logs: list[LoggedEpisode], limit: int, minimum: int = 0) -> list[LoggedEpisode]:
    """Whole shifts, newest first, while they fit in `limit` episodes: load and lighting
    follow the shift's clock, so a partial shift would skew their estimates. Below `minimum`
    (the newest shift still being recorded: 20 episodes so far) the next whole shift is taken
    even past `limit`. A newest shift larger than `limit` is thinned evenly over its clock."""
    if not limit or len(logs) <= limit:
        return logs
    shifts: dict[str, list[LoggedEpisode]] = {}
    for episode in logs:
        shifts.setdefault(episode.shift_id, []).append(episode)
    kept: list[LoggedEpisode] = []
    for shift_id in sorted(shifts, reverse=True):  # shift ids are UTC start times
        if len(kept) + len(shifts[shift_id]) > limit:
            if kept and len(kept) < minimum:
                kept = shifts[shift_id] + kept
            break
        kept = shifts[shift_id] + kept
    if not kept:
        newest = shifts[max(shifts)]
        kept = newest[:: -(-len(newest) // limit)]
    return kept


def _assemble(
    logs, latency, sensors, perception, physics: PhysicsFit, parts: list[PartGroup], params
) -> Calibration:
    perception_keys = (
        "pose_noise_m",
        "yaw_noise_rad",
        "bias_x_m",
        "bias_y_m",
        "bias_drift_x_m",
        "bias_drift_y_m",
        "confidence_base",
        "confidence_drop",
        "confidence_noise",
    )
    estimates = {
        "physics": physics.estimates,
        "sensors": sensors,
        "perception": {k: perception[k] for k in perception_keys},
    }
    world = {section: _values(e) for section, e in estimates.items()}
    world["lighting"] = {"amplitude": 1.0}  # the unit of lighting: see sensing's docstring
    world["latency"] = {
        "steps": latency.steps_dict(),
        "load_extra_steps": latency.load_extra_steps,
        "load_fraction": round(latency.load_fraction, 3),
    }
    uncertainty = {section: _stds(e) for section, e in estimates.items()}
    uncertainty["latency"] = {"mean_delay_steps": _mean_delay_std(latency)}
    identified = {f"physics.{k}": v for k, v in physics.identified.items()}
    identified["lighting.amplitude"] = False
    if parts:  # the mix the logs show replaces the sim's one part
        world["parts"] = [group.as_world_part() for group in parts]
        uncertainty["parts"] = {group.name: group.uncertainty() for group in parts}
        for group in parts[1:]:
            identified[f"parts.{group.name}.mass_scale"] = bool(np.isfinite(group.mass_scale.std))
    return Calibration(
        world=world,
        uncertainty=uncertainty,
        identified=identified,
        derived={"sliding_friction_force_n": physics.sliding_force.as_dict()},
        randomization=_randomization(estimates, physics, params),
        fit={
            "episodes": len(logs),
            "steps": int(sum(e.steps for e in logs)),
            "replay_windows": physics.windows,
            "part_episodes": {group.name: len(group.episodes) for group in parts},
            "servo": {"alpha": latency.alpha, "beta": latency.beta},
            "latency_log_likelihood": latency.log_likelihood,
            "profiles": physics.profiles,
        },
    )


def _values(estimates: Mapping[str, Estimate]) -> dict[str, float]:
    return {k: _round(e.value) for k, e in estimates.items()}


def _stds(estimates: Mapping[str, Estimate]) -> dict[str, float | None]:
    return {k: (_round(e.std) if np.isfinite(e.std) else None) for k, e in estimates.items()}


def _round(x: float) -> float:
    return float(f"{float(x):.4g}")


def _mean_delay_std(latency) -> float:
    """Standard error of the mean delay: the delay spread over the steps that inform it."""
    delays = np.arange(len(latency.delay_pmf))
    mean = (latency.delay_pmf * delays).sum()
    spread = np.sqrt((latency.delay_pmf * (delays - mean) ** 2).sum())
    informative = sum(len(a) for a in latency.applied_age)
    return _round(spread / np.sqrt(max(informative, 1)))


def _randomization(estimates, physics: PhysicsFit, params: CalibrateParams) -> dict:
    """Uniform ranges around each estimate: +- k standard errors, never narrower than a floor.
    Unidentified friction and mass act only through their product: randomize the friction
    by the product's uncertainty and hold the mass."""

    def around(estimate: Estimate, std: float) -> list[float]:
        half = max(params.randomization_sigmas * std, params.randomization_floor * estimate.value)
        return [_round(estimate.value - half), _round(estimate.value + half)]

    found = estimates["physics"]
    friction, mass, damping = found["friction"], found["part_mass_kg"], found["joint_damping"]
    pose_noise = estimates["perception"]["pose_noise_m"]
    ranges = {
        "joint_damping": around(damping, damping.std),
        "pose_noise_m": around(pose_noise, pose_noise.std),
    }
    if physics.identified["friction"]:
        ranges["friction"] = around(friction, friction.std)
        ranges["part_mass_kg"] = around(mass, mass.std)
    else:
        load = physics.sliding_force
        ranges["friction"] = around(friction, friction.value * load.std / load.value)
        ranges["part_mass_kg"] = [_round(mass.value), _round(mass.value)]
    return ranges
