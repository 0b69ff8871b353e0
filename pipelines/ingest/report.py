"""What became of each landed file (a FileResult, one manifest line) and of a whole ingest run
(an IngestReport, what the flow returns and the command line prints)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

INGESTED, SKIPPED, QUARANTINED = "ingested", "skipped", "quarantined"
WAITING = "waiting"  # a log its writer has not closed yet: examined again by the next run


@dataclass(frozen=True)
class FileResult:
    """What became of one landed file."""

    source: str  # URI as given: a local path, or s3://... from the sources module
    sha256: str  # "" only when the file was never read (its path escapes the landing folder)
    size: int
    result: str  # "ingested" | "skipped" | "quarantined" | "waiting"
    reason: str | None  # why it was skipped or quarantined (or what was left out of it)
    episodes: int
    steps: int
    moved_to: str | None  # where quarantine put it
    unknown_topics: dict[str, int] = field(default_factory=dict)  # extra topic → messages

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class IngestReport:
    run_id: str
    ingested: list[dict] = field(default_factory=list)  # source, sha256, size, episodes, steps
    skipped: list[dict] = field(default_factory=list)  # source, sha256, size, reason
    quarantined: list[dict] = field(default_factory=list)  # source, sha256, reason, moved_to
    waiting: list[dict] = field(default_factory=list)  # source, size, reason (not yet landed)
    unknown_topics: dict[str, int] = field(default_factory=dict)  # over all ingested files

    @classmethod
    def from_results(cls, run_id: str, results: Iterable[FileResult]) -> IngestReport:
        report = cls(run_id)
        for result in results:
            report.add(result)
        return report

    def add(self, result: FileResult) -> None:
        row = {"source": result.source, "sha256": result.sha256, "size": result.size}
        if result.result == INGESTED:
            row |= {"episodes": result.episodes, "steps": result.steps}
            if result.reason:
                row["reason"] = result.reason
            if result.unknown_topics:
                row["unknown_topics"] = dict(result.unknown_topics)
            self.ingested.append(row)
            for topic, count in result.unknown_topics.items():
                self.unknown_topics[topic] = self.unknown_topics.get(topic, 0) + count
        elif result.result == SKIPPED:
            self.skipped.append(row | {"reason": result.reason})
        elif result.result == QUARANTINED:
            self.quarantined.append(row | {"reason": result.reason, "moved_to": result.moved_to})
        elif result.result == WAITING:
            self.waiting.append(row | {"reason": result.reason})
        else:
            raise ValueError(f"unknown ingest result {result.result!r}")

    def as_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "files_landed": len(self.ingested) + len(self.skipped) + len(self.quarantined),
            "files_ingested": len(self.ingested),
            "episodes_ingested": sum(f["episodes"] for f in self.ingested),
            "steps_ingested": sum(f["steps"] for f in self.ingested),
            "files_skipped": len(self.skipped),
            "files_quarantined": len(self.quarantined),
            "files_waiting": len(self.waiting),
            "unknown_topics": dict(sorted(self.unknown_topics.items())),
            "ingested": list(self.ingested),
            "skipped": list(self.skipped),
            "quarantined": list(self.quarantined),
            "waiting": list(self.waiting),
        }
