"""Physical parameters by replaying logged drive commands in the sim and fitting the logs.

The sim is reached through `Simulator` (a plug-in params.yaml names): it replays windows of
episodes open loop, with candidate physics, from the state the logs show at each window's
start. Three fits, each a grid over the candidates followed by a parabola through the best
point and its neighbours:

- joint damping from the gantry's velocity on steps where it touches nothing;
- the part's sliding load (friction and mass scaled together) from the first push of each
  episode, which starts from rest (all velocities known to be zero): the part's path
  (perceived, camera bias removed) and the pusher's slow-down while pushing, normalised by
  their noise levels;
- friction traded against mass at that load, which tells whether they come apart.

Per-window losses are kept for every candidate, so the uncertainty is a bootstrap over
windows at no extra replay cost, and the objective's profile along each parameter shows
whether the logs identify it (a flat profile means they do not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipelines.calibrate.latency import LatencyFit, applied_commands
from pipelines.calibrate.logs import LoggedEpisode
from pipelines.calibrate.sensing import (
    Estimate,
    clear_of_part,
    lighting,
    part_radius,
    reference_part_episodes,
    rest_prefix,
)

AFTER_CONTACT_STEPS = 30  # how far past the first push a replay can still follow the log
HUBER_K = 3.0  # residuals beyond 3 noise sigmas count linearly: a diverged replay is one
BOOTSTRAP = 200


@dataclass(frozen=True)
class ReplayBatch:
    pusher_start: np.ndarray  # (B, 2) m
    part_start: np.ndarray  # (B, 3) x, y, yaw
    applied: np.ndarray  # (B, W, 2) drive command (m/s) during each control step
    part_radius_m: float  # cylinder radius or box half side
    part_shape: str = "cylinder"  # or "box": the world file's part shapes


@dataclass(frozen=True)
class ReplayResult:
    """State after each control step: index k is what the log shows at step k + 1."""

    pusher: np.ndarray  # (B, W, 2)
    pusher_velocity: np.ndarray  # (B, W, 2)
    part: np.ndarray  # (B, W, 2)
    # (B, W) rad. Optional for a plug-in: without it calibration cannot tell a box from a
    # cylinder, and every part variant stays a cylinder.
    part_yaw: np.ndarray | None = None


class Simulator(Protocol):
    """What calibration needs of a simulator (docs/calibration.md: plugging in your own).

    `replay` rolls every window of `batch` out open loop once per candidate in `physics` (a
    world file's `physics` keys), applying `batch.applied[:, k]` during control step k, and
    returns one ReplayResult per candidate, in order."""

    pusher_radius_m: float  # the tool's radius: where it touches the part

    def replay(
        self, physics: Sequence[Mapping[str, float]], batch: ReplayBatch
    ) -> list[ReplayResult]: ...


@dataclass(frozen=True)
class Windows:
    batch: ReplayBatch
    logged_velocity: np.ndarray  # (B, W, 2) at steps 1..W
    logged_part: np.ndarray  # (B, W, 2) perceived, bias removed
    free: np.ndarray  # (B, W) bool: the pusher touches nothing
    pushing: np.ndarray  # (B, W) bool: from just before the first push on
    logged_yaw: np.ndarray  # (B, W) perceived, rad


@dataclass(frozen=True)
class GridFit:
    names: tuple[str, ...]
    grid: tuple[np.ndarray, ...]  # candidate values per parameter
    losses: np.ndarray  # (*grid shape, windows) per-window loss
    best: dict[str, Estimate]

    def profiles(self) -> dict[str, dict[str, list[float]]]:
        """Objective along each parameter, minimised over the others."""
        total = self.losses.mean(-1)
        out = {}
        for axis, name in enumerate(self.names):
            others = tuple(i for i in range(total.ndim) if i != axis)
            curve = total.min(axis=others) if others else total
            out[name] = {"values": self.grid[axis].tolist(), "objective": curve.tolist()}
        return out


def replay_windows(
    episodes: Sequence[LoggedEpisode],
    ages: Mapping[str, np.ndarray],
    bias: Mapping[str, Estimate],
    pusher_radius_m: float,
    max_speed_mps: float,
    length: int | None = None,
) -> Windows:
    """One window per episode from its start; `length` None: through the first push.
    `ages[episode_id]` is the age of the command the drives apply at each step. The episodes
    without a resting start and a push after it are left out (`has_window`)."""
    rows = []
    for episode in (e for e in episodes if has_window(e, pusher_radius_m)):
        prefix = rest_prefix(episode, pusher_radius_m)
        steps = min(length or prefix + AFTER_CONTACT_STEPS, episode.steps - 1)
        ages_here = ages[episode.episode_id][:steps]
        rows.append(
            _window(episode, ages_here, prefix, steps, bias, pusher_radius_m, max_speed_mps)
        )
    columns = list(zip(*rows, strict=True))
    width = max(len(a) for a in columns[2])
    pad = lambda arrays: np.stack([_pad(a, width) for a in arrays])  # noqa: E731
    radius = float(np.median([part_radius(e) for e in episodes]))
    return Windows(
        batch=ReplayBatch(np.stack(columns[0]), np.stack(columns[1]), pad(columns[2]), radius),
        logged_velocity=pad(columns[3]),
        logged_part=pad(columns[4]),
        free=pad(columns[5]).astype(bool),
        pushing=pad(columns[6]).astype(bool),
        logged_yaw=pad(columns[7]),
    )


def has_window(episode: LoggedEpisode, pusher_radius_m: float) -> bool:
    """A replay window needs a resting start and a push after it."""
    prefix = rest_prefix(episode, pusher_radius_m)
    return 2 <= prefix < episode.steps - 2


def _window(episode, ages, prefix, steps, bias, pusher_radius_m, max_speed_mps):
    level = float(lighting(episode.shift_phase))
    offset = np.array(
        [
            bias["bias_x_m"].value + bias["bias_drift_x_m"].value * level,
            bias["bias_y_m"].value + bias["bias_drift_y_m"].value * level,
        ]
    )
    part_xy = episode.part_xy - offset
    clear = clear_of_part(episode, pusher_radius_m)
    return (
        episode.joint_position[0],
        np.r_[part_xy[:prefix].mean(0), episode.part_yaw[:prefix].mean()],
        applied_commands(episode, ages, max_speed_mps),
        episode.joint_velocity[1 : steps + 1],
        part_xy[1 : steps + 1],
        clear[1 : steps + 1] & clear[:steps],
        np.arange(1, steps + 1) >= prefix - 1,
        episode.part_yaw[1 : steps + 1],
    )


def _pad(array: np.ndarray, width: int) -> np.ndarray:
    extra = width - len(array)
    return np.concatenate([array, np.zeros((extra, *array.shape[1:]))]) if extra else array


def window_losses(
    result: ReplayResult, windows: Windows, velocity_noise: float, pose_noise: float, use: str
) -> np.ndarray:
    """Per-window mean Huber loss of the noise-normalised residuals.

    `use="gantry"`: the drives' velocity while they touch nothing (what damping shapes).
    `use="push"`: from the first push on, the part's path and the drives' slow-down under
    the part's load (what friction and mass shape).
    """
    velocity = np.linalg.norm(result.pusher_velocity - windows.logged_velocity, axis=-1)
    velocity_loss = _huber(velocity / velocity_noise)
    if use == "gantry":
        terms = [(velocity_loss, windows.free)]
    else:
        part = np.linalg.norm(result.part - windows.logged_part, axis=-1)
        terms = [(velocity_loss, windows.pushing), (_huber(part / pose_noise), windows.pushing)]
    total = sum((loss * mask).sum(1) for loss, mask in terms)
    count = sum(mask.sum(1) for _, mask in terms)
    return total / np.maximum(count, 1)


def yaw_losses(result: ReplayResult, windows: Windows, yaw_noise: float) -> np.ndarray:
    """Per-window mean Huber loss of the part's turn from the first push on, normalised by
    the camera's yaw noise. Turns are compared modulo a quarter turn: a camera cannot tell a
    square's sides apart, and a cylinder's replayed yaw barely moves."""
    if result.part_yaw is None:
        raise ValueError("this simulator's replay returns no part_yaw")
    residual = result.part_yaw - windows.logged_yaw
    quarter = np.pi / 2
    residual = (residual + quarter / 2) % quarter - quarter / 2
    loss = _huber(np.abs(residual) / yaw_noise) * windows.pushing
    return loss.sum(1) / np.maximum(windows.pushing.sum(1), 1)


def _huber(z: np.ndarray) -> np.ndarray:
    return np.where(z < HUBER_K, 0.5 * z**2, HUBER_K * (z - 0.5 * HUBER_K))


def grid_fit(
    simulator: Simulator,
    windows: Windows,
    to_physics: Callable[[dict[str, float]], dict[str, float]],
    grid: Mapping[str, np.ndarray],
    score: str,
    noise: tuple[float, float],
    seed: int = 0,
) -> GridFit:
    """Replay every grid point; `to_physics` turns a grid point into the sim's physics."""
    names = tuple(grid)
    axes = tuple(np.asarray(grid[n], float) for n in names)
    mesh = np.meshgrid(*axes, indexing="ij")
    candidates = [
        to_physics({n: float(m.flat[i]) for n, m in zip(names, mesh, strict=True)})
        for i in range(mesh[0].size)
    ]
    results = simulator.replay(candidates, windows.batch)
    losses = np.stack([window_losses(r, windows, *noise, use=score) for r in results])
    losses = losses.reshape(*mesh[0].shape, -1)
    best = _bootstrap_best(losses, axes, names, np.random.default_rng(seed))
    return GridFit(names, axes, losses, best)


def _bootstrap_best(losses, axes, names, rng) -> dict[str, Estimate]:
    n = losses.shape[-1]
    point = _refined_minimum(losses.mean(-1), axes)
    draws = np.array(
        [
            _refined_minimum(losses[..., rng.integers(0, n, n)].mean(-1), axes)
            for _ in range(BOOTSTRAP)
        ]
    )
    return {
        name: Estimate(float(point[i]), float(draws[:, i].std())) for i, name in enumerate(names)
    }


def _refined_minimum(total: np.ndarray, axes) -> np.ndarray:
    """Grid argmin, refined per axis by a parabola through it and its neighbours (log scale)."""
    index = np.unravel_index(np.argmin(total), total.shape)
    point = []
    for axis, values in enumerate(axes):
        i = index[axis]
        if 0 < i < len(values) - 1:
            line = [
                total[tuple(j if a == axis else index[a] for a in range(total.ndim))]
                for j in (i - 1, i, i + 1)
            ]
            point.append(_parabola_vertex(np.log(values[i - 1 : i + 2]), line))
        else:
            point.append(np.log(values[i]))
    return np.exp(point)


def _parabola_vertex(x, y) -> float:
    denominator = (x[0] - x[1]) * (x[0] - x[2]) * (x[1] - x[2])
    a = (x[2] * (y[1] - y[0]) + x[1] * (y[0] - y[2]) + x[0] * (y[2] - y[1])) / denominator
    b = (
        x[2] ** 2 * (y[0] - y[1]) + x[1] ** 2 * (y[2] - y[0]) + x[0] ** 2 * (y[1] - y[2])
    ) / denominator
    if a <= 0:
        return float(x[1])
    return float(np.clip(-b / (2 * a), x[0], x[2]))


GRAVITY = 9.81
VALLEY_FLATNESS = 0.01  # objective varies less than 1% along a direction: not identified


@dataclass(frozen=True)
class PhysicsFit:
    estimates: dict[str, Estimate]  # friction, part_mass_kg, joint_damping
    sliding_force: Estimate  # friction * mass * g of the standard part, N: what pushes feel
    identified: dict[str, bool]
    profiles: dict[str, dict[str, list[float]]]
    windows: dict[str, int]


def fit_physics(
    simulator: Simulator,
    episodes: Sequence[LoggedEpisode],
    latency: LatencyFit,
    bias: Mapping[str, Estimate],
    noise: tuple[float, float],
    sim_physics: Mapping[str, float],
    max_speed_mps: float,
    gantry_window_steps: int = 40,
) -> PhysicsFit:
    """Damping from the free gantry, then the part's sliding load, then the valley along
    which friction trades against mass at that load."""
    radius = simulator.pusher_radius_m
    ages = latency.ages_by_episode
    gantry = replay_windows(episodes, ages, bias, radius, max_speed_mps, gantry_window_steps)
    damping_fit = grid_fit(
        simulator,
        gantry,
        lambda p: {**sim_physics, **p},
        {"joint_damping": sim_physics["joint_damping"] * np.geomspace(0.25, 25.0, 11)},
        "gantry",
        noise,
    )
    damping = damping_fit.best["joint_damping"]
    pushes = replay_windows(
        reference_part_episodes(list(episodes)), ages, bias, radius, max_speed_mps
    )
    mu0, m0 = sim_physics["friction"], sim_physics["part_mass_kg"]
    with_damping = {**sim_physics, "joint_damping": damping.value}
    load = grid_fit(  # both scaled alike: the product moves, the ratio stays the sim's
        simulator,
        pushes,
        lambda p: {**with_damping, "friction": mu0 * p["scale"], "part_mass_kg": m0 * p["scale"]},
        {"scale": np.geomspace(0.3, 3.0, 11)},
        "push",
        noise,
    )
    scale = load.best["scale"]
    force = mu0 * m0 * GRAVITY * scale.value**2
    valley = grid_fit(  # same load, friction traded against mass
        simulator,
        pushes,
        lambda p: {
            **with_damping,
            "friction": mu0 * scale.value * p["trade"],
            "part_mass_kg": m0 * scale.value / p["trade"],
        },
        {"trade": np.geomspace(0.25, 4.0, 9)},
        "push",
        noise,
    )
    friction, mass, identified = _split_load(valley, mu0, m0, scale)
    return PhysicsFit(
        estimates={"friction": friction, "part_mass_kg": mass, "joint_damping": damping},
        sliding_force=Estimate(force, force * 2 * scale.std / scale.value),
        identified={"friction": identified, "part_mass_kg": identified, "joint_damping": True},
        profiles={
            "joint_damping": damping_fit.profiles()["joint_damping"],
            "load_scale": load.profiles()["scale"],
            "friction_at_fixed_load": _valley_profile(valley, mu0 * scale.value),
        },
        windows={"gantry": len(gantry.batch.pusher_start), "push": len(pushes.batch.pusher_start)},
    )


def _split_load(valley: GridFit, mu0: float, m0: float, scale: Estimate):
    """Friction and mass apart, if the valley has a floor; otherwise the point on it nearest
    the sim's own values (equal log-changes), flagged as not identified."""
    curve = valley.losses.mean(-1)
    identified = (curve.max() - curve.min()) / curve.min() > VALLEY_FLATNESS
    trade = valley.best["trade"] if identified else Estimate(1.0, float("inf"))
    spread = trade.std / trade.value  # relative, carried into both
    mu, m = mu0 * scale.value * trade.value, m0 * scale.value / trade.value
    return Estimate(mu, mu * spread), Estimate(m, m * spread), bool(identified)


def _valley_profile(valley: GridFit, friction_at_sim_ratio: float) -> dict[str, list[float]]:
    trade = valley.grid[0]
    return {
        "values": (friction_at_sim_ratio * trade).tolist(),
        "objective": valley.losses.mean(-1).tolist(),
    }
