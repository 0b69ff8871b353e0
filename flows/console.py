"""What every command shares: JSON or human output, one-line errors, progress bars."""

from __future__ import annotations

import errno
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

stderr = Console(stderr=True)
stdout = Console()


class CommandError(Exception):
    """An expected failure: printed as one line on stderr, exit status 1."""


def fails_cleanly(command: Callable) -> Callable:
    """Turn expected errors into `realloop: <reason>` on stderr and a non-zero exit."""

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (CommandError, FileNotFoundError, LookupError, ValueError) as exc:
            message = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            print(f"realloop: {message}", file=sys.stderr)
            raise typer.Exit(1) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):  # a full disk is expected too
                raise
            print(f"realloop: {str(exc).splitlines()[0]}", file=sys.stderr)
            raise typer.Exit(1) from None

    return wrapper


@contextmanager
def stopped_like_ctrl_c() -> Iterator[None]:
    """Inside, SIGTERM (`kill`, a scheduler's stop) acts as Ctrl-C: a KeyboardInterrupt, so the
    `finally` blocks run and the processes a command started are stopped, not left orphaned.
    Outside the main thread (where Python delivers signals) it changes nothing."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def emit(payload: dict[str, Any], as_json: bool, human: Callable[[dict], None]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        human(payload)


@contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Callable[[str, int, int], None]]:
    """Yields update(description, done, total); draws on stderr so --json stays clean."""
    if not enabled or not stderr.is_terminal:
        yield lambda *_: None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(description: str, done: int, total: int) -> None:
            if description not in tasks:
                tasks[description] = bar.add_task(description, total=total)
            bar.update(tasks[description], completed=done)

        yield update
