"""Quarantine: a file that cannot be ingested is moved (never deleted, never overwritten) into
the quarantine folder, next to `<name>.reason.txt` whose first line says why."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pipelines.ingest.disk import on_disk_full
from pipelines.ingest.store import _fsync_dirs, _write_atomically, sha256_file

REASON_SUFFIX = ".reason.txt"


def quarantine_file(
    path: Path,
    reason: str,
    quarantine: Path,
    run_id: str,
    sha256: str | None = None,
    *,
    source: str | None = None,
    move: bool = True,
) -> dict:
    """Move `path` into `quarantine`, next to `<name>.reason.txt`; never overwrite.

    The reason file is written first: a crash before the move leaves the file in landing,
    and the next run quarantines it under the same name. `move=False` writes only the reason
    file (for a path that must not be touched). A symlink is moved as the link, never
    followed. Raises FileNotFoundError (and leaves no reason file) when `path` is gone.
    """
    with on_disk_full("quarantining", quarantine):
        return _quarantine(path, reason, quarantine, run_id, sha256, source, move)


def _quarantine(
    path: Path,
    reason: str,
    quarantine: Path,
    run_id: str,
    sha256: str | None,
    source: str | None,
    move: bool,
) -> dict:
    quarantine.mkdir(parents=True, exist_ok=True)
    path = Path(path)
    # Read only a regular file (never through a symlink, never a pipe that would block).
    readable = move and os.path.lexists(path) and stat.S_ISREG(os.lstat(path).st_mode)
    sha = sha256 or (sha256_file(path) if readable else "")
    size = path.lstat().st_size if move and os.path.lexists(path) else 0
    reason = " ".join(reason.split())  # one line
    source = source or str(path.resolve() if readable else path.absolute())
    with _quarantine_lock(quarantine):
        if move and not os.path.lexists(path):
            raise FileNotFoundError(f"{path}: gone before it could be quarantined")
        dest = _free_name(quarantine, path.name, sha)
        note = (
            f"{reason}\nsource: {source}\nsha256: {sha}\n"
            f"time: {datetime.now(UTC).isoformat(timespec='seconds')}\ningest_run_id: {run_id}\n"
            f"moved_to: {dest if move else '(not moved: outside the landing folder)'}\n"
        )
        reason_path = dest.with_name(dest.name + REASON_SUFFIX)
        _write_atomically(reason_path, lambda stream: stream.write(note.encode()))
        if move:
            try:
                os.rename(path, dest)
            except OSError as exc:
                if not os.path.lexists(path):
                    reason_path.unlink(missing_ok=True)
                    raise FileNotFoundError(f"{path}: gone before it could be quarantined") from exc
                _move_across(path, dest, reason_path)  # another filesystem
            _fsync_dirs(quarantine)
    return {
        "source": source,
        "sha256": sha,
        "size": size,
        "reason": reason,
        "moved_to": str(dest) if move else None,
    }


def _move_across(path: Path, dest: Path, reason_path: Path) -> None:
    """Move a file to another filesystem. A copy cut short (the disk filled up) is removed
    with its reason file: the file stays in landing, whole, for the next run."""
    try:
        shutil.move(path, dest)
    except OSError:
        if os.path.lexists(path):
            Path(dest).unlink(missing_ok=True)
            reason_path.unlink(missing_ok=True)
        raise


def release_from_quarantine(path: Path, landing: Path) -> Path:
    """Move a quarantined file back into `landing` (under a free name) and drop its reason
    file, so that the next ingest examines it again; return its new path."""
    with _quarantine_lock(path.parent):
        stem, suffix = path.stem, path.suffix
        names = [path.name, *(f"{stem}.requeued-{i}{suffix}" for i in range(2, 1000))]
        dest = next(landing / name for name in names if not os.path.lexists(landing / name))
        landing.mkdir(parents=True, exist_ok=True)
        os.rename(path, dest)  # the landing and quarantine folders share the workspace's disk
        path.with_name(path.name + REASON_SUFFIX).unlink(missing_ok=True)
        _fsync_dirs(landing, path.parent)
    return dest


@contextmanager
def _quarantine_lock(quarantine: Path) -> Iterator[None]:
    fd = os.open(quarantine / ".quarantine.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _free_name(folder: Path, name: str, sha: str) -> Path:
    """`name`, else `<stem>.<sha12><suffix>`, else numbered; a name whose reason file was
    left by a crash before the move, for this same content, is taken up again."""
    stem, suffix = Path(name).stem, Path(name).suffix
    candidates = [name, f"{stem}.{sha[:12]}{suffix}"]
    candidates += [f"{stem}.{sha[:12]}-{i}{suffix}" for i in range(2, 1000)]
    for candidate in candidates:
        dest = folder / candidate
        if os.path.lexists(dest):
            continue
        reason = dest.with_name(candidate + REASON_SUFFIX)
        if not reason.exists() or _orphan_of(reason, sha):
            return dest
    raise FileExistsError(f"{folder}: no free quarantine name for {name}")


def _orphan_of(reason: Path, sha: str) -> bool:
    try:
        lines = reason.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return (
        bool(sha)
        and f"sha256: {sha}" in lines
        and not any(line.startswith("moved_to: (not moved") for line in lines)
    )
