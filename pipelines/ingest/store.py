"""The store: the dataset folder and the files ingest keeps next to it.

    <dataset>/episodes/<source_sha256>.parquet   one row per episode of that source file
    <dataset>/steps/<source_sha256>.parquet      one row per control step of those episodes
    <dataset>/attachments/<sha256>.<ext>         capture snapshots, content-addressed
    <dataset>/../ingest-manifest.jsonl           one line per landed file per run (append-only)
    <dataset>/../.ingest.lock                    held around every check-and-publish
    <dataset>/../.ingest-tmp/                    staged Parquet, never inside the dataset
    <dataset>/../.ingest-index-<name>.jsonl      episode id → content digest, a cache

Files are written to a temporary name, fsynced and moved into place (never half-written);
`read_dataset` reads back the sources whose episodes file exists (those fully ingested).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.contract import schema
from pipelines.ingest.digests import episode_digests
from pipelines.ingest.disk import on_disk_full, replace_across
from pipelines.ingest.report import INGESTED, FileResult
from pipelines.ingest.tables import conform

EPISODES_DIR, STEPS_DIR, ATTACHMENTS_DIR = "episodes", "steps", "attachments"
PARQUET_COMPRESSION = "zstd"
MANIFEST_NAME = "ingest-manifest.jsonl"
LOCK_NAME = ".ingest.lock"
TMP_DIR_NAME = ".ingest-tmp"
# Columns that differ between two ingest runs of the same file: left out of content hashes.
RUN_COLUMNS = ("ingest_run_id", "ingested_at")
_TMP_PREFIX = ".ingest-"
_STALE_TMP_S = 3600.0


# --- the dataset's neighbours: lock, temp folder, manifest, episode index ---------------


# Per process: index file → (inode, bytes read, the last of them, {sha256: {episode: digest}}).
_INDEX_CACHE: dict[Path, tuple[int | None, int, bytes, dict[str, dict[str, str]]]] = {}
_INDEX_GUARD = threading.Lock()


class _Store:
    """The dataset folder and the files ingest keeps next to it."""

    def __init__(self, dataset: Path):
        self.dataset = Path(dataset)
        self.parent = self.dataset.parent
        self.episodes = self.dataset / EPISODES_DIR
        self.steps = self.dataset / STEPS_DIR
        self.attachments = self.dataset / ATTACHMENTS_DIR
        self.tmp = self.parent / TMP_DIR_NAME
        self.lock_path = self.parent / LOCK_NAME
        self.manifest = self.parent / MANIFEST_NAME
        self.index = self.parent / f".ingest-index-{self.dataset.name}.jsonl"

    def prepare(self) -> None:
        for folder in (self.episodes, self.steps, self.attachments, self.tmp):
            folder.mkdir(parents=True, exist_ok=True)

    def remove_stale_temporaries(self) -> None:
        """Temporaries left by a crashed run (older than an hour, so never a live run's).
        Those in the temp folder are invisible to the dataset anyway; older versions of
        ingest left theirs inside the dataset's folders."""
        for folder, pattern in (
            (self.tmp, "*"),
            (self.episodes, f"{_TMP_PREFIX}*.tmp"),
            (self.steps, f"{_TMP_PREFIX}*.tmp"),
            (self.attachments, f"{_TMP_PREFIX}*.tmp"),
        ):
            _remove_old(folder, pattern)

    def has_source(self, sha: str) -> bool:
        return (self.episodes / f"{sha}.parquet").is_file()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The dataset's check-and-publish lock (flock: released if the process dies)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def record(self, result: FileResult, run_id: str) -> FileResult:
        """Append the file's manifest line (hold the lock)."""
        row = {
            "source": result.source,
            "sha256": result.sha256 or None,
            "size": result.size,
            "result": result.result,
            "reason": result.reason,
            "run_id": run_id,
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "episodes": result.episodes,
            "steps": result.steps,
            "moved_to": result.moved_to,
        }
        if result.unknown_topics:
            row["unknown_topics"] = result.unknown_topics
        with on_disk_full("recording the manifest", self.manifest):
            _append_line(self.manifest, row)
        return result

    def episode_index(self) -> dict[str, tuple[str, str]]:
        """episode id → (source sha256, content digest) for every source in the dataset
        (hold the lock). Read from the index file, which is a cache: sources it lacks are
        digested from their Parquet files and added; lines of sources no longer in the
        dataset are ignored."""
        with _INDEX_GUARD:
            known = self._read_index()
        present = sorted(p.stem for p in self.episodes.glob("*.parquet"))
        for sha in present:
            if sha not in known:
                known[sha] = _stored_digests(self, sha)
                self.add_to_index(sha, known[sha])
        index: dict[str, tuple[str, str]] = {}
        for sha in present:
            for episode_id, digest in known.get(sha, {}).items():
                index.setdefault(episode_id, (sha, digest))
        return index

    def _read_index(self) -> dict[str, dict[str, str]]:
        """The index file's entries, reading only what was appended since this process last
        read it (the cache is dropped when the file is another one or was rewritten)."""
        try:
            info = self.index.stat()
        except FileNotFoundError:
            _INDEX_CACHE.pop(self.index, None)
            return {}
        inode, offset, tail, known = _INDEX_CACHE.get(self.index, (None, 0, b"", {}))
        with self.index.open("rb") as stream:
            if inode != info.st_ino or info.st_size < offset:
                offset, tail, known = 0, b"", {}
            elif offset:
                stream.seek(offset - len(tail))
                if stream.read(len(tail)) != tail:
                    offset, tail, known = 0, b"", {}
            known = dict(known)
            stream.seek(offset)
            data = stream.read(info.st_size - offset)
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].splitlines():
            try:
                entry = json.loads(line)
                known[entry["sha256"]] = dict(entry["episodes"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash: that source is digested again
        if whole:
            offset, tail = offset + whole, data[max(0, whole - 256) : whole]
        _INDEX_CACHE[self.index] = (info.st_ino, offset, tail, known)
        return known

    def add_to_index(self, sha: str, digests: dict[str, str]) -> None:
        _append_line(self.index, {"sha256": sha, "episodes": digests})


def _stored_digests(store: _Store, sha: str) -> dict[str, str]:
    episodes = read_table(store.episodes / f"{sha}.parquet", schema.EPISODES_SCHEMA)
    steps_path = store.steps / f"{sha}.parquet"
    steps = (
        read_table(steps_path, schema.STEPS_SCHEMA)
        if steps_path.is_file()
        else schema.STEPS_SCHEMA.empty_table()
    )
    return episode_digests(episodes, steps)


def read_manifest(dataset: Path) -> list[dict]:
    """The manifest lines next to `dataset`, oldest first (a line cut by a crash skipped)."""
    path = Path(dataset).parent / MANIFEST_NAME
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _append_line(path: Path, row: dict) -> None:
    """Append one JSON line with one write; a line left unfinished by a crash is closed
    first so that it cannot swallow this one."""
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)  # a disk that filled up mid-line: no half line left
            raise
    finally:
        os.close(fd)


def record_in_manifest(dataset: Path, result: FileResult, run_id: str) -> FileResult:
    """Append a manifest line for a file handled outside `ingest_file` (e.g. quarantined by
    a source that refused its name)."""
    store = _Store(dataset)
    store.parent.mkdir(parents=True, exist_ok=True)
    with store.locked():
        return store.record(result, run_id)


def record_unrecorded(dataset: Path, run_id: str) -> list[str]:
    """The "ingested" manifest line of each source in the dataset that has none: its run was
    killed between moving the source's tables into the dataset and writing its line (the data
    is whole; found by tests/faults/test_worker_killed.py). Once per run, before any file;
    returns their sha256s."""
    store = _Store(dataset)
    if not store.episodes.is_dir():
        return []
    with store.locked():
        recorded = {r.get("sha256") for r in read_manifest(dataset) if r.get("result") == INGESTED}
        missing = sorted(p.stem for p in store.episodes.glob("*.parquet") if p.stem not in recorded)
        for sha in missing:
            episodes = read_table(store.episodes / f"{sha}.parquet", schema.EPISODES_SCHEMA)
            steps = store.steps / f"{sha}.parquet"
            source = episodes.column("source_uri")[0].as_py() if episodes.num_rows else sha
            reason = "published by a run that stopped before recording it; recorded by the next"
            counts = (episodes.num_rows, pq.read_metadata(steps).num_rows if steps.is_file() else 0)
            result = FileResult(source, sha, 0, INGESTED, reason, *counts, None)
            store.record(result, run_id)
    return missing


# --- content hashes -----------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    with Path(path).open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def dataset_content_hash(dataset: Path, exclude: Iterable[str] = RUN_COLUMNS) -> str:
    """sha256 over every file under the dataset folder, by relative path; the episodes files
    with the `exclude` columns left out (by default which run wrote them and when).

    With exclude=() this is a plain hash of every file's bytes.
    """
    dataset = Path(dataset)
    exclude = tuple(exclude)
    h = hashlib.sha256()
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        relative = path.relative_to(dataset).as_posix()
        if exclude and relative.startswith(f"{EPISODES_DIR}/") and path.suffix == ".parquet":
            table = read_table(path, schema.EPISODES_SCHEMA).drop_columns(list(exclude))
            rows = table.select([n for n in table.schema.names if n != "start_time"]).to_pylist()
            starts = table.column("start_time").cast(pa.int64()).to_pylist()
            text = json.dumps(
                [
                    _without_null_trial(r) | {"start_time": s}
                    for r, s in zip(rows, starts, strict=True)
                ]
            )
            digest = hashlib.sha256(text.encode()).hexdigest()
        else:
            digest = sha256_file(path)
        h.update(f"{relative}\0{digest}\n".encode())
    return h.hexdigest()


def _without_null_trial(row: dict) -> dict:
    """A production row hashes as it did before the trial columns existed."""
    return {k: v for k, v in row.items() if v is not None or k not in schema.TRIAL_COLUMNS}


# --- Parquet files --------------------------------------------------------------------------


def storage_schema(target: pa.Schema) -> pa.Schema:
    """The schema as stored in Parquet: nullable vectors as variable-size lists.

    pyarrow's Parquet reader cannot read a null fixed-size list (apache/arrow#35692, open in
    pyarrow 25), so `corrected_action` and `part_extent_m` are stored as `list<float32>`;
    `read_dataset` casts them back to the contract's `list<float32>[n]`.
    """
    return pa.schema(
        [
            pa.field(f.name, pa.list_(f.type.value_type), f.nullable)
            if f.nullable and pa.types.is_fixed_size_list(f.type)
            else f
            for f in target
        ]
    )


def _parquet_writer(table: pa.Table, target: pa.Schema, where: str):
    """Conform `table` and return a function that writes it as Parquet to a stream, and a
    function that reads a written file back against the contract."""
    stored = conform(table, target, where).cast(storage_schema(target))

    def write(stream) -> None:
        pq.write_table(stored, stream, compression=PARQUET_COMPRESSION)

    def check(tmp: Path) -> None:
        back = read_table(tmp, target)
        if not back.schema.equals(target) or back.num_rows != table.num_rows:
            raise RuntimeError(f"{where}: written table differs from the data contract")

    return write, check


def write_table(table: pa.Table, path: Path, target: pa.Schema) -> None:
    """Write Parquet (zstd) to a temporary name, read it back against the contract, then
    move it into place."""
    write, check = _parquet_writer(table, target, path.parent.name)
    _write_atomically(path, write, check)


def _stage(store: _Store, table: pa.Table, target: pa.Schema) -> Path:
    """Write a table to a new file in the hidden temp folder, checked; return its path."""
    what = EPISODES_DIR if target is schema.EPISODES_SCHEMA else STEPS_DIR
    write, check = _parquet_writer(table, target, what)
    tmp = store.tmp / f"{what}.{os.getpid()}.{uuid.uuid4().hex[:12]}.parquet.tmp"
    try:
        with tmp.open("wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        check(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def read_table(path: Path, target: pa.Schema) -> pa.Table:
    """One dataset Parquet file, cast to the contract schema exactly."""
    return pq.read_table(path, schema=storage_schema(target)).cast(target)


def _write_atomically(path: Path, write, check=None, tmp_dir: Path | None = None) -> None:
    folder = tmp_dir or path.parent
    tmp = folder / f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with tmp.open("wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        if check:
            check(tmp)
        replace_across(tmp, path)  # the temp folder may be on another disk than the dataset
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dirs(*folders: Path) -> None:
    """Make renames into these folders durable (a power cut, not only a killed process)."""
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_old(folder: Path, pattern: str) -> None:
    cutoff = time.time() - _STALE_TMP_S
    for tmp in folder.glob(pattern):
        try:
            if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                tmp.unlink()
        except FileNotFoundError:
            pass


# --- reading the dataset back -------------------------------------------------------------


def read_dataset(dataset: Path, sources: list[str] | None = None) -> tuple[pa.Table, pa.Table]:
    """(episodes, steps) of the fully ingested sources, all or only the given sha256s.

    Files written before a nullable column joined the contract (the trial columns) read back
    with that column null: `read_table` reads against the contract's schema."""
    dataset = Path(dataset)
    episodes_dir, steps_dir = dataset / EPISODES_DIR, dataset / STEPS_DIR
    if sources is None:
        shas = sorted(p.stem for p in episodes_dir.glob("*.parquet"))
    else:
        shas = list(dict.fromkeys(sources))
        missing = [s for s in shas if not (episodes_dir / f"{s}.parquet").is_file()]
        if missing:
            raise FileNotFoundError(f"{dataset}: sources not in the dataset: {', '.join(missing)}")
    return (
        _read_tables([episodes_dir / f"{s}.parquet" for s in shas], schema.EPISODES_SCHEMA),
        _read_tables([steps_dir / f"{s}.parquet" for s in shas], schema.STEPS_SCHEMA),
    )


def _read_tables(paths: list[Path], target: pa.Schema) -> pa.Table:
    if not paths:
        return target.empty_table()
    return pa.concat_tables([read_table(p, target) for p in paths])
