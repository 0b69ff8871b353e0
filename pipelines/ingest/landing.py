"""Ingest: landed cell logs (ROS 2 MCAP, or JSONL/Parquet exports) → the canonical dataset.

docs/data-contract.md is the reference for every mapping and every quarantine reason here.

`ingest_file` is the unit of work (one Prefect task per file); `ingest_landing` loops over a
landing folder. Per file: refuse paths that escape the landing folder, files over
`ingest.max_file_bytes` and empty files; hash; skip a sha256 already in the dataset; decode
and check against the contract; stage both tables in the hidden temp folder. Then, holding
the lock: look again (another run may have published the same file meanwhile), check the
file's episode ids against the dataset's, and publish with os.replace, steps first and
episodes last, so `episodes/<sha>.parquet` existing means that source is fully ingested and
readers never see a partial file. A SIGKILL anywhere leaves either nothing of the file in
the dataset, or its steps without its episodes; either way the next run completes it with
the same bytes (the tables are a pure function of the file, the run id and the run time).

A file that cannot be ingested is moved (never deleted, never overwritten) into quarantine,
next to `<name>.reason.txt` whose first line says why. Ingested files stay where they
landed; a later run skips them by their sha256. Every file's outcome is also appended to the
manifest, so each landed file is accounted for in exactly one place.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract import schema
from pipelines.contract.params import CellParams, IngestParams
from pipelines.ingest.captures import (
    Capture,
    _captures_near,
    ingest_captures,
    mark_edge_cases,
    store_attachment,
)
from pipelines.ingest.decoded import QuarantineError
from pipelines.ingest.digests import episode_digests
from pipelines.ingest.disk import on_disk_full, replace_across
from pipelines.ingest.exports import build_export_tables, read_export
from pipelines.ingest.in_place import requeue_completed, still_being_written
from pipelines.ingest.landing_layout import JSONL_SUFFIX, LOG_SUFFIX, PARQUET_SUFFIX, landing_files
from pipelines.ingest.log_tables import build_tables
from pipelines.ingest.mcap import DecodeLimits
from pipelines.ingest.quarantine import quarantine_file
from pipelines.ingest.report import (
    INGESTED,
    QUARANTINED,
    SKIPPED,
    WAITING,
    FileResult,
    IngestReport,
)
from pipelines.ingest.shift_log import read_log
from pipelines.ingest.store import _fsync_dirs, _stage, _Store, record_unrecorded, sha256_file
from pipelines.ingest.tables import Provenance, check_values

ALREADY_INGESTED = "already ingested (same sha256)"
STAGING = "staging the decoded Parquet"


# --- one landed file → the dataset ------------------------------------------------------


def ingest_file(
    path: Path,
    landing: Path,
    dataset: Path,
    quarantine: Path,
    cell: CellParams,
    params: IngestParams,
    run_id: str,
    source_uri: str | None = None,
    *,
    ingested_at: datetime | None = None,
    captures: Mapping[str, list[Capture]] | None = None,
    in_place: bool = False,
) -> FileResult:
    """Ingest one landed file (an MCAP log or a JSONL/Parquet export): into the dataset, or
    into quarantine with a reason, or skipped because its content is there already.

    `source_uri` is recorded as the episodes' source (default: the file's resolved path).
    `ingested_at` defaults to now; a flow passes its run's start so that all its files share
    it. `captures` (by episode id) default to the readable sidecars in `<landing>/captures/`
    and in `captures/` next to the file. Raises FileNotFoundError when the file is gone
    before it could be ingested (another run quarantined it, or it was removed): that file
    did not land after all. Safe to run concurrently, from threads or processes.
    `in_place`: the file is where its writer may still be writing it (a landing folder, not
    a downloaded copy): a log its writer has not closed is left "waiting" (see `in_place`).
    """
    path, landing, quarantine = Path(path), Path(landing), Path(quarantine)
    store = _Store(dataset)
    with on_disk_full(STAGING, store.tmp):
        store.prepare()
    escape = _escape_reason(path, landing)
    if escape:
        # Move only an entry that is itself in the landing folder (a symlink), never what it
        # points to; a `..` path is not the landing folder's to move.
        inside = path.is_symlink() and path.parent.resolve().is_relative_to(landing.resolve())
        landed = _Landed(store, path, quarantine, run_id, source_uri or str(path))
        return landed.quarantined(escape, move=inside)
    landed = _Landed(store, path, quarantine, run_id, source_uri or str(path.resolve()))
    try:
        info = path.stat()
    except FileNotFoundError:
        if not path.is_symlink():
            raise
        reason = f"not a regular file: dangling symlink to {os.readlink(path)}"
        source = source_uri or str(path.absolute())
        return _Landed(store, path, quarantine, run_id, source).quarantined(reason)
    if not stat.S_ISREG(info.st_mode):
        return landed.quarantined(f"not a regular file ({_file_kind(info.st_mode)})")
    waiting = still_being_written(path, params) if in_place else None
    if waiting:  # not recorded in the manifest: it has not landed yet
        return FileResult(landed.source, "", info.st_size, WAITING, waiting, 0, 0, None)
    landed = replace(landed, sha=sha256_file(path), size=info.st_size)
    refused = _refusal(path, landed.size, params)
    if refused:
        return landed.quarantined(refused)
    if store.has_source(landed.sha):
        with store.locked():
            return landed.skipped(ALREADY_INGESTED)
    provenance = Provenance(
        landed.source, landed.sha, run_id, ingested_at or datetime.now(UTC), _realloop_version()
    )
    try:
        episodes, steps, unknown = _decode(path, cell, params, provenance)
    except QuarantineError as exc:
        return landed.quarantined(str(exc))
    ids = episodes.column("episode_id").to_pylist()
    found = captures if captures is not None else _captures_near(path, landing, ids)
    episodes, attachment_files = mark_edge_cases(episodes, found)
    return _publish(landed, episodes, steps, attachment_files, unknown)


@dataclass(frozen=True)
class _Landed:
    """One landed file as `ingest_file` knows it so far, and where its outcome is recorded."""

    store: _Store
    path: Path
    quarantine: Path
    run_id: str
    source: str
    sha: str = ""  # "" until the file is read
    size: int = 0

    def skipped(self, reason: str) -> FileResult:
        """Record the file as skipped (hold the lock)."""
        return self.store.record(_skipped(self.source, self.sha, self.size, reason), self.run_id)

    def quarantined(self, reason: str, *, move: bool = True, locked: bool = False) -> FileResult:
        """Quarantine under the dataset lock (unless the caller holds it) and record it.

        `move=False` writes only the reason file (a path that is not the landing folder's)."""
        if not locked:
            with self.store.locked():
                return self.quarantined(reason, move=move, locked=True)
        entry = quarantine_file(
            self.path,
            reason,
            self.quarantine,
            self.run_id,
            self.sha or None,
            source=self.source,
            move=move,
        )
        result = FileResult(
            self.source,
            self.sha or entry["sha256"],
            self.size,
            QUARANTINED,
            entry["reason"],
            0,
            0,
            entry["moved_to"],
        )
        return self.store.record(result, self.run_id)


def _publish(
    landed: _Landed,
    episodes: pa.Table,
    steps: pa.Table,
    attachment_files: dict[str, list[Path]],
    unknown: dict[str, int],
) -> FileResult:
    """Stage both tables; then, holding the lock, look again, check the episode ids against
    the dataset's (leaving out episodes it holds with the same content) and publish."""
    store, sha = landed.store, landed.sha
    digests = episode_digests(episodes, steps)
    staged = _stage_both(store, episodes, steps)
    try:
        with store.locked():
            if store.has_source(sha):  # another run published it meanwhile
                return landed.skipped(ALREADY_INGESTED)
            index = store.episode_index()
            same, conflict = _held_elsewhere(index, digests, sha)
            if conflict:
                return landed.quarantined(conflict, locked=True)
            note = None
            if same:
                sources = sorted({index[e][0][:12] for e in same})
                if len(same) == len(digests):
                    reason = (
                        f"all {len(same)} episodes already in the dataset with the same content "
                        f"(from source {', '.join(sources)})"
                    )
                    return landed.skipped(reason)
                note = (
                    f"{len(same)} of {len(digests)} episodes left out: already in the dataset "
                    f"with the same content (from source {', '.join(sources)})"
                )
                episodes, steps, digests, attachment_files = _leave_out(
                    same, episodes, steps, digests, attachment_files
                )
                for tmp in staged:
                    tmp.unlink(missing_ok=True)
                staged = _stage_both(store, episodes, steps)
            _move_into_place(store, sha, staged, attachment_files, digests)
            result = FileResult(
                landed.source,
                sha,
                landed.size,
                INGESTED,
                note,
                episodes.num_rows,
                steps.num_rows,
                None,
                unknown,
            )
            return store.record(result, landed.run_id)
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)


def _stage_both(store: _Store, episodes: pa.Table, steps: pa.Table) -> list[Path]:
    """[staged steps, staged episodes] in the hidden temp folder."""
    staged: list[Path] = []
    try:
        with on_disk_full(STAGING, store.tmp):
            staged.append(_stage(store, steps, schema.STEPS_SCHEMA))
            staged.append(_stage(store, episodes, schema.EPISODES_SCHEMA))
    except BaseException:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        raise
    return staged


def _held_elsewhere(
    index: dict[str, tuple[str, str]], digests: dict[str, str], sha: str
) -> tuple[list[str], str | None]:
    """(episode ids that other sources in the dataset hold with the same content, None), or
    the reason to quarantine the file: one of its ids is held with different content."""
    same = []
    for episode_id, digest in digests.items():
        held = index.get(episode_id)
        if held is None or held[0] == sha:
            continue
        if held[1] != digest:
            reason = (
                f"episode {episode_id} already in the dataset with different content "
                f"(from source {held[0][:12]})"
            )
            return same, reason
        same.append(episode_id)
    return same, None


def _leave_out(
    same: list[str],
    episodes: pa.Table,
    steps: pa.Table,
    digests: dict[str, str],
    attachment_files: dict[str, list[Path]],
) -> tuple[pa.Table, pa.Table, dict[str, str], dict[str, list[Path]]]:
    """The file's tables, digests and attachments without the episodes in `same`."""
    ids = episodes.column("episode_id").to_pylist()
    keep = pa.array([e not in same for e in ids])
    episodes = episodes.filter(keep)
    steps = steps.filter(pc.invert(pc.is_in(steps.column("episode_id"), pa.array(same))))
    digests = {e: d for e, d in digests.items() if e not in same}
    attachment_files = {e: paths for e, paths in attachment_files.items() if e not in same}
    return episodes, steps, digests, attachment_files


def _move_into_place(
    store: _Store,
    sha: str,
    staged: list[Path],
    attachment_files: dict[str, list[Path]],
    digests: dict[str, str],
) -> None:
    """Publish (hold the lock): attachments, then steps, then episodes; then the index.
    The temp folder may be on another disk than the dataset (a dataset folder mounted on its
    own): then each file is copied in under a temporary name and renamed."""
    with on_disk_full("publishing into the dataset", store.dataset):
        for paths in attachment_files.values():
            for attachment in paths:
                store_attachment(attachment, store.attachments, store.tmp)
        # steps first, episodes last: an episodes file means its source is complete
        replace_across(staged[0], store.steps / f"{sha}.parquet")
        replace_across(staged[1], store.episodes / f"{sha}.parquet")
        _fsync_dirs(store.attachments, store.steps, store.episodes)
    with on_disk_full("recording the episode index", store.index):
        store.add_to_index(sha, digests)


def _decode(
    path: Path, cell: CellParams, params: IngestParams, provenance: Provenance
) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """(episodes, steps, unknown topics or columns) of a log or an export, values checked."""
    if path.suffix == LOG_SUFFIX:
        log = read_log(path, DecodeLimits(**asdict(params.decode_limits)))
        episodes, steps = build_tables(
            log, cell, params.min_steps, provenance, max_clock_jump_s=params.max_clock_jump_s
        )
        unknown = log.unknown_topics
    else:
        export = read_export(path)
        episodes, steps = build_export_tables(
            export, params.min_steps, provenance, max_clock_jump_s=params.max_clock_jump_s
        )
        unknown = export.unknown_columns
    check_values(episodes, steps, cell, params)
    return episodes, steps, unknown


def _refusal(path: Path, size: int, params: IngestParams) -> str | None:
    """Reasons to quarantine a file before reading it."""
    if path.suffix not in (LOG_SUFFIX, JSONL_SUFFIX, PARQUET_SUFFIX):
        return (
            f"unsupported file type {path.suffix or '(none)'!r}: ingest reads "
            f"{LOG_SUFFIX} logs and {JSONL_SUFFIX}/{PARQUET_SUFFIX} exports"
        )
    if size > params.max_file_bytes:
        return f"file too large: {size} bytes, over ingest.max_file_bytes ({params.max_file_bytes})"
    if size == 0:
        return "empty file (0 bytes)"
    return None


def _escape_reason(path: Path, landing: Path) -> str | None:
    """A path that leads outside the landing folder (through `..` or a symlink)."""
    root = landing.resolve()
    real = path.resolve()
    if real == root or not real.is_relative_to(root):
        return f"file name escapes the landing folder: {path} resolves to {real}, outside {root}"
    return None


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _skipped(source: str, sha: str, size: int, reason: str) -> FileResult:
    return FileResult(source, sha, size, SKIPPED, reason, 0, 0, None)


# --- a landing folder → the dataset -----------------------------------------------------


def ingest_landing(
    landing: Path,
    dataset: Path,
    quarantine: Path,
    cell: CellParams,
    params: IngestParams,
    run_id: str,
    progress: Callable[[int, int], None] | None = None,
    *,
    ingested_at: datetime | None = None,
) -> IngestReport:
    """Ingest every new log and export under `landing`; quarantine what cannot be ingested.

    `progress(done, total)` is called after each file.
    """
    landing, dataset, quarantine = Path(landing), Path(dataset), Path(quarantine)
    if not landing.is_dir():
        raise FileNotFoundError(f"{landing}: landing folder not found")
    store = _Store(dataset)
    store.prepare()
    store.remove_stale_temporaries()
    record_unrecorded(dataset, run_id)  # what a killed run published but did not record
    ingested_at = ingested_at or datetime.now(UTC)
    report = IngestReport(run_id)
    requeue_completed(quarantine, landing, params)
    files, sidecars = landing_files(landing, exclude=(dataset, quarantine, store.manifest))
    captures, rejected = ingest_captures(sidecars, dataset, quarantine, run_id)
    for result in rejected:
        report.add(result)
    for done, path in enumerate(files, start=1):
        try:
            result = ingest_file(
                path,
                landing,
                dataset,
                quarantine,
                cell,
                params,
                run_id,
                ingested_at=ingested_at,
                captures=captures,
                in_place=True,
            )
        except FileNotFoundError:
            pass  # moved away since the listing (another run quarantined it): not ours
        else:
            report.add(result)
        if progress:
            progress(done, len(files))
    return report


def _realloop_version() -> str:
    try:
        return importlib_metadata.version("realloop")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"
