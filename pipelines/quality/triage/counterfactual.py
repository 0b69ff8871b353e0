"""Would a standard part have made it? A failed episode of an unfamiliar part, replayed.

The ground truth of a novel-part failure is a counterfactual: the same episode with the part
the cell was built for would have succeeded. No logged signal answers that (docs/triage.md,
"Combining the signals, and the ceiling"), but a simulator calibrated from the same line can:
the policy that ran the episode, from the episode's logged start, with the standard part,
under fresh draws of the line's noise. The share of those replays that succeed is the
episode's `standard_part_success`; above `triage.min_standard_part_success` the part is
blamed (rules.py, rule 2r).

The simulator is a plug-in (params `simulator.counterfactual`), as calibration's is: triage
hands it what the logs show at the episode's start and never imports one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import CellParams, TriageParams

# The part sits still until the pusher reaches it (it starts at least 8 cm away): the mean of
# the first frames is a steadier start than the first alone.
START_FRAMES = 5


@dataclass(frozen=True)
class LoggedStart:
    """An episode's start as its logs show it: the simulator turns it into a true state."""

    episode_id: str
    pusher: tuple[float, float]  # joint position at the first step (m)
    part: tuple[float, float]  # the part as the camera saw it then (m): its offset included
    part_yaw: float  # rad, as the camera saw it
    target: tuple[float, float]  # m
    confidence: float  # the camera's mean confidence over the episode: the light it worked in


class StandardPartReplay(Protocol):
    """params `simulator.counterfactual`: for each start, the share of `draws` episodes that
    `policy` (a policy folder) places from that start with the standard part, in the sim
    `calibration` describes, under fresh draws of its noise (the same for the same `seed`)."""

    def __call__(
        self,
        policy: Path,
        calibration: Path,
        cell: CellParams,
        starts: Sequence[LoggedStart],
        draws: int,
        seed: int,
    ) -> list[float]: ...


@dataclass(frozen=True)
class Counterfactual:
    """What triage needs to replay a cell's failures: the plug-in, the policy the cell ran,
    and a calibration of the cell's line."""

    replay: StandardPartReplay
    policy: Path
    calibration: Path
    # The policy's version (its config.json): only episodes the cell ran with it are replayed,
    # so a dataset spanning several production models is not judged by the wrong one. None:
    # every episode.
    policy_version: str | None = None
    seed: int = 0

    def ran(self, episode_policy_version: str | None) -> bool:
        return self.policy_version is None or episode_policy_version == self.policy_version

    def standard_part_success(
        self, starts: Sequence[LoggedStart], cell: CellParams, params: TriageParams
    ) -> dict[str, float]:
        if not starts:
            return {}
        shares = self.replay(
            self.policy, self.calibration, cell, starts, params.replay_draws, self.seed
        )
        if len(shares) != len(starts):
            raise ValueError(
                f"simulator.counterfactual returned {len(shares)} shares for {len(starts)} "
                "starts; it must return one per start"
            )
        return {s.episode_id: float(p) for s, p in zip(starts, shares, strict=True)}


def logged_starts(
    episodes: pa.Table, steps: pa.Table, confidence: Mapping[str, float], ids: Sequence[str]
) -> list[LoggedStart]:
    """The logged start of each episode in `ids` (in that order), from its first frames;
    `confidence`: each episode's mean camera confidence (Signals.confidence_mean)."""
    wanted = set(ids)
    targets = dict(
        zip(
            episodes.column("episode_id").to_pylist(),
            episodes.column("target").to_pylist(),
            strict=True,
        )
    )
    first = steps.filter(pc.less(steps.column("step"), START_FRAMES))
    frames: dict[str, list[dict]] = {}
    for row in first.select(["episode_id", "step", "joint_position", "part_pose"]).to_pylist():
        if row["episode_id"] in wanted:
            frames.setdefault(row["episode_id"], []).append(row)
    starts = []
    for episode_id in ids:
        rows = sorted(frames.get(episode_id, []), key=lambda r: r["step"])
        if not rows or rows[0]["step"] != 0:
            raise ValueError(f"episode {episode_id}: no first step in the dataset to start from")
        poses = np.array([r["part_pose"] for r in rows], dtype=float)
        starts.append(
            LoggedStart(
                episode_id,
                _pair(rows[0]["joint_position"]),
                _pair(poses[:, :2].mean(axis=0)),
                float(poses[0, 2]),
                _pair(targets[episode_id]),
                float(confidence[episode_id]),
            )
        )
    return starts


def _pair(values) -> tuple[float, float]:
    x, y = (float(v) for v in values[:2])
    return (x, y)
