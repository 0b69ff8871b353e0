"""Failure-mode triage: why did a line episode fail, told from its logs alone (`report` says
how; docs/triage.md is the reference)."""

from pipelines.quality.triage.report import CaptureRef, TriageReport, triage, triage_dataset
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
from pipelines.quality.triage.signals import Signals, episode_signals

__all__ = [
    "CLASSES",
    "CONTROL",
    "NOVEL_PART",
    "PERCEPTION",
    "PHYSICS",
    "SAFETY",
    "CaptureRef",
    "Signals",
    "TriageReport",
    "Verdict",
    "classify",
    "episode_signals",
    "triage",
    "triage_dataset",
]
