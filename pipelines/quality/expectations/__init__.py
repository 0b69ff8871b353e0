"""The validate stage's Great Expectations suites, kept as code: one module per suite.

    episodes   one row per episode (the episodes table, with per-episode aggregates of its steps)
    steps      the steps table's extremes: per column its min, its max and a null if it has one
    captures   one row per edge-case capture (sidecar JSON and attachments)

Each expectation is critical or warning, with a meta that says how its failure reads
(`common`). docs/validation.md lists them all.
"""

from pipelines.quality.expectations.captures import CAPTURE_REASONS
from pipelines.quality.expectations.common import CRITICAL, WARNING
from pipelines.quality.expectations.episodes import (
    EPISODE_ID_PATTERN,
    FAILURE_CAUSES,
    SAFETY_STOP_KINDS,
)

__all__ = [
    "CAPTURE_REASONS",
    "CRITICAL",
    "EPISODE_ID_PATTERN",
    "FAILURE_CAUSES",
    "SAFETY_STOP_KINDS",
    "WARNING",
]
