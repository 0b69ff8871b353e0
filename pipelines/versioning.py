"""Dataset versions with DVC: the version of a dataset is DVC's content hash of its folder.

The workspace (the folder realloop runs in) is a git repository with DVC initialised. `dvc add`
writes `<dataset>.dvc`, whose `md5` of the folder listing is the dataset version that MLflow
runs, registry tags, bundles and lineage records quote. The `.dir` listing in DVC's cache says
which per-source Parquet files a version holds, so a version also answers "which logs?".
Each version is appended to a small ledger (`.realloop/datasets.jsonl`) so lineage can search
every version ever made, not just the current one.
"""

from __future__ import annotations

import json
import logging
import subprocess
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

LEDGER = Path(".realloop/datasets.jsonl")
DEFAULT_REMOTE_NAME = "realloop"


@dataclass(frozen=True)
class DatasetVersion:
    version: str  # DVC md5 of the folder listing, without DVC's ".dir" suffix
    path: str  # the dataset folder, relative to the workspace
    files: int
    size_bytes: int
    created_at: str

    def as_dict(self) -> dict:
        return asdict(self)


def ensure_workspace(workspace: Path, remote_url: str) -> None:
    """Make `workspace` a git repository with DVC initialised and a default remote."""
    if not (workspace / ".git").exists():
        subprocess.run(["git", "init", "-q", str(workspace)], check=True)
    with _dvc_repo(workspace, init=True) as repo:
        if repo.config["core"].get("remote"):
            return  # the team configured one (e.g. `dvc remote add -d store s3://...`)
        # A machine's own folder belongs in config.local, never in the committed config.
        with repo.config.edit("local") as config:
            url = remote_url if "://" in remote_url else str((workspace / remote_url).resolve())
            config.setdefault("remote", {})[DEFAULT_REMOTE_NAME] = {"url": url}
            config.setdefault("core", {})["remote"] = DEFAULT_REMOTE_NAME


def version_dataset(workspace: Path, dataset: Path, push: bool = True) -> DatasetVersion:
    """`dvc add` the dataset folder (and `dvc push` it); record and return its version."""
    relative = _relative(workspace, dataset)
    with _dvc_repo(workspace) as repo:
        repo.add(str(workspace.resolve() / relative))
        if push:
            repo.push()
    out = _tracked_out(workspace, relative)
    version = DatasetVersion(
        version=out["md5"].removesuffix(".dir"),
        path=str(relative),
        files=int(out.get("nfiles", 0)),
        size_bytes=int(out.get("size", 0)),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    _append_ledger(workspace, version)
    return version


def current_version(workspace: Path, dataset: Path) -> str:
    """The dataset version the workspace holds now, as its `.dvc` file records it."""
    return _tracked_out(workspace, _relative(workspace, dataset))["md5"].removesuffix(".dir")


def _tracked_out(workspace: Path, relative: Path) -> dict:
    dvc_file = workspace / f"{relative}.dvc"
    if not dvc_file.is_file():
        raise ValueError(f"{dvc_file}: the dataset is not versioned yet; run `realloop ingest`")
    return yaml.safe_load(dvc_file.read_text())["outs"][0]


def version_files(workspace: Path, version: str) -> list[str]:
    """Relative paths of every file in a dataset version, from DVC's cached `.dir` listing."""
    listing = workspace / ".dvc" / "cache" / "files" / "md5" / version[:2] / f"{version[2:]}.dir"
    if not listing.is_file():
        raise ValueError(f"{listing}: dataset version {version} is not in the DVC cache (dvc pull)")
    return [entry["relpath"] for entry in json.loads(listing.read_text())]


def version_sources(workspace: Path, version: str) -> list[str]:
    """The source sha256s whose episodes a dataset version holds."""
    return sorted(
        Path(relpath).stem
        for relpath in version_files(workspace, version)
        if relpath.startswith("episodes/") and relpath.endswith(".parquet")
    )


def list_versions(workspace: Path) -> list[DatasetVersion]:
    """Every dataset version made in this workspace, oldest first, without repeats."""
    ledger = workspace / LEDGER
    if not ledger.is_file():
        return []
    seen: dict[str, DatasetVersion] = {}
    for line in ledger.read_text().splitlines():
        row = DatasetVersion(**json.loads(line))
        seen.setdefault(row.version, row)
    return list(seen.values())


def _append_ledger(workspace: Path, version: DatasetVersion) -> None:
    ledger = workspace / LEDGER
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as handle:
        handle.write(json.dumps(version.as_dict()) + "\n")


def _relative(workspace: Path, path: Path) -> Path:
    path = Path(path)
    return path.resolve().relative_to(workspace.resolve()) if path.is_absolute() else path


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
