"""One retraining loop at a time per cell.

Two loops for the same cell (a scheduled run and one started by hand, two `realloop serve`s,
a retried deployment run next to the first) would publish two trial requests, train two
candidates on the same batches and race to move the same channel pointer. So a loop holds,
for each of its cells, an exclusive lock on `<workspace>/.realloop/locks/loop-<cell>.lock`
from its start to its end; a second loop for any of those cells refuses at once, in one line
naming the holder. The lock is an flock: a loop that dies (killed worker, power cut) releases
it with its process, so a crash never leaves a cell locked. A loop run suspended while its
trials run (flows/waiting.py) holds no process, so its waiting record counts as holding its
cells until it can no longer be resumed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from flows import waiting
from flows.console import CommandError

LOCKS_DIR = Path(".realloop/locks")  # in the workspace
# The locks this process holds, by (lock file, thread): `realloop loop` takes them before it
# starts the flow, and the flow, run in the same thread, finds them held rather than refusing
# itself. A flow run started by a worker takes them itself.
_HELD: dict[tuple[str, int], int] = {}


@contextlib.contextmanager
def cells_locked(root: Path, cells: list[str], run_id: str | None, params) -> Iterator[None]:
    """Hold every cell's loop lock (sorted order: two fleets never deadlock) or refuse."""
    taken: list[tuple[str, int]] = []
    try:
        for cell_id in sorted(set(cells)):
            path = root / LOCKS_DIR / f"loop-{cell_id}.lock"
            key = (str(path), threading.get_ident())
            if key in _HELD:
                _note_holder(_HELD[key], run_id)
                continue
            _HELD[key] = _acquire(path, cell_id, run_id)
            taken.append(key)
        _refuse_if_suspended(root, cells, run_id, params)
        yield
    finally:
        for key in taken:
            os.close(_HELD.pop(key))  # closing releases the flock


def _acquire(path: Path, cell_id: str, run_id: str | None) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise CommandError(
            f"{cell_id}: another loop is running for this cell ({holder}; lock {path}); "
            "this one refuses: wait for it to end, or stop it"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    _note_holder(fd, run_id)
    return fd


def _note_holder(fd: int, run_id: str | None) -> None:
    """Who holds it, for the refusal message of the next one (the lock is the flock)."""
    since = datetime.now(UTC).isoformat(timespec="seconds")
    record = {"pid": os.getpid(), "flow_run": None if run_id is None else str(run_id)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record | {"since": since}).encode(), 0)


def _holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return "holder unknown"
    run = f", flow run {record['flow_run']}" if record.get("flow_run") else ""
    return f"pid {record.get('pid')}{run}, since {record.get('since')}"


def _refuse_if_suspended(root: Path, cells: list[str], run_id: str | None, params) -> None:
    for record in waiting.records(root, params):
        if record["flow_run_id"] == str(run_id):
            continue  # this very run, resumed
        for cell_id in cells:
            if cell_id in record["requests"]:
                raise CommandError(
                    f"{cell_id}: loop run {record['flow_run_id']} is suspended waiting for this "
                    "cell's trials (ingest resumes it); this one refuses: wait for it, or "
                    "cancel that flow run"
                )
