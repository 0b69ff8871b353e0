"""The DVC side of dataset versions: the workspace's DVC repo, `dvc add` of the dataset folder
(or of only its new files, when that makes the same listing), `dvc push` of one version, and
the `.dir` listings in DVC's cache that say which files (so which sources) a version holds."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from pipelines.ingest.git_tags import VersioningError

GRANULAR_MAX = 64  # new files up to which `dvc add` is given the files, not the folder
_EMPTY_DIR_MD5 = "d751713988987e9331980363e24189ce"


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
    with _transfer_errors() as errors:
        if files:
            objects = [HashInfo("md5", f) for f in sorted(files)]
            failed = len(repo.cloud.transfer(cache, remote, objects, cache_odb=cache).failed)
    if not failed:
        listing = f"{version}.dir"
        try:
            remote.add(cache.oid_to_path(listing), cache.fs, listing)
        except Exception as exc:  # the remote's own errors (a dropped connection, a 5xx, ...)
            errors.append(exc)
            failed = 1
    if failed or not remote.exists(f"{version}.dir"):
        raise VersioningError(
            f"dvc push: dataset version {version} did not fully reach the remote "
            f"({failed} object(s) failed); the next ingest retries"
        ) from (errors[0] if errors else None)  # the cause says whether the disk was full


@contextmanager
def _transfer_errors() -> Iterator[list[BaseException]]:
    """The exceptions DVC's transfer logs for objects that failed (it counts them and goes
    on), kept here instead of printed: one traceback per object is not what a user reads."""
    errors: list[BaseException] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                errors.append(record.exc_info[1])

    transfer_logger = logging.getLogger("dvc_data.hashfile.transfer")
    handler, propagate = Keep(), transfer_logger.propagate
    transfer_logger.addHandler(handler)
    transfer_logger.propagate = False
    try:
        yield errors
    finally:
        transfer_logger.removeHandler(handler)
        transfer_logger.propagate = propagate


def _remote_url(repo) -> str:
    """The default remote's URL as configured (a folder or s3://...), for messages."""
    try:
        name = repo.config["core"]["remote"]
        return str(repo.config["remote"][name]["url"])
    except (KeyError, TypeError):
        return "the DVC remote"


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
