"""Logs written in place: rosbag2 (and a real cell's recorder) grows an MCAP file where it
lands and writes the footer and closing magic only when it closes the file.

Such a file is left alone while it is open: a file without its closing magic is waiting
until it has not changed for `ingest.stale_after_s` (its writer died), and only then is it
decoded and quarantined as truncated. A closed file is ingested once it has not changed for
`ingest.settle_s`. A truncated (or empty) file in quarantine whose writer carried on through
the moved inode, and which is now complete, is moved back to the landing folder to be ingested.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pipelines.contract.params import IngestParams
from pipelines.ingest.landing_layout import LOG_SUFFIX
from pipelines.ingest.mcap import MCAP_MAGIC
from pipelines.ingest.quarantine import REASON_SUFFIX, release_from_quarantine

TRUNCATED_PREFIX, EMPTY_PREFIX = "truncated MCAP", "empty file"


def is_closed_mcap(path: Path) -> bool:
    """Whether the file starts and ends with the MCAP magic: its writer wrote the footer."""
    with open(path, "rb") as stream:
        if stream.read(len(MCAP_MAGIC)) != MCAP_MAGIC:
            return False
        size = os.fstat(stream.fileno()).st_size
        if size < 2 * len(MCAP_MAGIC):
            return False
        stream.seek(size - len(MCAP_MAGIC))
        return stream.read() == MCAP_MAGIC


def still_being_written(path: Path, params: IngestParams) -> str | None:
    """Why the landed log at `path` is left for a later run, or None to ingest it now.

    A closed log modified less than `settle_s` ago is watched until it is that old (at
    most `settle_s`, once) rather than skipped: uploads land complete, and a run should not
    miss them by a second."""
    if path.suffix != LOG_SUFFIX or not _starts_as_mcap(path):
        return None  # not (yet) an MCAP log: quarantined as what it is, requeued if it grows
    age = time.time() - path.stat().st_mtime
    if not is_closed_mcap(path):
        if age >= params.stale_after_s:
            return None  # its writer is gone: decoding quarantines it as truncated
        return (
            f"still being written (no MCAP footer yet, last written {age:.0f} s ago); left "
            f"for a later run, quarantined as truncated after ingest.stale_after_s "
            f"({params.stale_after_s:g} s) without a change"
        )
    if age < params.settle_s:
        before = _state(path)
        time.sleep(params.settle_s - age)
        if _state(path) != before:
            return (
                f"closed but still changing within ingest.settle_s ({params.settle_s:g} s); "
                "left for a later run"
            )
    return None


def requeue_completed(quarantine: Path, landing: Path, params: IngestParams) -> list[Path]:
    """Move each quarantined truncated log that is now closed and settled back to `landing`;
    return where each went."""
    if not quarantine.is_dir():
        return []
    moved = []
    for reason_file in sorted(quarantine.glob(f"*{LOG_SUFFIX}{REASON_SUFFIX}")):
        log = reason_file.with_name(reason_file.name.removesuffix(REASON_SUFFIX))
        if not _truncated(reason_file) or not log.is_file():
            continue
        if not is_closed_mcap(log) or time.time() - log.stat().st_mtime < params.settle_s:
            continue
        moved.append(release_from_quarantine(log, landing))
    return moved


def _truncated(reason_file: Path) -> bool:
    """Quarantined as cut short (or caught empty, between its writer's open and first write)."""
    try:
        with open(reason_file, encoding="utf-8") as stream:
            return stream.readline().startswith((TRUNCATED_PREFIX, EMPTY_PREFIX))
    except (OSError, UnicodeDecodeError):
        return False


def _starts_as_mcap(path: Path) -> bool:
    with open(path, "rb") as stream:
        return stream.read(len(MCAP_MAGIC)) == MCAP_MAGIC


def _state(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns
