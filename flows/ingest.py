"""The ingest flow: a source (landing folder or S3 prefix) → the canonical dataset → a version.

    list the source ─► (S3 only) download each new object ─► ingest each new file ─► version
                       one task per object, retried with     one task per file
                       backoff on transient S3 errors

One Prefect task per file, never per message or episode, and at most `ingest.workers` of them
running at once (DEFAULT_WORKERS when params.yaml does not say). Files this workspace already
ingested are recognised from `.realloop/landed.jsonl` (by size and inode/mtime, or ETag, and
only while their episodes are in the dataset), so they cost neither a task, a download nor a
re-hash; they are reported as skipped but get no new manifest line. Capture sidecars are read
once per run and handed to each file's task. Versioning then runs once: `dvc add`, a git
commit and tag when data was added, `dvc push`.

The per-file tasks run in the flow's thread pool, or on a Dask cluster when `ingest.cluster`
names one (`flows/ingest_runner.py`). A full disk at any step stops the run: no further file
is started and the flow run fails with one line naming the step and the path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.states import Failed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from prefect.utilities.annotations import quote

from flows import artifacts
from flows.console import progress_bar
from flows.ingest_events import notify
from flows.ingest_runner import capacity, per_file_runner
from pipelines.contract.params import Params, load_params
from pipelines.ingest import (
    LandingFolder,
    ObjectGone,
    S3Prefix,
    SeenFiles,
    SourceError,
    SourceFile,
    TransientSourceError,
    landing_entries,
    local_file,
    open_source,
    safe_parts,
)
from pipelines.ingest.disk import DiskFullError, on_disk_full
from pipelines.ingest.store import record_unrecorded

SEEN = Path(".realloop/landed.jsonl")  # in the workspace
DEFAULT_WORKERS = 4
MAX_WORKERS = 32
RETRIES = 4
RETRY_BACKOFF_S = 2.0  # 2, 4, 8, 16 s, each ±50%


def _transient(task, task_run, state) -> bool:
    """Retry only what may pass: dropped connections, 5xx, throttling."""
    try:
        state.result()
    except TransientSourceError:
        return True
    except Exception:
        return False
    return False


_RETRIED = {
    "retries": RETRIES,
    "retry_delay_seconds": exponential_backoff(backoff_factor=RETRY_BACKOFF_S),
    "retry_jitter_factor": 0.5,
    "retry_condition_fn": _transient,
    "cache_policy": NO_CACHE,  # a source holds a boto3 client: nothing to hash, nothing to cache
}


@task(name="list-source", **_RETRIED)
def list_source(source: LandingFolder | S3Prefix) -> list[SourceFile]:
    return source.list()


@task(name="download", task_run_name="download {name}", **_RETRIED)
def download(source: S3Prefix, file: SourceFile, name: str) -> str | None:
    """Stage one object; None when it was deleted since the listing."""
    try:
        return str(source.fetch(file))
    except ObjectGone:
        return None
    except DiskFullError as exc:
        return exc  # as `ingest_one`: one line from the flow, no task traceback


@task(name="ingest-file", task_run_name="ingest {name}", cache_policy=NO_CACHE)
def ingest_one(
    params: Params,
    workspace: Path,
    path: Path,
    landing: Path,
    run_id: str,
    name: str,
    ingested_at: datetime,
    captures: dict,
    source_uri: str | None = None,
    in_place: bool = False,
):
    """Ingest one landed file (`pipelines.ingest.landing.ingest_file`); None when it was moved away
    since the listing (another run quarantined it): it did not land after all."""
    from pipelines.ingest import ingest_file

    ingest = params.ingest
    try:
        return ingest_file(
            path,
            landing,
            workspace / ingest.dataset,
            workspace / ingest.quarantine,
            params.cell,
            ingest,
            run_id,
            source_uri=source_uri,
            ingested_at=ingested_at,
            captures=captures,
            in_place=in_place,
        )
    except FileNotFoundError:
        if path.exists():
            raise
        return None
    except DiskFullError as exc:
        # Returned, not raised: the flow stops and says it in one line; a failed task would
        # print its traceback, once per file in flight.
        return exc


@task(name="version-dataset")
def version_dataset(params: Params, workspace: Path) -> dict:
    """`dvc add`, then a git commit and tag if data was added, then `dvc push`."""
    from pipelines.ingest import versioning

    ingest = params.ingest
    unversioned = (workspace / ingest.landing, workspace / ingest.quarantine)
    try:
        with on_disk_full("writing the dataset version", workspace):
            versioning.ensure_workspace(workspace, ingest.remote, unversioned=unversioned)
        return versioning.version_dataset(workspace, workspace / params.ingest.dataset).as_dict()
    except DiskFullError as exc:
        return exc  # as `ingest_one`: one line from the flow, no task traceback


@flow(name="ingest", task_runner=ThreadPoolTaskRunner(max_workers=MAX_WORKERS))
def ingest_flow(
    params_path: str = "params.yaml",
    workspace: str = ".",
    source: str | None = None,
    progress: bool = False,
) -> dict:
    """Ingest everything new from `source` (default: the landing folder) and version the
    dataset. `progress` draws bars on stderr (the command line's). A full disk fails the
    run with one line naming the step and the path (`pipelines/ingest/disk.py`)."""
    try:
        return _ingest(params_path, workspace, source, progress)
    except DiskFullError as exc:
        # A Failed state, not a raise: Prefect logs a raised exception's traceback. The
        # caller of the flow still gets the DiskFullError raised.
        return Failed(message=str(exc), data=exc)


def _ingest(params_path: str, workspace: str, source: str | None, progress: bool) -> dict:
    from pipelines.ingest import check_can_version

    params = load_params(params_path)
    root = Path(workspace).resolve()
    dataset = root / params.ingest.dataset
    check_can_version(root, dataset)  # before anything is written
    with on_disk_full("preparing the dataset folder", dataset):
        dataset.mkdir(parents=True, exist_ok=True)
    run = _Run(
        params=params,
        root=root,
        run_id=str(flow_run.get_id() or "local"),
        seen=SeenFiles(root / SEEN),
        workers=_workers(params),
    )
    origin = open_source(source, root / params.ingest.landing, root, exclude=run.exclude)
    # A run killed between publishing a file and its manifest line left the line out.
    record_unrecorded(dataset, run.run_id)
    cluster = params.ingest.cluster
    with per_file_runner(cluster, run.workers) as run.runner, progress_bar(progress) as update:
        run.update = update
        if isinstance(origin, S3Prefix):
            _from_s3(run, origin)
        else:
            _from_folder(run, origin)
    version = version_dataset(params, root)
    if isinstance(version, DiskFullError):
        raise version
    result = {
        "source": origin.uri,
        "ingest": run.report().as_dict(),
        "dataset": version,
        "dataset_version": version["version"],
    }
    by_cell = artifacts.new_files_by_cell(dataset, result["ingest"]["ingested"])
    artifacts.log(artifacts.ingest_sentence(result["ingest"], by_cell, version))
    artifacts.ingest_report(result, by_cell)
    notify(params, root, result)  # events for automations: retrain, resume a loop
    if run.failed:
        raise SourceError(
            f"{len(run.failed)} file(s) could not be fetched, the rest is in dataset "
            f"{version['version']}; the next run retries them: {run.failed[0]}"
        )
    return result


# --- one run ----------------------------------------------------------------------------


@dataclass
class _Run:
    params: Params
    root: Path
    run_id: str
    seen: SeenFiles
    workers: int
    update: Callable[[str, int, int], None] = lambda *_: None
    runner: object | None = None  # a started DaskTaskRunner (ingest.cluster), else the flow's
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    results: list = field(default_factory=list)  # FileResults, in the order files were done
    failed: list[str] = field(default_factory=list)  # why files could not be fetched

    @property
    def dataset(self) -> Path:
        return self.root / self.params.ingest.dataset

    @property
    def quarantine(self) -> Path:
        return self.root / self.params.ingest.quarantine

    @property
    def exclude(self) -> tuple[Path, ...]:
        from pipelines.ingest import MANIFEST_NAME

        return (self.dataset, self.quarantine, self.dataset.parent / MANIFEST_NAME)

    @functools.cached_property
    def held(self) -> set[str]:
        """The dataset's episodes files, listed once (not one stat per known file)."""
        try:
            return set(os.listdir(self.dataset / "episodes"))
        except FileNotFoundError:
            return set()

    def report(self):
        from pipelines.ingest import IngestReport

        return IngestReport.from_results(self.run_id, self.results)

    def already_handled(self, file: SourceFile, from_s3: bool) -> bool:
        """Skip a file a previous run ingested while its episodes are still in the dataset,
        or (from S3, where the object stays in the bucket) one it quarantined."""
        from pipelines.ingest import ALREADY_INGESTED, FileResult

        known = self.seen.get(file)
        if known is None:
            return False
        sha, outcome, reason = known["sha256"], known["result"], known.get("reason")
        held = f"{sha}.parquet" in self.held
        if outcome == "ingested" or (outcome == "skipped" and reason == ALREADY_INGESTED):
            if not held:
                return False
            reason = ALREADY_INGESTED
        elif outcome == "quarantined" and from_s3:
            reason = f"quarantined by an earlier run: {reason}"
        elif outcome != "skipped":
            return False
        self.results.append(FileResult(file.uri, sha, file.size, "skipped", reason, 0, 0, None))
        return True

    def record(self, file: SourceFile, result) -> str | None:
        """File one ingest result (a FileResult, or None: gone) under the file's URI."""
        from dataclasses import replace

        if result is None:
            return None
        result = replace(result, source=file.uri)
        self.results.append(result)
        with on_disk_full("recording the report", self.seen.path):
            self.seen.add(file, result.sha256, result.result, result.reason)
        return result.result

    def ingest(
        self,
        files: list[tuple[SourceFile, Path]],
        landing: Path,
        sidecars: list[Path],
        objects: dict[str, SourceFile] | None = None,
        in_place: bool = False,
    ):
        """One task per file, `workers` at a time; returns each file's outcome. Unreadable
        capture sidecars are quarantined first; `objects` (staged path → object) names and
        remembers those that came from S3, so they are not downloaded again."""
        from pipelines.ingest import ingest_captures

        captures, rejected = ingest_captures(sidecars, self.dataset, self.quarantine, self.run_id)
        for result in rejected:
            obj = (objects or {}).get(result.source)
            if obj is None:
                self.results.append(result)
            else:
                self.record(obj, result)
        calls = [
            {
                "params": self.params,
                "workspace": self.root,
                "path": path,
                "landing": landing,
                "run_id": self.run_id,
                "name": file.name,
                "ingested_at": self.started,
                "captures": quote(captures),  # handed over as is, not walked for futures
                "source_uri": file.uri,  # s3://..., or the path as the workspace names it
                "in_place": in_place,
            }
            for file, path in files
        ]
        # On a cluster, twice what it runs at once is in flight: no worker waits for the next.
        limit = 2 * capacity(self.runner) if self.runner else self.workers
        results = _bounded(
            ingest_one,
            calls,
            limit,
            lambda done: self.update("ingest", done, len(calls)),
            runner=self.runner,
        )
        full = next((r for r in results if isinstance(r, DiskFullError)), None)
        outcomes = [
            None if isinstance(r, DiskFullError) else self.record(file, _raise_failed(r))
            for (file, _), r in zip(files, results, strict=True)
        ]
        if full:
            raise full  # files not ingested stay where they landed, for the next run
        return outcomes


def _from_folder(run: _Run, origin: LandingFolder) -> None:
    """Files ingested where they landed, their writers perhaps still writing them."""
    from pipelines.ingest import requeue_completed

    requeue_completed(run.quarantine, origin.root, run.params.ingest)
    files, sidecars = list_source(_Scan(origin))
    todo = [f for f in files if not run.already_handled(f, from_s3=False)]
    run.ingest([(f, origin.root / f.name) for f in todo], origin.root, sidecars, in_place=True)


def _from_s3(run: _Run, origin: S3Prefix) -> None:
    listed = list_source(origin)
    new = []
    for obj in listed:
        if run.already_handled(obj, from_s3=True):
            origin.discard(obj)  # a staged copy left by a run that stopped after its ingest
        else:
            new.append(obj)
    fetch = [o for o in new if not origin.is_staged(o)]
    fetched = _bounded(
        download,
        [{"source": origin, "file": o, "name": o.name} for o in fetch],
        run.workers,
        lambda done: run.update("download", done, len(fetch)),
    )
    full = next((r for r in fetched if isinstance(r, DiskFullError)), None)
    if full:
        raise full  # the bucket keeps every object; staged ones are used by the next run
    gone = set()
    for obj, result in zip(fetch, fetched, strict=True):
        if isinstance(result, BaseException):
            run.failed.append(str(result).splitlines()[0] if str(result) else repr(result))
            gone.add(obj.name)
        elif result is None:
            gone.add(obj.name)
    for obj in new:
        if not safe_parts(obj.name) and obj.name not in gone:
            _quarantine_unsafe(run, origin, obj)
    # The staged tree reads like a landing folder: ingest's own rules say what is a log.
    by_name = {o.name: o for o in new if safe_parts(o.name)}
    logs, sidecars = landing_entries(origin.root) if origin.root.is_dir() else ([], [])
    todo = []
    for path in logs:
        name = path.relative_to(origin.root).as_posix()
        obj = by_name.get(name)
        if obj is None and name not in gone:  # staged by an earlier run that stopped
            staged = local_file(path, origin.root)
            if staged is not None:
                obj = SourceFile(name, f"{origin.uri}/{name}", staged.size, staged.fingerprint)
        if obj is not None and name not in gone:
            todo.append((obj, path))
    objects = {str(origin.staged_path(o).resolve()): o for o in by_name.values()}
    outcomes = run.ingest(todo, origin.root, sidecars, objects)
    for (obj, _), outcome in zip(todo, outcomes, strict=True):
        if outcome in ("ingested", "skipped"):
            origin.discard(obj)  # the bucket keeps the original; the dataset has its rows


def _quarantine_unsafe(run: _Run, origin: S3Prefix, obj: SourceFile) -> None:
    """An object whose key would lead outside the staging folder: staged under a safe name,
    then quarantined with the reason a landing folder would give."""
    from pipelines.ingest import FileResult, quarantine_file, record_in_manifest

    reason = f"file name escapes the landing folder: key {obj.name!r} below {origin.uri}"
    entry = quarantine_file(
        origin.staged_path(obj), reason, run.quarantine, run.run_id, source=obj.uri
    )
    result = FileResult(
        obj.uri, entry["sha256"], obj.size, "quarantined", entry["reason"], 0, 0, entry["moved_to"]
    )
    run.record(obj, record_in_manifest(run.dataset, result, run.run_id))


@dataclass(frozen=True)
class _Scan:
    """A landing folder whose listing also returns its capture sidecars."""

    folder: LandingFolder

    def list(self) -> tuple[list[SourceFile], list[Path]]:
        return self.folder.scan()


def _bounded(task, calls: list[dict], limit: int, done: Callable[[int], None], runner=None) -> list:
    """Submit `task` once per keyword set, at most `limit` running at a time; return the
    results in order (a failed task's exception in its place). `runner`: a started task
    runner to submit to instead of the flow's. After a DiskFullError nothing more is
    submitted (those calls' results stay None): every other file would fail the same way."""
    if not hasattr(task, "submit"):  # a plain function (bench.loop's direct calls)
        results = []
        for kwargs in calls:
            plain = {k: v.unwrap() if isinstance(v, quote) else v for k, v in kwargs.items()}
            try:
                results.append(task(**plain))
            except Exception as exc:
                results.append(exc)
            done(len(results))
        return results
    results: list = [None] * len(calls)
    pending: dict = {}
    queue = iter(enumerate(calls))

    def fill() -> None:
        while len(pending) < limit and (item := next(queue, None)) is not None:
            index, kwargs = item
            if runner:  # Dask rebuilds a `quote` as a plain tuple on its way: send the value
                plain = {k: v.unwrap() if isinstance(v, quote) else v for k, v in kwargs.items()}
                pending[runner.submit(task, parameters=plain)] = index
            else:
                pending[task.submit(**kwargs)] = index

    fill()
    finished = 0
    while pending:
        future = next(as_completed(list(pending)))
        index = pending.pop(future)
        results[index] = future.result(raise_on_failure=False)
        finished += 1
        done(finished)
        if not isinstance(results[index], DiskFullError):
            fill()
    return results


def _raise_failed(result):
    if isinstance(result, BaseException):
        raise result
    return result


def _workers(params: Params) -> int:
    configured = getattr(params.ingest, "workers", None) or DEFAULT_WORKERS
    return max(1, min(int(configured), MAX_WORKERS))
