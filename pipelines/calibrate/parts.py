"""The line's part mix from its logs: which part sizes arrive, how often, how heavy.

The sim knows one part; a line runs several, and new variants arrive. A policy pretrained
on the sim's one part never pushes the others, so the calibrated sim takes the mix the logs
show:

- size: the footprint the cell measures at pick-up (`part_extent_m`, two axes) is twice the
  part's size plus the gauge's noise; episodes group by size (`sensing.size_clusters`: a
  Gaussian mixture of the sizes), and each group's share is its probability;
- mass: a part's sliding load is friction times mass, and friction is the table's, so each
  group's load against the most common part's (what `fit_physics` fitted) is its mass scale,
  fitted the same way: replay its first pushes under a grid of mass scales;
- shape: the footprint does not tell a cylinder from a box, but a push does. A round pusher
  pushes a cylinder through its centre and it barely turns; a box pushed off its centre line
  turns. Each group's first pushes are replayed as a cylinder and as a box of its size, and a
  push where the box would have turned visibly (`SHAPE_TURN_SIGMAS` of the camera's yaw
  noise) votes for whichever replay follows the yaw the camera saw. A group with boxes among
  it (a 28 mm square among 30 mm cylinders) is split into a cylinder and a box variant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipelines.calibrate.logs import LoggedEpisode
from pipelines.calibrate.physics import (
    Simulator,
    Windows,
    grid_fit,
    has_window,
    replay_windows,
    yaw_losses,
)
from pipelines.calibrate.sensing import Estimate, part_radius, size_clusters

MIN_SHARE = 0.03  # rarer groups are gauge outliers, not a variant worth pretraining on
MIN_EPISODES = 5
MIN_PUSH_WINDOWS = 3  # fewer first pushes: the group's mass scale is not identified
MASS_SCALES = np.geomspace(0.4, 4.0, 11)
# A push informs the shape where a box's replay turns by this many yaw-noise sigmas: below
# that, box and cylinder replays look alike and the push says nothing either way.
SHAPE_TURN_SIGMAS = 3.0
# A group is all boxes when most of its informative pushes turned like one: cylinders never
# did in the reference cell's shifts (0 of 196 informative pushes over four recordings), while
# a box pushed square-on through its middle turns no more than a cylinder (1 in 4 of them).
ALL_BOXES_SHARE = 0.5
# Pushes that must vote box before a group has boxes at all; cylinders gave none in 196.
MIN_BOX_VOTES = 3


@dataclass(frozen=True)
class PartGroup:
    size: Estimate  # m: cylinder radius or box half side, as the sim's parts have it
    share: Estimate  # probability, with its binomial standard error
    mass_scale: Estimate  # against the most common part (1.0 for it); std inf: not identified
    episodes: list[LoggedEpisode]
    shape: str = "cylinder"  # or "box"

    @property
    def name(self) -> str:
        kind = "box" if self.shape == "box" else "part"
        return f"{kind}-{self.size.value * 1000:.0f}mm"

    def as_world_part(self) -> dict:
        return {
            "name": self.name,
            "shape": self.shape,
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
    yaw_noise: float | None = None,
) -> list[PartGroup]:
    """The size groups with their mass scales and shapes: the most common part is the
    reference (its mass is `physics["part_mass_kg"]`), every other group's first pushes are
    replayed under a grid of mass scales at the fitted friction and damping. `yaw_noise`
    (rad) None: shapes are not tested and every group is a cylinder."""
    groups = size_groups(episodes)
    if not groups:
        return []
    radius = simulator.pusher_radius_m
    mass = physics["part_mass_kg"]
    fitted = []
    for index, group in enumerate(groups):
        if index == 0:
            group = replace(group, mass_scale=Estimate(1.0, 0.0))
        pushed = [e for e in group.episodes if has_window(e, radius)]
        if len(pushed) < MIN_PUSH_WINDOWS:
            fitted.append(group)
            continue
        windows = replay_windows(pushed, ages, bias, radius, max_speed_mps)
        if index > 0:
            group = replace(group, mass_scale=_mass_scale(simulator, windows, physics, noise))
        if yaw_noise is None:
            fitted.append(group)
            continue
        at_mass = {**physics, "part_mass_kg": mass * group.mass_scale.value}
        fitted += split_by_shape(group, pushed, shape_votes(simulator, windows, at_mass, yaw_noise))
    return fitted  # size groups most common first, a box variant after its cylinder


def _mass_scale(
    simulator: Simulator, windows: Windows, physics: Mapping[str, float], noise: tuple[float, float]
) -> Estimate:
    mass = physics["part_mass_kg"]
    fit = grid_fit(
        simulator,
        windows,
        lambda p: {**physics, "part_mass_kg": mass * p["mass_scale"]},
        {"mass_scale": MASS_SCALES},
        "push",
        noise,
    )
    return fit.best["mass_scale"]


@dataclass(frozen=True)
class ShapeVotes:
    """Per push window (in `replay_windows` order): whether it informs the shape at all, and
    whether a box's replay follows the logged yaw better than a cylinder's."""

    informative: np.ndarray  # (B,) bool
    box: np.ndarray  # (B,) bool

    @property
    def box_share(self) -> Estimate:
        """Share of boxes among the informative pushes, with its binomial standard error."""
        n = int(self.informative.sum())
        if n == 0:
            return Estimate(0.0, float("inf"))
        return _share(int((self.box & self.informative).sum()), n)


def shape_votes(
    simulator: Simulator, windows: Windows, physics: Mapping[str, float], yaw_noise: float
) -> ShapeVotes:
    """Replay the windows as a cylinder and as a box of the group's size and compare the turn
    each predicts with the turn the camera saw (`yaw_losses`)."""
    replays = {}
    for shape in ("cylinder", "box"):
        batch = replace(windows.batch, part_shape=shape)
        replays[shape] = simulator.replay([physics], batch)[0]
    box_yaw = replays["box"].part_yaw
    if box_yaw is None:  # a plug-in that replays no yaw: nothing to vote with
        none = np.zeros(len(windows.batch.pusher_start), bool)
        return ShapeVotes(none, none)
    turn = np.abs(box_yaw - windows.batch.part_start[:, 2:3]) * windows.pushing
    informative = turn.max(1) > SHAPE_TURN_SIGMAS * yaw_noise
    loss = {shape: yaw_losses(r, windows, yaw_noise) for shape, r in replays.items()}
    return ShapeVotes(informative, informative & (loss["box"] < loss["cylinder"]))


def split_by_shape(
    group: PartGroup, pushed: Sequence[LoggedEpisode], votes: ShapeVotes
) -> list[PartGroup]:
    """The group as it is (cylinders), all boxes, or a cylinder and a box variant of the same
    size with the group's share divided by the informative pushes' votes."""
    if int(votes.box.sum()) < MIN_BOX_VOTES:
        return [group]
    share = votes.box_share
    if share.value >= ALL_BOXES_SHARE:
        return [replace(group, shape="box")]
    voted_box = {e.episode_id for e, box in zip(pushed, votes.box, strict=True) if box}
    spread = lambda part: Estimate(  # noqa: E731  the group's share times the box share
        group.share.value * part,
        float(np.hypot(group.share.std * part, group.share.value * share.std)),
    )
    cylinders = [e for e in group.episodes if e.episode_id not in voted_box]
    return [
        replace(group, share=spread(1 - share.value), episodes=cylinders),
        replace(
            group,
            shape="box",
            share=spread(share.value),
            # The group's mass scale, fitted on both shapes together: not the box's own.
            mass_scale=Estimate(group.mass_scale.value, float("inf")),
            episodes=[e for e in group.episodes if e.episode_id in voted_box],
        ),
    ]


def _share(count: int, total: int) -> Estimate:
    p = count / total
    return Estimate(p, float(np.sqrt(p * (1 - p) / total)))


def _round(x: float) -> float:
    return float(f"{float(x):.4g}")
