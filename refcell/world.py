"""World parameters: how `sim` and `line` differ, and the per-episode draws from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml
from pydantic import ConfigDict, TypeAdapter
from pydantic.dataclasses import dataclass

from pipelines.contract.params import read_yaml, validated

WORLDS_DIR = Path(__file__).parent / "worlds"
# `sim`, `line` and one line file per reference cell (cell-07, ...): every file shipped here.
WORLD_NAMES = tuple(sorted(path.stem for path in WORLDS_DIR.glob("*.yaml")))
_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class Physics:
    friction: float
    part_mass_kg: float
    joint_damping: float


@dataclass(frozen=True, config=_STRICT)
class Sensors:
    joint_position_noise_m: float
    joint_velocity_noise_mps: float


@dataclass(frozen=True, config=_STRICT)
class Perception:
    pose_noise_m: float
    yaw_noise_rad: float
    bias_x_m: float
    bias_y_m: float
    bias_drift_x_m: float
    bias_drift_y_m: float
    confidence_base: float
    confidence_drop: float
    confidence_noise: float


@dataclass(frozen=True, config=_STRICT)
class Lighting:
    amplitude: float


@dataclass(frozen=True, config=_STRICT)
class Latency:
    steps: dict[int, float]
    load_extra_steps: int
    load_fraction: float


@dataclass(frozen=True, config=_STRICT)
class PartVariant:
    name: str
    shape: str  # "cylinder" (size = radius) or "box" (size = half side)
    size_m: float
    mass_scale: float
    probability: float


@dataclass(frozen=True, config=_STRICT)
class World:
    physics: Physics
    sensors: Sensors
    perception: Perception
    lighting: Lighting
    latency: Latency
    parts: tuple[PartVariant, ...]


def load_world(name_or_path: str | Path) -> World:
    """Load a shipped world by name (`sim`, `line`, `cell-07`, ...) or a world YAML file, as it
    is on the line's first day (its `timeline:` of later events: refcell.timeline)."""
    raw = read_world_file(name_or_path)
    raw.pop("timeline", None)
    return TypeAdapter(World).validate_python(raw)


def read_world_file(name_or_path: str | Path) -> dict:
    path = (
        WORLDS_DIR / f"{name_or_path}.yaml" if name_or_path in WORLD_NAMES else Path(name_or_path)
    )
    return dict(yaml.safe_load(path.read_text()))


def world_as_dict(world: World) -> dict:
    return dataclasses.asdict(world)


def sim_world() -> dict:
    """The sim as calibration starts from it: the simulator plug-in's `world`
    (params.yaml `simulator.world`, docs/calibration.md)."""
    return world_as_dict(load_world("sim"))


def calibrated_world(calibration_path: str | Path, base: str = "sim") -> tuple[World, dict]:
    """The sim with a calibration's estimates in place (sim-calibration.yaml, written by
    `realloop calibrate`), and the calibration's domain-randomization ranges."""
    path = Path(calibration_path)
    raw = read_yaml(path, "run `realloop calibrate` first")
    if not isinstance(raw, dict) or not isinstance(raw.get("world"), dict):
        raise ValueError(f"{path}: no `world:` section; is this a realloop calibration file?")
    merged = world_as_dict(load_world(base))
    for section, values in raw["world"].items():
        if section == "parts" and isinstance(values, list):  # the logs' mix replaces the sim's
            merged["parts"] = values
            continue
        if section not in merged or not isinstance(values, dict):
            raise ValueError(f"{path}: world.{section}: not a section of a world file")
        merged[section].update(values)
    world = validated(World, merged, path, where="world.")
    return world, dict(raw.get("randomization") or {})


@dataclasses.dataclass(frozen=True)
class ShiftConditions:
    """What changes over a shift: lighting drifts, load comes and goes."""

    lighting: float  # 0 = as calibrated, 1 = worst drift
    under_load: bool


def shift_conditions(world: World, episode_index: int, shift_episodes: int) -> ShiftConditions:
    """Lighting rises and falls once over a shift; load arrives for a block after a quarter."""
    phase = (episode_index % shift_episodes) / max(shift_episodes, 1)
    lighting = world.lighting.amplitude * 0.5 * (1.0 - np.cos(2.0 * np.pi * phase))
    under_load = 0.25 <= phase < 0.25 + world.latency.load_fraction
    return ShiftConditions(lighting=float(lighting), under_load=under_load)


def draw_part(world: World, rng: np.random.Generator) -> PartVariant:
    weights = np.array([p.probability for p in world.parts], dtype=float)
    return world.parts[int(rng.choice(len(world.parts), p=weights / weights.sum()))]


def latency_sampler(latency: Latency) -> Callable[[ShiftConditions, np.random.Generator], int]:
    """A command's delay in steps, drawn from `latency` (plus its extra steps under load), with
    the distribution's table built once: a cell draws a delay every step. The draw is the one
    `Generator.choice(n, p=...)` makes, one uniform number against the normalized cumulative
    distribution, so a stream gives the same delays as it did through `choice`."""
    steps = [int(s) for s in latency.steps]
    probs = np.array([latency.steps[s] for s in latency.steps], dtype=float)
    cdf = (probs / probs.sum()).cumsum()
    cdf /= cdf[-1]
    extra = latency.load_extra_steps

    def draw(conditions: ShiftConditions, rng: np.random.Generator) -> int:
        delay = steps[int(cdf.searchsorted(rng.random(), side="right"))]
        return delay + (extra if conditions.under_load else 0)

    return draw


def randomized(world: World, ranges, rng: np.random.Generator) -> World:
    """A domain-randomized copy of `world`: each range in `ranges` redrawn uniformly."""
    lo_hi = lambda key: getattr(ranges, key)  # noqa: E731
    physics = dataclasses.replace(
        world.physics,
        friction=float(rng.uniform(*lo_hi("friction"))),
        part_mass_kg=float(rng.uniform(*lo_hi("part_mass_kg"))),
        joint_damping=float(rng.uniform(*lo_hi("joint_damping"))),
    )
    perception = dataclasses.replace(
        world.perception, pose_noise_m=float(rng.uniform(*lo_hi("pose_noise_m")))
    )
    if lo_hi("latency_steps") is None:  # keep the world's own delay distribution
        return dataclasses.replace(world, physics=physics, perception=perception)
    low, high = lo_hi("latency_steps")
    latency = dataclasses.replace(world.latency, steps={int(rng.integers(low, high + 1)): 1.0})
    return dataclasses.replace(world, physics=physics, perception=perception, latency=latency)
