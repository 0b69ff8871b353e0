"""The line's logs as per-episode arrays, in the order the cell wrote them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA


@dataclass(frozen=True)
class LoggedEpisode:
    """One episode as the cell logged it: every array has one row per control step."""

    episode_id: str
    shift_id: str
    shift_phase: float  # episode index / episodes in its shift, in [0, 1)
    part_extent_m: np.ndarray  # (2,) footprint measured at pick-up
    joint_position: np.ndarray  # (n, 2) m
    joint_velocity: np.ndarray  # (n, 2) m/s
    part_xy: np.ndarray  # (n, 2) perceived, m
    part_yaw: np.ndarray  # (n,) perceived, rad, unwrapped
    confidence: np.ndarray  # (n,)
    command: np.ndarray  # (n, 2) commanded, normalised to [-1, 1]

    @property
    def steps(self) -> int:
        return len(self.command)


def shift_position(episode_id: str) -> tuple[str, int]:
    """(shift_id, index in shift) from `<cell_id>-<shift_id>-<NNNNN>` (docs/data-contract.md)."""
    head, _, index = episode_id.rpartition("-")
    return head.rpartition("-")[2], int(index)


def logged_episodes(episodes: pa.Table, steps: pa.Table) -> list[LoggedEpisode]:
    """Split the steps table into episodes, ordered by shift and episode index."""
    episodes = episodes.select(EPISODES_SCHEMA.names)
    steps = steps.select(STEPS_SCHEMA.names)
    ids = steps.column("episode_id").to_numpy(zero_copy_only=False)
    order = np.lexsort((steps.column("step").to_numpy(), ids))
    ids = ids[order]
    columns = {
        "joint_position": _matrix(steps, "joint_position", 2)[order],
        "joint_velocity": _matrix(steps, "joint_velocity", 2)[order],
        "part_pose": _matrix(steps, "part_pose", 3)[order],
        "confidence": steps.column("part_confidence").to_numpy().astype(float)[order],
        "command": _matrix(steps, "action", 2)[order],
    }
    bounds = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1], True]) if len(ids) else [0]
    spans = {ids[a]: slice(a, b) for a, b in itertools.pairwise(bounds)}
    extents = dict(
        zip(
            episodes.column("episode_id").to_pylist(),
            episodes.column("part_extent_m").to_pylist(),
            strict=True,
        )
    )
    shift_sizes: dict[str, int] = {}
    for episode_id in spans:
        shift, index = shift_position(episode_id)
        shift_sizes[shift] = max(shift_sizes.get(shift, 0), index + 1)
    logged = [
        _episode(episode_id, span, columns, extents.get(episode_id), shift_sizes)
        for episode_id, span in spans.items()
    ]
    return sorted(logged, key=lambda e: (e.shift_id, e.shift_phase))


def _episode(episode_id, span, columns, extent, shift_sizes) -> LoggedEpisode:
    shift, index = shift_position(episode_id)
    pose = columns["part_pose"][span]
    return LoggedEpisode(
        episode_id=episode_id,
        shift_id=shift,
        shift_phase=index / shift_sizes[shift],
        part_extent_m=np.asarray(extent if extent is not None else [np.nan, np.nan], float),
        joint_position=columns["joint_position"][span],
        joint_velocity=columns["joint_velocity"][span],
        part_xy=pose[:, :2],
        part_yaw=np.unwrap(pose[:, 2]),
        confidence=columns["confidence"][span],
        command=columns["command"][span],
    )


def _matrix(table: pa.Table, name: str, width: int) -> np.ndarray:
    flat = table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return flat.astype(float).reshape(-1, width)
