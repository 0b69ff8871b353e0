"""Novel parts for the loop's data selection: which episodes of a cycle's batches carry a part
the cell was not built for, and how much their steps weigh in fine-tuning (docs/triage.md,
"Novel parts for data selection").

Cheap on purpose (it runs on every cycle's batches): one snapshot per episode with a capture
(the part's true size), else the camera's extent measurement, else how far the part turned
while pushed (a box swings round, a cylinder does not); none of the failure rules run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipelines.contract.params import TriageParams
from pipelines.ingest import read_dataset
from pipelines.quality.triage.report import (
    NOVEL_PART_KINDS,
    part_kinds,
    read_capture_sidecars,
)
from pipelines.quality.triage.signals import yaw_turns
from pipelines.quality.triage.snapshots import read_snapshots


def novel_part_episode_ids(
    dataset: Path,
    batches: list[str] | None,
    captures_dir: Path | None,
    params: TriageParams,
) -> set[str]:
    """The episodes of `batches` (batch shas of `dataset`; None: all of it) whose part is not
    the standard one, failed or not. `captures_dir` (`<ingest.landing>/captures`) holds the
    captures' sidecars and snapshots; without it only the logs decide."""
    episodes, steps = read_dataset(Path(dataset), sources=batches)
    return novel_part_ids(episodes, steps, captures_dir, params)


def novel_part_ids(
    episodes: pa.Table, steps: pa.Table, captures_dir: Path | None, params: TriageParams
) -> set[str]:
    """`novel_part_episode_ids` on tables already read."""
    if episodes.num_rows == 0:
        return set()
    seen: dict[str, tuple[float, float]] = {}
    if captures_dir is not None and Path(captures_dir).is_dir():
        refs = read_capture_sidecars(Path(captures_dir), episodes)
        listed = [(r.episode_id, r.step, r.attachments) for r in refs]
        for episode_id, _, part in read_snapshots(
            listed, Path(captures_dir), params.snapshot_half_width_m
        ):
            seen[episode_id] = (part.radius_m, float("nan"))
    ids = episodes.column("episode_id").to_pylist()
    turns = yaw_turns(steps, [e for e in ids if e not in seen])
    kinds = part_kinds(episodes, seen, params, turns)
    return {e for e, kind in kinds.items() if kind in NOVEL_PART_KINDS}


def episode_weights(
    episode_ids: Iterable[str] | np.ndarray, novel_ids: Iterable[str], weight: float
) -> np.ndarray:
    """Per training example (its episode id): `weight` for a novel-part episode's example,
    1 otherwise, as float32 to multiply into the examples' loss weights."""
    ids = np.asarray(episode_ids if isinstance(episode_ids, np.ndarray) else list(episode_ids))
    novel = np.asarray(sorted(set(novel_ids)), dtype=object)
    hit = np.isin(ids.astype(object), novel) if len(novel) else np.zeros(len(ids), dtype=bool)
    return np.where(hit, np.float32(weight), np.float32(1.0)).astype(np.float32)
