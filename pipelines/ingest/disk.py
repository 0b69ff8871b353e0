"""Disk full: one error that names the step and the path, raised where ingest writes.

A full disk (ENOSPC, or a quota: EDQUOT) can stop ingest at any write: staging the decoded
Parquet, publishing it into the dataset, quarantining a file, recording the manifest, writing
the dataset version (DVC cache, git) or pushing it to the DVC remote. Each of those writes
already leaves nothing half-written (a temporary name, removed when the write fails; an
appended line cut back); `on_disk_full(step, path)` turns the OSError into a `DiskFullError`
whose message is the one line the user reads, so the command can stop at once instead of
failing file after file. The landing zone is never written to, so every landed file is
still there for the next run, which completes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# What git and DVC print when a write of theirs found the disk full (they exit or raise
# with the text, not the errno).
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


class DiskFullError(OSError):
    """The disk (or quota) is full; `str()` is the one line to print."""

    def __init__(self, step: str, path: str | os.PathLike):
        self.step, self.where = step, str(path)
        line = f"ingest: disk full while {step} at {self.where}: free space and run again"
        super().__init__(errno.ENOSPC, line)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # crosses process boundaries (Dask workers) as what it is
        return (DiskFullError, (self.step, self.where))


def is_disk_full(exc: BaseException) -> bool:
    """A disk-full OSError, or a tool's error whose text says so; also one that caused it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in DISK_FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextmanager
def on_disk_full(step: str, path: str | os.PathLike) -> Iterator[None]:
    """Raise DiskFullError(step, path) for a disk-full error inside the block; an inner
    DiskFullError (a more precise step) passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if is_disk_full(exc):
            raise DiskFullError(step, path) from exc
        raise


def replace_across(src: Path, dest: Path) -> None:
    """os.replace, also when `dest` is on another filesystem than `src` (a dataset folder
    mounted on its own disk: EXDEV): then copied to a temporary name next to `dest`, fsynced
    and renamed, so `dest` is never seen half-written; the temporary goes if the copy fails."""
    try:
        os.replace(src, dest)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    import shutil
    import uuid

    tmp = dest.parent / f".ingest-{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with Path(src).open("rb") as source, tmp.open("wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
            target.flush()
            os.fsync(target.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    Path(src).unlink(missing_ok=True)
