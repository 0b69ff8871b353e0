"""What calibration hands over: sim-calibration.yaml and the plots that justify it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import yaml

from pipelines.calibrate.fit import Calibration
from pipelines.calibrate.latency import LatencyFit
from pipelines.calibrate.logs import LoggedEpisode
from pipelines.calibrate.physics import Simulator, Windows, has_window, replay_windows
from pipelines.calibrate.sensing import Estimate, lighting, reference_part_episodes

HEADER = """\
# The line as its logs show it, for the simulation team (written by `realloop calibrate`).
# world: estimates under the same keys and units as the simulator's world file.
# uncertainty: standard error per estimate (null: the logs do not identify it; see
#   identified and derived, and docs/calibration.md).
# randomization: uniform ranges to pretrain with (`realloop cell pretrain --calibration`).
"""


def write_calibration(calibration: Calibration, path: Path, provenance: Mapping) -> Path:
    """Write atomically: a reader never sees half a file."""
    body = {"provenance": dict(provenance), **calibration.as_dict()}
    body.pop("fit")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(HEADER + yaml.safe_dump(body, sort_keys=False))
    partial.replace(path)
    return path


def replay_comparison(
    simulator: Simulator,
    logs: Sequence[LoggedEpisode],
    latency: LatencyFit,
    perception: Mapping[str, Estimate],
    sim_world: Mapping,
    calibration: Calibration,
    max_speed_mps: float,
    episodes: int = 3,
) -> dict:
    """The same logged pushes replayed in the sim as it was and as calibrated."""
    radius = simulator.pusher_radius_m
    candidates = [e for e in reference_part_episodes(list(logs)) if has_window(e, radius)]
    chosen = sorted(candidates, key=_part_travel)[-episodes:]
    no_bias = {k: Estimate(0.0, 0.0) for k in perception}
    immediate = {e.episode_id: np.zeros(e.steps, int) for e in chosen}  # the sim: no delay
    before = replay_windows(chosen, immediate, no_bias, radius, max_speed_mps)
    after = replay_windows(chosen, latency.ages_by_episode, perception, radius, max_speed_mps)
    (replayed_before,) = simulator.replay([sim_world["physics"]], before.batch)
    (replayed_after,) = simulator.replay([calibration.world["physics"]], after.batch)
    camera = np.array(
        [_bias_at(perception, e.shift_phase) for e in chosen]
    )  # what the calibrated camera adds to the replayed part
    return {
        "episode_ids": [e.episode_id for e in chosen],
        "logged_velocity": before.logged_velocity,
        "logged_part": before.logged_part,  # perceived, as logged (no correction)
        "before_velocity": replayed_before.pusher_velocity,
        "before_part": replayed_before.part,
        "after_velocity": replayed_after.pusher_velocity,
        "after_part": replayed_after.part + camera[:, None, :],
        "valid": _valid(before),
        "rms": _rms(before, replayed_before, replayed_after, camera),
    }


def _part_travel(episode: LoggedEpisode) -> float:
    """How far the part was pushed: the pushes worth looking at."""
    return float(np.linalg.norm(episode.part_xy[-5:].mean(0) - episode.part_xy[:5].mean(0)))


def _bias_at(perception, phase: float) -> np.ndarray:
    level = float(lighting(phase))
    return np.array(
        [
            perception["bias_x_m"].value + perception["bias_drift_x_m"].value * level,
            perception["bias_y_m"].value + perception["bias_drift_y_m"].value * level,
        ]
    )


def _valid(windows: Windows) -> np.ndarray:
    """Steps inside each (padded) window."""
    return np.abs(windows.batch.applied).sum(-1) + np.abs(windows.logged_velocity).sum(-1) > 0


def _rms(windows: Windows, before, after, camera) -> dict[str, dict[str, float]]:
    valid = _valid(windows)

    def rms(a, b):
        return float(np.sqrt((np.linalg.norm(a - b, axis=-1)[valid] ** 2).mean()))

    return {
        "pusher_velocity_mps": {
            "before": rms(before.pusher_velocity, windows.logged_velocity),
            "after": rms(after.pusher_velocity, windows.logged_velocity),
        },
        "part_position_m": {
            "before": rms(before.part, windows.logged_part),
            "after": rms(after.part + camera[:, None, :], windows.logged_part),
        },
    }


def plot_replay(comparison: dict, path: Path, dt: float) -> Path:
    """Per episode: the part's path in the table plane, and the gantry's x velocity."""
    from matplotlib.figure import Figure  # Agg canvas, no pyplot state

    n = len(comparison["episode_ids"])
    figure = Figure(figsize=(10, 3.4 * n), layout="constrained")
    axes = figure.subplots(n, 2, squeeze=False)
    styles = {
        "logged": {"color": "black", "marker": ".", "linestyle": "none", "label": "logged"},
        "before": {"color": "tab:red", "label": "sim before calibration"},
        "after": {"color": "tab:blue", "label": "sim after calibration"},
    }
    for row, episode_id in enumerate(comparison["episode_ids"]):
        valid = comparison["valid"][row]
        path_ax, speed_ax = axes[row]
        time = np.arange(1, valid.sum() + 1) * dt
        for key, part_key, speed_key in (
            ("logged", "logged_part", "logged_velocity"),
            ("before", "before_part", "before_velocity"),
            ("after", "after_part", "after_velocity"),
        ):
            part = comparison[part_key][row][valid]
            path_ax.plot(part[:, 0], part[:, 1], **styles[key])
            speed_ax.plot(time, comparison[speed_key][row][valid][:, 0], **styles[key])
        path_ax.set(title=f"{episode_id}: part path", xlabel="x (m)", ylabel="y (m)")
        path_ax.set_aspect("equal", adjustable="datalim")
        speed_ax.set(title="gantry x velocity", xlabel="time (s)", ylabel="m/s")
    axes[0][1].legend(loc="best", fontsize="small")
    return _save(figure, path)


def plot_profiles(profiles: Mapping[str, Mapping[str, list[float]]], path: Path) -> Path:
    """The fit objective along each physical parameter: a valley is identified, flat is not."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    labels = {
        "joint_damping": "joint damping (N s/m)",
        "load_scale": "friction and mass scaled together (x sim)",
        "friction_at_fixed_load": "friction, mass traded to keep the sliding force",
    }
    figure = Figure(figsize=(4 * len(profiles), 3.2), layout="constrained")
    axes = figure.subplots(1, len(profiles), squeeze=False)[0]
    for ax, (name, curve) in zip(axes, profiles.items(), strict=True):
        ax.plot(curve["values"], curve["objective"], marker="o")
        ax.set(xscale="log", xlabel=labels.get(name, name), ylabel="replay loss")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    return path
