"""Quality: Great Expectations suites and validation of dataset versions, drift against the
production model's training data, failure-mode triage."""

from pipelines.quality.drift import describe_measures, drift_report
from pipelines.quality.expectations import (
    CAPTURE_REASONS,
    EPISODE_ID_PATTERN,
    FAILURE_CAUSES,
    SAFETY_STOP_KINDS,
)
from pipelines.quality.triage import triage_dataset
from pipelines.quality.validate import admit_batch, validate_dataset

__all__ = [
    "CAPTURE_REASONS",
    "EPISODE_ID_PATTERN",
    "FAILURE_CAUSES",
    "SAFETY_STOP_KINDS",
    "admit_batch",
    "describe_measures",
    "drift_report",
    "triage_dataset",
    "validate_dataset",
]
