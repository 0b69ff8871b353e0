"""What validation says: one batch's result, and a dataset version's report of them all."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchResult:
    batch: str  # the source sha256
    passed: bool  # no critical expectation failed
    failures: list[str]  # critical, one line each: column, what broke, how many
    expectations: int  # how many were evaluated
    warnings: list[str] = field(default_factory=list)  # one line each, never exclude
    admitted: dict | None = None  # the admission honoured for a failed batch
    cached: bool = False  # read from a stored result: GX did not run for it
    details: dict = field(default_factory=dict)  # source_uri, episodes, steps, captures

    @property
    def trainable(self) -> bool:
        return self.passed or self.admitted is not None


@dataclass(frozen=True)
class ValidationReport:
    batches: list[BatchResult]
    dataset_version: str | None = None
    results: str | None = None  # <validation>/<dataset_version>/report.json
    data_docs: str | None = None  # <validation>/<dataset_version>/index.html

    @property
    def passed_batches(self) -> list[str]:
        """What training may use: batches without critical failures, and re-admitted ones."""
        return [b.batch for b in self.batches if b.trainable]

    @property
    def failed_batches(self) -> list[str]:
        """Batches failing a critical expectation, admitted or not."""
        return [b.batch for b in self.batches if not b.passed]

    @property
    def excluded_batches(self) -> list[str]:
        return [b.batch for b in self.batches if not b.trainable]

    def as_dict(self) -> dict:
        failed = [
            {"batch": b.batch, "failures": b.failures, "admitted": b.admitted is not None}
            for b in self.batches
            if not b.passed
        ]
        return {
            "dataset_version": self.dataset_version,
            "batches": len(self.batches),
            "passed": sum(b.passed for b in self.batches),
            "failed": failed,
            "warnings": [
                {"batch": b.batch, "warnings": b.warnings} for b in self.batches if b.warnings
            ],
            "admitted": [b.admitted | {"batch": b.batch} for b in self.batches if b.admitted],
            "excluded_from_training": self.excluded_batches,
            "validated": sum(not b.cached for b in self.batches),
            "cached": sum(b.cached for b in self.batches),
            "results": self.results,
            "data_docs": self.data_docs,
        }
