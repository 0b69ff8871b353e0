"""The validate stage: Great Expectations suites over each ingested batch, results people read
(`run` says how, and what is kept)."""

from pipelines.quality.validate.admissions import admit_batch, read_admissions
from pipelines.quality.validate.results import BatchResult, ValidationReport
from pipelines.quality.validate.run import validate_batch, validate_dataset, warm_up
from pipelines.quality.validate.stored import validation_root

__all__ = [
    "BatchResult",
    "ValidationReport",
    "admit_batch",
    "read_admissions",
    "validate_batch",
    "validate_dataset",
    "validation_root",
    "warm_up",
]
