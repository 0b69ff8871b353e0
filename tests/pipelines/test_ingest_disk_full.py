"""Disk full at each step of ingest: one line naming the step and the path, nothing
half-written, every landed file still in landing, and after freeing space the next run
completes with the dataset a clean run makes.

The full disks are real: a small tmpfs mounted where the step writes, filled with one
preallocated file (freeing space = deleting it). Mounting needs root; elsewhere these skip.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pipelines.ingest.disk import DiskFullError
from pipelines.ingest.store import MANIFEST_NAME, _append_line, dataset_content_hash, sha256_file
from tests.pipelines.test_ingest_helpers import copy_landing, ingest, recorded_shift

pytestmark = pytest.mark.timeout(300)


class Disk:
    """A mounted tmpfs; `fill(leave)` leaves `leave` bytes free, `free()` frees it again."""

    def __init__(self, path: Path):
        self.path = path
        self.filler = path / ".filler"

    def fill(self, leave: int = 0) -> None:
        stat = os.statvfs(self.path)
        free = stat.f_bavail * stat.f_frsize
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, free - leave)
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def small_disk():
    """mount(path, size) → a Disk; unmounted after the test."""
    mounted: list[Path] = []

    def mount(path: Path, size: str = "4m") -> Disk:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "realloop-test", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(path)
        return Disk(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def landed(tmp_path_factory, params):
    """A landing folder (three logs, captures) and the content hash a clean ingest of it
    gives (run columns left out: which run wrote a row and when)."""
    base = tmp_path_factory.mktemp("landed")
    landing = copy_landing(recorded_shift(), base)
    clean = base / "clean"
    clean.mkdir()
    report = ingest(clean, landing, params)
    assert report.as_dict()["files_ingested"] == 3
    return landing, dataset_content_hash(clean / "dataset")


def snapshot(landing: Path) -> dict[str, str]:
    files = (p for p in landing.rglob("*") if p.is_file())
    return {p.relative_to(landing).as_posix(): sha256_file(p) for p in files}


def leftovers(folder: Path) -> list[str]:
    """Temporaries and data files under `folder` (the filler and lock files aside)."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != ".filler" and not p.name.endswith(".lock")
    )


def manifest_lines_parse(data: Path) -> bool:
    manifest = data / MANIFEST_NAME
    return not manifest.exists() or all(json.loads(x) for x in manifest.read_text().splitlines())


def test_staging_on_a_full_disk_stops_in_one_line_and_the_next_run_completes(
    tmp_path, params, landed, small_disk
):
    landing, clean_hash = landed
    before = snapshot(landing)
    data = tmp_path / "data"
    disk = small_disk(data)
    disk.fill(leave=8192)
    with pytest.raises(DiskFullError) as failed:
        ingest(data, landing, params)
    staging = data / ".ingest-tmp"
    assert str(failed.value) == (
        f"ingest: disk full while staging the decoded Parquet at {staging}: "
        "free space and run again"
    )
    assert snapshot(landing) == before  # nothing lost, nothing moved
    written = leftovers(data)
    assert not [p for p in written if p.endswith(".tmp") or p.endswith(".parquet")], written
    assert manifest_lines_parse(data)

    disk.free()
    report = ingest(data, landing, params).as_dict()
    assert (report["files_ingested"], report["files_quarantined"]) == (3, 0)
    assert dataset_content_hash(data / "dataset") == clean_hash


def test_a_dataset_on_its_own_disk_is_published_and_a_full_one_refused(
    tmp_path, params, landed, small_disk
):
    """The temp folder is on the workspace's disk, the dataset on another (EXDEV)."""
    landing, clean_hash = landed
    data = tmp_path / "data"
    disk = small_disk(data / "dataset")
    disk.fill(leave=0)
    with pytest.raises(DiskFullError) as failed:
        ingest(data, landing, params)
    assert str(failed.value).startswith(
        f"ingest: disk full while publishing into the dataset at {data / 'dataset'}: "
    )
    assert not [p for p in leftovers(data / "dataset") if not p.startswith("attachments/")]
    assert not list((data / ".ingest-tmp").iterdir())  # staged files removed
    assert manifest_lines_parse(data)

    disk.free()
    report = ingest(data, landing, params).as_dict()
    assert report["files_ingested"] == 3
    assert dataset_content_hash(data / "dataset") == clean_hash


def test_quarantine_on_a_full_disk_leaves_the_file_in_landing_whole(tmp_path, params, small_disk):
    landing = tmp_path / "landing"
    landing.mkdir()
    bad = landing / "cell-07_junk.mcap"
    bad.write_bytes(os.urandom(200_000))  # not MCAP: quarantined, copied across disks
    sha = sha256_file(bad)
    quarantine = tmp_path / "quarantine"
    disk = small_disk(quarantine, size="1m")
    disk.fill(leave=64 * 1024)  # the reason file fits, the copy does not
    from pipelines.ingest.landing import ingest_landing

    def run():
        return ingest_landing(
            landing, tmp_path / "dataset", quarantine, params.cell, params.ingest, "run-1"
        )

    with pytest.raises(DiskFullError) as failed:
        run()
    assert str(failed.value).startswith(f"ingest: disk full while quarantining at {quarantine}: ")
    assert bad.is_file() and sha256_file(bad) == sha
    assert leftovers(quarantine) == []  # no partial copy, no reason file without its file

    disk.free()
    report = run().as_dict()
    (row,) = report["quarantined"]
    assert "MCAP" in row["reason"] or "mcap" in row["reason"]
    assert sha256_file(Path(row["moved_to"])) == sha and not bad.exists()


def test_an_append_that_finds_the_disk_full_leaves_no_half_line(tmp_path, small_disk):
    disk = small_disk(tmp_path / "data", size="1m")
    manifest = disk.path / MANIFEST_NAME
    line = {"source": "x" * 4000}
    _append_line(manifest, line)
    manifest.write_bytes(manifest.read_bytes().ljust(4095, b" ")[:4095] + b"\n")  # a full page
    before = manifest.read_bytes()
    disk.fill(leave=0)
    with pytest.raises(OSError) as failed:
        _append_line(manifest, line)
    assert failed.value.errno == 28
    assert manifest.read_bytes() == before


def test_versioning_on_a_full_disk_makes_no_partial_version_and_the_next_run_completes(
    tmp_path, params, landed, small_disk, monkeypatch, capfd
):
    """DVC's cache full: no `.dvc` file, no commit. The remote full: the version stands
    locally, one line says the push failed, and the next run pushes it."""
    from pipelines.ingest import versioning

    empty = tmp_path / "empty-gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    landing, clean_hash = landed
    workspace = tmp_path / "ws"
    remote = tmp_path / "remote"
    workspace.mkdir()
    versioning.ensure_workspace(workspace, str(remote))
    dataset = workspace / "data" / "dataset"
    assert ingest(dataset.parent, landing, params).as_dict()["files_ingested"] == 3

    cache = small_disk(workspace / ".dvc" / "cache")
    cache.fill(leave=0)
    with pytest.raises(DiskFullError) as failed:
        versioning.version_dataset(workspace, dataset)
    assert str(failed.value).startswith(
        f"ingest: disk full while writing the dataset version at {workspace / '.dvc' / 'cache'}: "
    )
    assert not (workspace / "data" / "dataset.dvc").exists()
    assert versioning.list_versions(workspace) == []
    cache.free()

    store = small_disk(remote)
    store.fill(leave=0)
    capfd.readouterr()
    with pytest.raises(DiskFullError) as failed:
        versioning.version_dataset(workspace, dataset)
    assert str(failed.value) == (
        f"ingest: disk full while pushing to the DVC remote at {remote}: free space and run again"
    )
    assert capfd.readouterr().err == ""  # DVC's per-object tracebacks kept, not printed
    version = versioning.current_version(workspace, dataset)
    store.free()
    again = versioning.version_dataset(workspace, dataset)
    assert again.version == version and not again.new
    assert (remote / "files" / "md5" / version[:2] / f"{version[2:]}.dir").is_file()
    assert dataset_content_hash(dataset) == clean_hash


def test_the_error_is_one_line_and_crosses_to_a_worker_and_back():
    import copy
    import errno

    from pipelines.ingest.disk import is_disk_full, on_disk_full
    from pipelines.ingest.git_tags import VersioningError

    staging = on_disk_full("staging the decoded Parquet", "/ws/data/.ingest-tmp")
    with pytest.raises(DiskFullError) as failed, staging:
        raise OSError(errno.ENOSPC, "No space left on device")
    error = failed.value
    assert str(error) == (
        "ingest: disk full while staging the decoded Parquet at /ws/data/.ingest-tmp: "
        "free space and run again"
    )
    assert error.errno == errno.ENOSPC and isinstance(error, OSError)
    back = copy.deepcopy(error)  # the same __reduce__ Dask uses to return it from a worker
    assert type(back) is DiskFullError and str(back) == str(error)
    # git says it in words: still a full disk; any other error passes through unchanged
    assert is_disk_full(VersioningError("git commit in /ws: fatal: No space left on device"))
    with pytest.raises(PermissionError), on_disk_full("quarantining", "/q"):
        raise PermissionError(errno.EACCES, "Permission denied")
