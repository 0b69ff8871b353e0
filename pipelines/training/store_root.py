"""A workspace's MLflow store follows the workspace when it is moved or copied.

MLflow keeps absolute artifact locations in a SQLite store: an experiment's artifact_location,
each run's artifact_uri, each model version's source and storage_location, logged models and
dataset sources. It offers no relative form: `create_experiment` resolves a relative
artifact_location against the current directory (`resolve_uri_if_local`), and the
`mlflow-artifacts:` scheme that hides the location needs an `mlflow server` in between, which a
workspace's own SQLite file does not have. A copied workspace would otherwise log new runs into
the original's `mlartifacts` and load models from there.

So the store is re-rooted when it is opened from a folder other than the one it was written
in: the workspace it was written in is the folder whose `mlartifacts` holds the experiments
realloop created (when the runs' artifact folders came along: an experiment a user pointed
at a shared folder is left alone), and every stored text value that starts below that folder
is rewritten to start below this one. It happens once (afterwards the store names this
folder), in one SQLite transaction (a crash leaves the store as it was, and the next open does
it again), and only in this workspace's own database file: the original is never opened.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

_checked: set[Path] = set()
_lock = threading.Lock()


def reroot_store(db: Path, artifacts: Path) -> str | None:
    """Rewrite the store `db` so that it names `artifacts` (the workspace's artifact folder,
    beside `db`) and the workspace holding it, when it was written in another workspace;
    return the folder it was written in, or None when nothing needed rewriting. Checked once
    per process and database file."""
    db, artifacts = Path(db), Path(artifacts)
    with _lock:
        if db in _checked or not db.is_file():
            return None
        connection = sqlite3.connect(db, timeout=30, isolation_level=None)
        try:
            moved_from = _reroot(connection, artifacts)
        finally:
            connection.close()
        _checked.add(db)
    return moved_from


def _reroot(connection: sqlite3.Connection, artifacts: Path) -> str | None:
    if not _has_table(connection, "experiments"):
        return None  # a new file MLflow has not created its tables in yet
    if not _old_roots(connection, artifacts):
        return None  # the common case: a read, no write lock taken
    connection.execute("BEGIN IMMEDIATE")  # another process may re-root it meanwhile
    try:
        old_roots = _old_roots(connection, artifacts)
        new = f"{artifacts.parent}/"
        for old in old_roots:
            for table, column in _text_columns(connection):
                _rewrite(connection, table, column, old, new)
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    return old_roots[0].rstrip("/") if old_roots else None


def _rewrite(connection: sqlite3.Connection, table: str, column: str, old: str, new: str) -> None:
    """`old` → `new` where a value starts with it, or holds it as a file:// URI or a JSON
    string ({"uri": "..."}): never inside another path (/ws/ in /mnt/ws/)."""
    c = f'"{column}"'
    connection.execute(
        f'UPDATE "{table}" SET {c} = ? || substr({c}, ?) '
        f"WHERE typeof({c}) = 'text' AND substr({c}, 1, ?) = ?",
        (new, len(old) + 1, len(old), old),
    )
    for quote in ("file://", '"'):
        connection.execute(
            f'UPDATE "{table}" SET {c} = replace({c}, ?, ?) '
            f"WHERE typeof({c}) = 'text' AND instr({c}, ?) > 0",
            (quote + old, quote + new, quote + old),
        )


def _old_roots(connection: sqlite3.Connection, artifacts: Path) -> list[str]:
    """Workspaces (as 'path/') whose artifact folder the store's experiments name, other than
    this one: realloop creates its experiments in `<workspace>/<artifacts.name>`."""
    suffix = f"/{artifacts.name}"
    roots = set()
    for (location,) in connection.execute("SELECT artifact_location FROM experiments"):
        path = (location or "").removeprefix("file://").rstrip("/")
        if path.endswith(suffix) and path != str(artifacts):
            roots.add(path.removesuffix(suffix) + "/")
    return sorted(
        root for root in roots if _came_along(connection, root + artifacts.name, artifacts)
    )


def _came_along(connection: sqlite3.Connection, old: str, artifacts: Path) -> bool:
    """Whether the runs stored under the folder `old` have their artifacts here: the folder
    moved with the store. An experiment a user pointed at a shared folder is left alone."""
    runs = connection.execute("SELECT artifact_uri FROM runs").fetchall()
    below = [
        uri.removeprefix("file://").removeprefix(old + "/")
        for (uri,) in runs
        if uri and uri.removeprefix("file://").startswith(old + "/")
    ]
    return not below or any((artifacts / relative).is_dir() for relative in below)


def _has_table(connection: sqlite3.Connection, name: str) -> bool:
    query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    return connection.execute(query, (name,)).fetchone() is not None


def _text_columns(connection: sqlite3.Connection) -> list[tuple[str, str]]:
    """Every column that can hold text: the URIs sit in several tables (experiments, runs,
    model versions, logged models, datasets, trace tags), and MLflow adds tables over time."""
    tables = [
        name
        for (name,) in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )
    ]
    columns = []
    for table in tables:
        for _, column, kind, *_ in connection.execute(f'PRAGMA table_info("{table}")'):
            kind = (kind or "").upper()
            if not kind or any(t in kind for t in ("CHAR", "TEXT", "CLOB", "JSON")):
                columns.append((table, column))
    return columns
