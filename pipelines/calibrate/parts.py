"""The line's part mix from its logs: which part sizes arrive, how often, how heavy.

The sim knows one part; a line runs several, and new variants arrive. A policy pretrained
on the sim's one part never pushes the others, so the calibrated sim takes the mix the logs
show:

- size: the footprint the cell measures at pick-up (`part_extent_m`, two axes) is twice the
  part's size plus the gauge's noise; episodes group by size (`sensing.size_clusters`: a
  Gaussian mixture of the sizes), and each group's share is its probability;
- mass: a part's sliding load is friction times mass, and friction is the table's, so each
  group's load against the most common part's (what `fit_physics` fitted) is its mass scale,
  fitted the same way: replay its first pushes under a grid of mass scales.

The footprint does not tell a cylinder from a box, so every variant is written as a
cylinder of that size (`shape` is kept in the world file's format for the sim's sake).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipelines.calibrate.logs import LoggedEpisode
from pipelines.calibrate.physics import Simulator, grid_fit, has_window, replay_windows
from pipelines.calibrate.sensing import Estimate, part_radius, size_clusters

MIN_SHARE = 0.03  # rarer groups are gauge outliers, not a variant worth pretraining on
MIN_EPISODES = 5
MIN_PUSH_WINDOWS = 3  # fewer first pushes: the group's mass scale is not identified
MASS_SCALES = np.geomspace(0.4, 4.0, 11)


@dataclass(frozen=True)
class PartGroup:
    size: Estimate  # m: cylinder radius or box half side, as the sim's parts have it
    share: Estimate  # probability, with its binomial standard error
    mass_scale: Estimate  # against the most common part (1.0 for it); std inf: not identified
    episodes: list[LoggedEpisode]

    @property
    def name(self) -> str:
        return f"part-{self.size.value * 1000:.0f}mm"

    def as_world_part(self) -> dict:
        return {
            "name": self.name,
            "shape": "cylinder",
            "size_m": _round(self.size.value),
            "mass_scale": _round(self.mass_scale.value),
            "probability": _round(self.share.value),
        }

    def uncertainty(self) -> dict:
        finite = lambda e: _round(e.std) if np.isfinite(e.std) else None  # noqa: E731
        return {
            "size_m": finite(self.size),
            "mass_scale": finite(self.mass_scale),
            "probability": finite(self.share),
        }


def size_groups(episodes: Sequence[LoggedEpisode]) -> list[PartGroup]:
    """Episodes grouped by measured part size, most common first; mass scales not yet fitted."""
    clusters = size_clusters(list(episodes))
    measured = sum(len(members) for members in clusters)
    kept = [m for m in clusters if len(m) >= MIN_EPISODES and len(m) >= MIN_SHARE * measured]
    total = sum(len(members) for members in kept)
    groups = []
    for members in kept:
        sizes = np.array([part_radius(e) for e in members])
        groups.append(
            PartGroup(
                size=Estimate(float(sizes.mean()), float(sizes.std(ddof=1) / np.sqrt(len(sizes)))),
                share=_share(len(members), total),
                mass_scale=Estimate(1.0, float("inf")),
                episodes=members,
            )
        )
    return sorted(groups, key=lambda g: -g.share.value)


def fit_part_mix(
    simulator: Simulator,
    episodes: Sequence[LoggedEpisode],
    ages: Mapping[str, np.ndarray],
    bias: Mapping[str, Estimate],
    physics: Mapping[str, float],
    noise: tuple[float, float],
    max_speed_mps: float,
) -> list[PartGroup]:
    """The size groups with their mass scales: the most common part is the reference (its
    mass is `physics["part_mass_kg"]`), every other group's first pushes are replayed under a
    grid of mass scales at the fitted friction and damping."""
    groups = size_groups(episodes)
    if not groups:
        return []
    radius = simulator.pusher_radius_m
    fitted = [replace(groups[0], mass_scale=Estimate(1.0, 0.0))]
    for group in groups[1:]:
        pushed = [e for e in group.episodes if has_window(e, radius)]
        if len(pushed) < MIN_PUSH_WINDOWS:
            fitted.append(group)
            continue
        windows = replay_windows(pushed, ages, bias, radius, max_speed_mps)
        mass = physics["part_mass_kg"]
        fit = grid_fit(
            simulator,
            windows,
            lambda p, m=mass: {**physics, "part_mass_kg": m * p["mass_scale"]},
            {"mass_scale": MASS_SCALES},
            "push",
            noise,
        )
        fitted.append(replace(group, mass_scale=fit.best["mass_scale"]))
    return fitted


def _share(count: int, total: int) -> Estimate:
    p = count / total
    return Estimate(p, float(np.sqrt(p * (1 - p) / total)))


def _round(x: float) -> float:
    return float(f"{float(x):.4g}")
