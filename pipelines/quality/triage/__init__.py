"""Failure-mode triage: why did a line episode fail, told from its logs alone (`report` says
how; docs/triage.md is the reference)."""

from pipelines.quality.triage.counterfactual import (
    Counterfactual,
    LoggedStart,
    StandardPartReplay,
    logged_starts,
)
from pipelines.quality.triage.report import (
    NOVEL_PART_KINDS,
    CaptureRef,
    TriageReport,
    part_kinds,
    triage,
    triage_dataset,
)
from pipelines.quality.triage.rules import (
    CLASSES,
    CONTROL,
    NOVEL_PART,
    PERCEPTION,
    PHYSICS,
    SAFETY,
    Verdict,
    classify,
)
from pipelines.quality.triage.selection import (
    episode_weights,
    novel_part_episode_ids,
    novel_part_ids,
)
from pipelines.quality.triage.signals import Signals, episode_signals
from pipelines.quality.triage.snapshots import SnapshotPart, read_snapshot

__all__ = [
    "CLASSES",
    "CONTROL",
    "NOVEL_PART",
    "NOVEL_PART_KINDS",
    "PERCEPTION",
    "PHYSICS",
    "SAFETY",
    "CaptureRef",
    "Counterfactual",
    "LoggedStart",
    "Signals",
    "SnapshotPart",
    "StandardPartReplay",
    "TriageReport",
    "Verdict",
    "classify",
    "episode_signals",
    "episode_weights",
    "logged_starts",
    "novel_part_episode_ids",
    "novel_part_ids",
    "part_kinds",
    "read_snapshot",
    "triage",
    "triage_dataset",
]
