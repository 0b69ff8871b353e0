"""Dataset versions with DVC and git: a version is DVC's content hash of the dataset folder.

The workspace (the folder realloop runs in) is a git repository with DVC initialised. `dvc add`
writes `<dataset>.dvc`, whose `md5` of the folder listing is the dataset version that MLflow
runs, registry tags, bundles and lineage records quote. Each version that adds data is also

- a git commit of `<dataset>.dvc` (and the `.gitignore` next to it, unless git ignores that)
  with the message "dataset <hash>: +N files" (N source files added), and nothing else: a
  user's staged or modified files are never part of it;
- an annotated tag `dataset-<hash[:12]>` on that commit. Tag and commit messages end in
  trailers (Dataset-Version, Dataset-Path, Dataset-Files, Dataset-Size, Sources-Added,
  Created-At), so one `git for-each-ref` lists every version, also in a fresh clone;
- pushed to the DVC remote (`dvc push`), so `dvc pull` anywhere gets its files back.

The `.dir` listing in DVC's cache says which per-source Parquet files a version holds, so a
version also answers "which logs?".

Adding data costs what was added, not what the dataset holds: the dataset's files are
immutable (one file set per source, never rewritten), so when the folder holds exactly the
listed files plus a few new ones, `dvc add` is given only the new files (DVC's granular add
into a tracked folder: it hashes and caches those and appends them to the listing) instead of
the folder, which would stat and look up every file in DVC's state database, and check each
against the cache. The resulting listing, and so the version hash, is the one `dvc add` of
the whole folder makes (a test checks this). Anything else (no version yet, a listed file
gone or modified since the `.dvc` file was written, many new files) adds the whole folder.

`checkout_version` brings any version back byte for byte.
Each new version is also appended to `.realloop/datasets.jsonl`, a local ledger that keeps
versions made before they were tagged.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from pipelines.ingest.disk import on_disk_full
from pipelines.ingest.dvc_repo import (
    _EMPTY_DIR_MD5,
    _cache_object,
    _describe_source,
    _dir_listing,
    _dvc_add,
    _dvc_file,
    _dvc_repo,
    _is_episodes_file,
    _push,
    _remote_url,
    _source_shas,
    _tracked_out,
)
from pipelines.ingest.git_tags import (
    DatasetVersion,
    VersioningError,
    _commit,
    _committed_version,
    _git,
    _message,
    _tag,
    _tagged_versions,
)
from pipelines.ingest.s3_endpoint import s3_endpoint_url

LEDGER = Path(".realloop/datasets.jsonl")
LOCK = Path(".realloop/versioning.lock")
DEFAULT_REMOTE_NAME = "realloop"
LOCAL_STATE = ("/.realloop/", "/.prefect/", "/mlruns/", "/mlflow.db", "/mlartifacts/")


def ensure_workspace(workspace: Path, remote_url: str, unversioned: tuple[Path, ...] = ()) -> None:
    """Make `workspace` a git repository with DVC initialised and a default remote.

    A repository made here gets a `.gitignore` (not committed) for realloop's local state and
    the `unversioned` folders (the landing folder and quarantine: raw logs, never in git).
    An S3 remote gets the endpoint from REALLOOP_S3_ENDPOINT_URL / AWS_ENDPOINT_URL.
    """
    if not (workspace / ".git").exists():
        _git(workspace, "init", "-q")
        gitignore = workspace / ".gitignore"
        if not gitignore.exists():
            # Never versioned, and left out of the walk DVC makes of the workspace for `.dvc`
            # files on every `dvc add` and `dvc status` (git-ignored folders are skipped): the
            # local remote is in .realloop, and a landing folder holds every log ever landed.
            folders = [_ignore_entry(workspace, folder) for folder in unversioned]
            entries = [*LOCAL_STATE, *(f for f in folders if f)]
            gitignore.write_text("".join(f"{entry}\n" for entry in entries))
    from dvc.config_schema import RelPath

    # A folder is stored relative to .dvc/ (DVC saves a RelPath so and resolves it against the
    # config file's folder), so a workspace moved or copied elsewhere pushes to its own remote,
    # never to the one of the folder it was made in.
    # An absolute remote_url (a shared folder outside the workspace) stays absolute.
    url = remote_url
    if "://" not in remote_url and not Path(remote_url).is_absolute():
        url = RelPath((workspace / remote_url).resolve())
    with _dvc_repo(workspace, init=True) as repo:
        if repo.config["core"].get("remote") and not _remote_moved(repo, url):
            return  # the team configured one (e.g. `dvc remote add -d store s3://...`)
        # A machine's own folder belongs in config.local, never in the committed config.
        with repo.config.edit("local") as config:
            remote = {"url": url}
            if url.startswith("s3://") and (endpoint := s3_endpoint_url()):
                remote["endpointurl"] = endpoint
            config.setdefault("remote", {})[DEFAULT_REMOTE_NAME] = remote
            config.setdefault("core", {})["remote"] = DEFAULT_REMOTE_NAME


def _remote_moved(repo, url: str) -> bool:
    """True when the default remote is the local one realloop wrote as an absolute path
    (before remotes were relative) where `url` is now relative, or another folder."""
    from dvc.config_schema import RelPath

    local = repo.config.load_one("local")
    if local.get("core", {}).get("remote") != DEFAULT_REMOTE_NAME:
        return False
    ours = local.get("remote", {}).get(DEFAULT_REMOTE_NAME, {}).get("url", "")
    if "://" in ours or isinstance(ours, RelPath) or not os.path.isabs(ours):
        return False  # a URI, or relative already (resolved against this .dvc/)
    return isinstance(url, RelPath) or ours != url


def version_dataset(workspace: Path, dataset: Path, push: bool = True) -> DatasetVersion:
    """`dvc add` the dataset folder; commit and tag it if that made a new version; `dvc push`.

    Re-running after a crash completes what is missing (commit, tag, push, ledger line);
    a run that adds nothing makes no commit and no tag.
    """
    workspace = Path(workspace).resolve()
    relative = _relative(workspace, dataset)
    dvc_file = _dvc_file(relative)
    with _locked(workspace), _dvc_repo(workspace) as repo:
        with on_disk_full("writing the dataset version", workspace / ".dvc" / "cache"):
            _dvc_add(repo, workspace, relative)
        out = _tracked_out(workspace, relative)
        version = out["md5"].removesuffix(".dir")
        committed = _committed_version(workspace, dvc_file)
        new = version != committed and not (committed is None and version == _EMPTY_DIR_MD5)
        if new:
            added = len(_source_shas(workspace, version) - _source_shas(workspace, committed))
            record = DatasetVersion(
                version=version,
                path=relative.as_posix(),
                files=int(out.get("nfiles", 0)),
                size_bytes=int(out.get("size", 0)),
                created_at=datetime.now(UTC).isoformat(timespec="microseconds"),
                sources_added=added,
            )
            with on_disk_full("committing the dataset version", workspace / ".git"):
                record = replace(record, commit=_commit(workspace, dvc_file, _message(record)))
        else:
            record = _version_at_head(workspace, dvc_file, version, relative, out)
        if record.commit and not record.tag:
            with on_disk_full("tagging the dataset version", workspace / ".git"):
                record = replace(record, tag=_tag(workspace, record))
        if push:
            with on_disk_full("pushing to the DVC remote", _remote_url(repo)):
                _push(repo, workspace, version, committed)
        with on_disk_full("recording the report", workspace / LEDGER):
            _append_ledger(workspace, record)
    return replace(record, new=new)


def current_version(workspace: Path, dataset: Path) -> str:
    """The dataset version the workspace holds now, as its `.dvc` file records it."""
    return _tracked_out(workspace, _relative(workspace, dataset))["md5"].removesuffix(".dir")


def version_files(workspace: Path, version: str) -> list[str]:
    """Relative paths of every file in a dataset version, from DVC's cached `.dir` listing."""
    return [entry["relpath"] for entry in _dir_listing(workspace, version)]


def version_sources(workspace: Path, version: str) -> list[str]:
    """The source sha256s whose episodes a dataset version holds."""
    return sorted(_source_shas(workspace, version))


def versions_holding(workspace: Path, sha: str) -> list[str]:
    """The versions, oldest first, whose listing holds source `sha` (its episodes file); those
    whose listing is not in the cache are left out. Each listing is searched as text for the
    quoted relative path, which JSON writes as is: no parsing, no set of its thousands of
    entries, for each of hundreds of versions."""
    needle = f'"episodes/{sha}.parquet"'
    held = []
    for version in list_versions(workspace):
        listing = _cache_object(workspace, version.version).with_suffix(".dir")
        try:
            text = listing.read_text()
        except FileNotFoundError:
            continue
        if needle in text:
            held.append(version.version)
    return held


def list_versions(workspace: Path) -> list[DatasetVersion]:
    """Every dataset version made in this workspace, oldest first, without repeats: the
    `dataset-*` tags, then ledger versions no tag names (made before versions were tagged)."""
    workspace = Path(workspace)
    tagged = _tagged_versions(workspace)
    seen = {v.version for v in tagged}
    older = []
    for row in _ledger_rows(workspace):
        if row.version not in seen:
            seen.add(row.version)
            older.append(row)
    # Untagged ledger versions take their place by time; tags keep their exact order.
    merged = sorted(tagged + older, key=lambda v: v.created_at[:19])
    return merged


def latest_version(workspace: Path, dataset: Path) -> DatasetVersion | None:
    """The newest version of `dataset`, or None when it has none."""
    path = _relative(Path(workspace).resolve(), dataset).as_posix()
    versions = [v for v in list_versions(workspace) if v.path == path]
    return versions[-1] if versions else None


def find_version(workspace: Path, name: str, dataset: Path | None = None) -> DatasetVersion:
    """A version by hash, hash prefix (6+ characters), tag, or "latest" (of `dataset`)."""
    versions = list_versions(workspace)
    if dataset is not None:
        path = _relative(Path(workspace).resolve(), dataset).as_posix()
        versions = [v for v in versions if v.path == path]
    if name == "latest":
        if not versions:
            raise ValueError("no dataset versions yet; run `realloop ingest`")
        return versions[-1]
    exact = [v for v in versions if name in (v.version, v.tag)]
    if exact:
        return exact[-1]
    matches = [v for v in versions if len(name) >= 6 and v.version.startswith(name.lower())]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"{name}: matches {len(matches)} dataset versions; give more of it")
    raise ValueError(f"{name}: no such dataset version (see `realloop datasets`)")


def checkout_version(workspace: Path, version: str) -> DatasetVersion:
    """Bring the dataset folder back to `version` (hash, prefix, tag or "latest"), byte for
    byte: `<dataset>.dvc` as committed at that version, then `dvc checkout`.

    Only the working copy of the `.dvc` file changes (never the index or HEAD); checking out
    "latest" returns to where ingest continues. Refuses when the dataset folder holds changes
    that no version has (they would be lost).
    """
    workspace = Path(workspace).resolve()
    target = find_version(workspace, version)
    if target.commit is None:
        raise ValueError(f"{target.version}: made before versions were committed; cannot check out")
    dvc_file = _dvc_file(Path(target.path))
    with _locked(workspace):
        with _dvc_repo(workspace) as repo:
            target_file = str(workspace / dvc_file)
            if (workspace / dvc_file).is_file() and repo.status(targets=[target_file]):
                raise ValueError(
                    f"{target.path} has changes that no dataset version holds; "
                    "run `realloop ingest` first"
                )
        text = _git(workspace, "show", f"{target.commit}:{dvc_file.as_posix()}")
        _write_atomically(workspace / dvc_file, text)
        with _dvc_repo(workspace) as repo:
            repo.checkout(targets=[str(workspace / dvc_file)])
    held = current_version(workspace, workspace / target.path)
    if held != target.version:
        raise VersioningError(f"checked out {held}, expected {target.version}")
    return target


def require_latest(workspace: Path, dataset: Path) -> None:
    """Refuse to add to a dataset that is checked out at an older version."""
    workspace = Path(workspace).resolve()
    if not (workspace / _dvc_file(_relative(workspace, dataset))).is_file():
        return
    latest = latest_version(workspace, dataset)
    held = current_version(workspace, dataset)
    if latest is None or held == latest.version:
        return
    if any(v.version == held for v in list_versions(workspace)):
        raise ValueError(
            f"{latest.path} is checked out at an older version ({held[:12]}); run "
            "`realloop datasets --checkout latest` before ingesting"
        )


def describe_versions(workspace: Path, dataset: Path) -> dict:
    """Every version of `dataset` with its episode count and sources (sha256, URI).

    Episode counts and URIs are read from each source's episodes file in DVC's cache, so
    versions that are not checked out are described too; a version whose listing is not in
    the cache (run `dvc pull`) has `episodes` and `sources` null.
    """
    workspace = Path(workspace).resolve()
    path = _relative(workspace, dataset).as_posix()
    try:
        held = current_version(workspace, dataset)
    except ValueError:
        held = None
    described, seen_before, per_file = [], set(), {}
    for version in (v for v in list_versions(workspace) if v.path == path):
        row = version.as_dict()
        row.pop("new")
        try:
            listing = _dir_listing(workspace, version.version)
        except ValueError:
            row.update(episodes=None, sources=None)
        else:
            sources = [
                _describe_source(workspace, dataset, entry, per_file)
                for entry in listing
                if _is_episodes_file(entry["relpath"])
            ]
            shas = {s["sha256"] for s in sources}
            if row["sources_added"] is None:
                row["sources_added"] = len(shas - seen_before)
            seen_before = shas
            row.update(
                episodes=sum(s["episodes"] or 0 for s in sources),
                sources=sources,
            )
        row["current"] = version.version == held
        described.append(row)
    return {"dataset": path, "current": held, "versions": described}


def _version_at_head(
    workspace: Path, dvc_file: Path, version: str, relative: Path, out: dict
) -> DatasetVersion:
    """The record of the version HEAD holds already (or of an empty, uncommitted dataset)."""
    path = relative.as_posix()
    for known in reversed(_tagged_versions(workspace)):
        if known.version == version and known.path == path:
            return known
    record = DatasetVersion(
        version=version,
        path=path,
        files=int(out.get("nfiles", 0)),
        size_bytes=int(out.get("size", 0)),
        created_at=datetime.now(UTC).isoformat(timespec="microseconds"),
    )
    if _committed_version(workspace, dvc_file) != version:
        return record  # the empty dataset before the first ingest: not committed
    # Committed, then a crash before the tag: describe that commit so the tag can follow.
    commit = _git(workspace, "log", "-1", "--format=%H", "--", dvc_file.as_posix()).strip()
    parent = _committed_version(workspace, dvc_file, f"{commit}^")
    added = len(_source_shas(workspace, version) - _source_shas(workspace, parent))
    return replace(record, commit=commit, sources_added=added)


# --- the ledger and small helpers ---------------------------------------------------------


def _ledger_rows(workspace: Path) -> list[DatasetVersion]:
    ledger = Path(workspace) / LEDGER
    if not ledger.is_file():
        return []
    rows = []
    for line in ledger.read_text().splitlines():
        try:
            rows.append(DatasetVersion(**json.loads(line)))
        except (ValueError, TypeError):
            continue  # a line cut by a crash
    return rows


def _append_ledger(workspace: Path, version: DatasetVersion) -> None:
    if version.commit is None and version.files == 0:
        return  # the empty dataset before the first ingest is not a version anyone used
    if any(r.version == version.version for r in _ledger_rows(workspace)):
        return
    ledger = Path(workspace) / LEDGER
    ledger.parent.mkdir(parents=True, exist_ok=True)
    row = version.as_dict()
    row.pop("new")
    with ledger.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


@contextmanager
def _locked(workspace: Path) -> Iterator[None]:
    """One versioning step at a time per workspace (git's index and DVC's state are shared)."""
    path = Path(workspace) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _ignore_entry(workspace: Path, folder: Path) -> str | None:
    """A root-anchored .gitignore line for a folder inside the workspace, else None."""
    try:
        relative = _relative(workspace, Path(folder))
    except ValueError:
        return None
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        return None
    return f"/{relative.as_posix()}/"


def _relative(workspace: Path, path: Path) -> Path:
    path = Path(path)
    return path.resolve().relative_to(Path(workspace).resolve()) if path.is_absolute() else path
