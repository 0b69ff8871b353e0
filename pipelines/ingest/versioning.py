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
import functools
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import yaml

LEDGER = Path(".realloop/datasets.jsonl")
LOCK = Path(".realloop/versioning.lock")
DEFAULT_REMOTE_NAME = "realloop"
TAG_PREFIX = "dataset-"
GIT_IDENTITY = ("-c", "user.name=realloop", "-c", "user.email=realloop@localhost")
LOCAL_STATE = ("/.realloop/", "/.prefect/", "/mlruns/", "/mlflow.db", "/mlartifacts/")
GRANULAR_MAX = 64  # new files up to which `dvc add` is given the files, not the folder
_EMPTY_DIR_MD5 = "d751713988987e9331980363e24189ce"
_TRAILERS = {
    "Dataset-Version": "version",
    "Dataset-Path": "path",
    "Dataset-Files": "files",
    "Dataset-Size": "size_bytes",
    "Sources-Added": "sources_added",
    "Created-At": "created_at",
}


class VersioningError(ValueError):
    """git or DVC refused; the message is the one-line reason."""


@dataclass(frozen=True)
class DatasetVersion:
    version: str  # DVC md5 of the folder listing, without DVC's ".dir" suffix
    path: str  # the dataset folder, relative to the workspace
    files: int
    size_bytes: int
    created_at: str
    tag: str | None = None  # dataset-<version[:12]>, None for versions made before tags
    commit: str | None = None  # the git commit of `<path>.dvc` at this version
    sources_added: int | None = None  # source files new in this version
    new: bool = field(default=False, compare=False)  # made by the call that returned it

    def as_dict(self) -> dict:
        return asdict(self)


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
    with _dvc_repo(workspace, init=True) as repo:
        if repo.config["core"].get("remote"):
            return  # the team configured one (e.g. `dvc remote add -d store s3://...`)
        # A machine's own folder belongs in config.local, never in the committed config.
        with repo.config.edit("local") as config:
            url = remote_url if "://" in remote_url else str((workspace / remote_url).resolve())
            remote = {"url": url}
            if url.startswith("s3://"):
                from pipelines.ingest.sources import s3_endpoint_url

                if endpoint := s3_endpoint_url():
                    remote["endpointurl"] = endpoint
            config.setdefault("remote", {})[DEFAULT_REMOTE_NAME] = remote
            config.setdefault("core", {})["remote"] = DEFAULT_REMOTE_NAME


def version_dataset(workspace: Path, dataset: Path, push: bool = True) -> DatasetVersion:
    """`dvc add` the dataset folder; commit and tag it if that made a new version; `dvc push`.

    Re-running after a crash completes what is missing (commit, tag, push, ledger line);
    a run that adds nothing makes no commit and no tag.
    """
    workspace = Path(workspace).resolve()
    relative = _relative(workspace, dataset)
    dvc_file = _dvc_file(relative)
    with _locked(workspace), _dvc_repo(workspace) as repo:
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
            record = replace(record, commit=_commit(workspace, dvc_file, _message(record)))
        else:
            record = _version_at_head(workspace, dvc_file, version, relative, out)
        if record.commit and not record.tag:
            record = replace(record, tag=_tag(workspace, record))
        if push:
            _push(repo, workspace, version, committed)
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


# --- git -------------------------------------------------------------------------------


def _git(workspace: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(
        ["git", "-C", str(workspace), *args], capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip() or "failed").splitlines()[0]
        raise VersioningError(f"git {args[0]} in {workspace}: {reason}")
    return done.stdout if done.returncode == 0 else ""


def _identity(workspace: Path) -> tuple[str, ...]:
    """realloop's own identity, only where git has none configured."""
    configured = all(
        _git(workspace, "config", "--get", key, check=False).strip()
        for key in ("user.name", "user.email")
    )
    return () if configured else GIT_IDENTITY


def _commit(workspace: Path, dvc_file: Path, message: str) -> str:
    """Commit exactly `dvc_file` (and its folder's .gitignore unless ignored); return the sha."""
    paths = [dvc_file.as_posix()]
    gitignore = dvc_file.parent / ".gitignore"
    if (workspace / gitignore).is_file() and not _ignored(workspace, gitignore):
        paths.append(gitignore.as_posix())
    # -f: the .dvc file is what makes the version reproducible; it is committed even if a
    # broad ignore rule covers its folder.
    _git(workspace, "add", "-f", "--", paths[0])
    if len(paths) > 1:
        _git(workspace, "add", "--", paths[1])
    # A pathspec commit takes only these paths, whatever else the user has staged.
    _git(
        workspace,
        *_identity(workspace),
        "commit",
        "-q",
        "--no-verify",
        "-m",
        message,
        "--",
        *paths,
    )
    return _git(workspace, "rev-parse", "HEAD").strip()


def _ignored(workspace: Path, path: Path) -> bool:
    done = subprocess.run(
        ["git", "-C", str(workspace), "check-ignore", "-q", path.as_posix()],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def _tag(workspace: Path, record: DatasetVersion) -> str:
    tag = f"{TAG_PREFIX}{record.version[:12]}"
    exists = _git(workspace, "rev-parse", "-q", "--verify", f"refs/tags/{tag}", check=False)
    if not exists.strip():
        message = _message(record)
        _git(workspace, *_identity(workspace), "tag", "-a", tag, "-m", message, record.commit)
    return tag


def _message(record: DatasetVersion) -> str:
    trailers = "\n".join(
        f"{name}: {getattr(record, attr)}"
        for name, attr in _TRAILERS.items()
        if getattr(record, attr) is not None
    )
    return f"dataset {record.version}: +{record.sources_added} files\n\n{trailers}\n"


def _parse_trailers(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        if sep and name in _TRAILERS:
            found[_TRAILERS[name]] = value.strip()
    return found


def _tagged_versions(workspace: Path) -> list[DatasetVersion]:
    if not (workspace / ".git").exists():
        return []
    text = _git(
        workspace,
        "for-each-ref",
        "--format=%(refname:strip=2)%00%(*objectname)%00%(objectname)%00%(contents)%1e",
        f"refs/tags/{TAG_PREFIX}*",
        check=False,
    )
    versions = []
    for record in text.split("\x1e"):
        fields = record.strip("\n").split("\x00")
        if len(fields) != 4:
            continue
        tag, peeled, target, contents = fields
        meta = _parse_trailers(contents)
        if "version" not in meta or "path" not in meta:
            continue  # not one of ours
        versions.append(
            DatasetVersion(
                version=meta["version"],
                path=meta["path"],
                files=int(meta.get("files", 0)),
                size_bytes=int(meta.get("size_bytes", 0)),
                created_at=meta.get("created_at", ""),
                tag=tag,
                commit=peeled or target,
                sources_added=int(meta["sources_added"]) if "sources_added" in meta else None,
            )
        )
    return sorted(versions, key=lambda v: v.created_at)


def _committed_version(workspace: Path, dvc_file: Path, rev: str = "HEAD") -> str | None:
    """The version in `<dataset>.dvc` at `rev`, or None when there is none."""
    text = _git(workspace, "show", f"{rev}:{dvc_file.as_posix()}", check=False)
    if not text:
        return None
    try:
        return yaml.safe_load(text)["outs"][0]["md5"].removesuffix(".dir")
    except (yaml.YAMLError, KeyError, IndexError, TypeError):
        return None


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


# --- DVC -------------------------------------------------------------------------------


def _dvc_add(repo, workspace: Path, relative: Path) -> None:
    """`dvc add` of the dataset folder, or of only its new files when that is the same."""
    from dvc.exceptions import DvcException
    from dvc.repo import lock_repo

    dataset = workspace / relative
    new = _new_files(workspace, relative)
    if new == []:
        return  # the `.dvc` file records the folder as it is
    if new is not None and len(new) <= GRANULAR_MAX:
        try:
            # One lock around both: DVC collects the workspace's `.dvc` files once per lock.
            with lock_repo(repo):
                if _dvc_sees(repo, dataset):
                    repo.add([str(dataset / name) for name in new])
                    return
        except DvcException as exc:  # e.g. a new file DVC ignores: the folder decides
            logging.getLogger(__name__).info("granular dvc add refused (%s); adding folder", exc)
    repo.add(str(dataset))


def _dvc_sees(repo, dataset: Path) -> bool:
    """Whether DVC's index holds the dataset's `.dvc` file: it skips git-ignored folders when
    it collects them (`/data/*` hides `data/dataset.dvc` from it), and a granular add needs it."""
    from dvc.exceptions import OutputNotFoundError

    try:
        return bool(repo.find_outs_by_path(str(dataset)))
    except OutputNotFoundError:
        return False


def _new_files(workspace: Path, relative: Path) -> list[str] | None:
    """The files in the dataset folder that the version its `.dvc` file records lacks, when
    every file it lists is still there, unmodified since that file was written; else None.

    One stat per file, no hashing: files written after the `.dvc` file count as modified (a
    checkout rewrites files after it, so the next add takes the whole folder once)."""
    dvc_file = workspace / _dvc_file(relative)
    try:
        out = _tracked_out(workspace, relative)
        written = dvc_file.stat().st_mtime_ns
        listed = {e["relpath"] for e in _dir_listing(workspace, out["md5"].removesuffix(".dir"))}
    except (ValueError, KeyError, TypeError, OSError):
        return None
    if not out.get("size"):
        return None  # DVC sums sizes on an append only from a known, non-zero size
    new, seen = [], 0
    for relpath, mtime_ns in _walk_files(workspace / relative):
        if relpath not in listed:
            new.append(relpath)
        elif mtime_ns > written:
            return None
        else:
            seen += 1
    return sorted(new) if seen == len(listed) else None


def _walk_files(folder: Path, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(relative posix path, mtime_ns) of every file below `folder`, symlinks not followed."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk_files(Path(entry.path), f"{prefix}{entry.name}/")
        else:
            yield f"{prefix}{entry.name}", entry.stat(follow_symlinks=False).st_mtime_ns


def _tracked_out(workspace: Path, relative: Path) -> dict:
    dvc_file = Path(workspace) / _dvc_file(relative)
    if not dvc_file.is_file():
        raise ValueError(f"{dvc_file}: the dataset is not versioned yet; run `realloop ingest`")
    return yaml.safe_load(dvc_file.read_text())["outs"][0]


def _dvc_file(relative: Path) -> Path:
    return relative.with_name(relative.name + ".dvc")


def _cache_object(workspace: Path, md5: str) -> Path:
    return Path(workspace) / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def _dir_listing(workspace: Path, version: str) -> list[dict]:
    listing = _cache_object(workspace, version).with_suffix(".dir")
    if not listing.is_file():
        raise ValueError(f"{listing}: dataset version {version} is not in the DVC cache (dvc pull)")
    return list(_read_listing(str(listing)))


@functools.lru_cache(maxsize=16)
def _read_listing(path: str) -> tuple[dict, ...]:
    """A `.dir` listing is named by the hash of its content: read each one once."""
    return tuple(json.loads(Path(path).read_text()))


def _is_episodes_file(relpath: str) -> bool:
    return relpath.startswith("episodes/") and relpath.endswith(".parquet")


def _source_shas(workspace: Path, version: str | None) -> set[str]:
    if version is None or version == _EMPTY_DIR_MD5:
        return set()
    try:
        listing = _dir_listing(workspace, version)
    except ValueError:
        return set()
    # episodes/<sha>.parquet: the stem, by slicing (a Path per entry costs more than the rest)
    return {e["relpath"][9:-8] for e in listing if _is_episodes_file(e["relpath"])}


def _describe_source(workspace: Path, dataset: Path, entry: dict, memo: dict) -> dict:
    """sha256, URI and episode count of one source, from its episodes file (cache first)."""
    sha = Path(entry["relpath"]).stem
    md5 = entry.get("md5", "")
    if md5 not in memo:
        import pyarrow.parquet as pq

        uri, episodes = None, None
        for candidate in (_cache_object(workspace, md5), Path(dataset) / entry["relpath"]):
            if candidate.is_file():
                table = pq.read_table(candidate, columns=["source_uri"])
                episodes = table.num_rows
                uri = table.column("source_uri")[0].as_py() if table.num_rows else None
                break
        memo[md5] = (uri, episodes)
    uri, episodes = memo[md5]
    return {"sha256": sha, "uri": uri, "episodes": episodes}


def _push(repo, workspace: Path, version: str, previous: str | None) -> None:
    """`dvc push` of one version: the files the remote lacks, then the `.dir` listing.

    DVC uploads a `.dir` listing only after every file in it, so a listing on the remote
    means its files are there: when `previous` is, only the files new since then are looked
    up and sent. (`repo.push` would index every file of the dataset instead: 1.5 s at 500
    sources for a one-file change, measured.) Without it, every file is looked up. The
    listing itself is copied as a file once its files are there: handed to the transfer, it
    would be loaded and every entry compared with the remote's again.
    """
    from dvc_data.hashfile.hash_info import HashInfo

    if version == _EMPTY_DIR_MD5:
        return
    remote = repo.cloud.get_remote_odb(None, "push")
    if remote.exists(f"{version}.dir"):
        return
    files = {entry["md5"] for entry in _dir_listing(workspace, version)}
    if previous and previous != _EMPTY_DIR_MD5 and remote.exists(f"{previous}.dir"):
        files -= {entry["md5"] for entry in _dir_listing(workspace, previous)}
    cache = repo.cache.local
    failed = 0
    if files:
        objects = [HashInfo("md5", f) for f in sorted(files)]
        failed = len(repo.cloud.transfer(cache, remote, objects, cache_odb=cache).failed)
    if not failed:
        listing = f"{version}.dir"
        try:
            remote.add(cache.oid_to_path(listing), cache.fs, listing)
        except Exception:  # the remote's own errors (a dropped connection, a 5xx, ...)
            failed = 1
    if failed or not remote.exists(f"{version}.dir"):
        raise VersioningError(
            f"dvc push: dataset version {version} did not fully reach the remote "
            f"({failed} object(s) failed); the next ingest retries"
        )


@contextmanager
def _dvc_repo(workspace: Path, init: bool = False):
    """A DVC Repo for the workspace, with DVC's console chatter ("To track the changes...")
    kept off our stdout: realloop prints its own summary."""
    from dvc.repo import Repo

    dvc_logger = logging.getLogger("dvc")
    level = dvc_logger.level
    dvc_logger.setLevel(logging.WARNING)
    try:
        if init and not (workspace / ".dvc").is_dir():
            Repo.init(str(workspace))
        with Repo(str(workspace)) as repo:
            yield repo
    finally:
        dvc_logger.setLevel(level)


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
