"""Dataset versions: DVC hash + a git commit and tag per version that adds data, a listing
with episode counts and sources, and any version checked out again byte for byte."""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.ingest import versioning
from pipelines.ingest.sources import s3_client
from tests.pipelines.test_sources import FaultyProxy, proxy, s3_env, s3_server  # noqa: F401


@pytest.fixture(autouse=True)
def no_user_git_config(monkeypatch, tmp_path):
    """No global identity: versioning must bring its own, and only where none is set."""
    empty = tmp_path / "empty-gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def git(workspace: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(workspace), *args], capture_output=True, text=True, check=True
    ).stdout


def add_source(dataset: Path, name: str, episodes: int) -> str:
    """One source's pair of Parquet files, as ingest writes them (only the columns read here)."""
    sha = hashlib.sha256(name.encode()).hexdigest()
    for folder in ("episodes", "steps"):
        (dataset / folder).mkdir(parents=True, exist_ok=True)
    uris = [f"s3://fleet/line/{name}"] * episodes
    table = pa.table({"source_uri": uris, "episode_index": list(range(episodes))})
    pq.write_table(table, dataset / "episodes" / f"{sha}.parquet")
    steps = pa.table({"step": list(range(episodes * 10))})
    pq.write_table(steps, dataset / "steps" / f"{sha}.parquet")
    return sha


def snapshot(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def workspace(tmp_path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    versioning.ensure_workspace(root, ".realloop/dvc-remote")
    return root


def test_each_version_that_adds_data_is_a_commit_and_a_tag(workspace):
    dataset = workspace / "data" / "dataset"
    (workspace / "notes.txt").write_text("a user's file, staged")
    git(workspace, "add", "notes.txt")
    (workspace / "draft.txt").write_text("a user's file, untracked")

    dataset.mkdir(parents=True)
    empty = versioning.version_dataset(workspace, dataset)  # nothing ingested yet
    assert not empty.new and empty.commit is None
    assert git(workspace, "rev-list", "--all") == ""

    add_source(dataset, "a.mcap", 3)
    add_source(dataset, "b.mcap", 2)
    first = versioning.version_dataset(workspace, dataset)
    assert first.new and first.sources_added == 2 and first.files == 4
    assert first.tag == f"dataset-{first.version[:12]}"
    assert git(workspace, "log", "-1", "--format=%s") == f"dataset {first.version}: +2 files\n"
    assert git(workspace, "show", "--name-only", "--format=", "HEAD").split() == [
        "data/.gitignore",
        "data/dataset.dvc",
    ]
    assert git(workspace, "log", "-1", "--format=%an <%ae>") == "realloop <realloop@localhost>\n"
    assert git(workspace, "rev-parse", f"{first.tag}^{{commit}}").strip() == first.commit
    assert "A  notes.txt" in git(workspace, "status", "--short")  # still staged, not committed

    again = versioning.version_dataset(workspace, dataset)  # nothing added: nothing made
    assert not again.new and again.version == first.version and again.commit == first.commit
    assert len(git(workspace, "rev-list", "--all").split()) == 1
    assert git(workspace, "tag", "--list").split() == [first.tag]

    add_source(dataset, "c.mcap", 4)
    second = versioning.version_dataset(workspace, dataset)
    assert second.new and second.sources_added == 1
    assert git(workspace, "log", "-1", "--format=%s") == f"dataset {second.version}: +1 files\n"
    assert [v.version for v in versioning.list_versions(workspace)] == [
        first.version,
        second.version,
    ]
    assert len(versioning.version_sources(workspace, second.version)) == 3
    pushed = workspace / ".realloop" / "dvc-remote" / "files" / "md5"
    for version in (first, second):  # every file of every version is on the remote
        listing = pushed / version.version[:2] / f"{version.version[2:]}.dir"
        for entry in json.loads(listing.read_text()):
            assert (pushed / entry["md5"][:2] / entry["md5"][2:]).is_file()


def test_a_configured_identity_is_used_and_ignored_gitignores_are_not_committed(workspace):
    git(workspace, "config", "user.name", "Cell Ops")
    git(workspace, "config", "user.email", "ops@example.com")
    # Like the project repository: data/ ignored except the .dvc files.
    (workspace / ".gitignore").write_text("/data/*\n!/data/*.dvc\n")
    dataset = workspace / "data" / "dataset"
    add_source(dataset, "a.mcap", 1)
    version = versioning.version_dataset(workspace, dataset, push=False)
    assert git(workspace, "show", "--name-only", "--format=%an", "HEAD").split() == [
        "Cell",
        "Ops",
        "data/dataset.dvc",
    ]
    assert version.tag in git(workspace, "tag", "--list")


def test_listing_has_episode_counts_and_sources(workspace):
    dataset = workspace / "data" / "dataset"
    add_source(dataset, "a.mcap", 3)
    first = versioning.version_dataset(workspace, dataset, push=False)
    sha_b = add_source(dataset, "b.mcap", 5)
    second = versioning.version_dataset(workspace, dataset, push=False)
    listing = versioning.describe_versions(workspace, dataset)
    assert listing["current"] == second.version and listing["dataset"] == "data/dataset"
    old, new = listing["versions"]
    assert (old["version"], old["episodes"], old["current"]) == (first.version, 3, False)
    assert (new["version"], new["episodes"], new["current"]) == (second.version, 8, True)
    assert new["tag"] == second.tag and new["commit"] == second.commit
    assert {s["sha256"]: s["uri"] for s in new["sources"]}[sha_b] == "s3://fleet/line/b.mcap"
    assert [s["episodes"] for s in old["sources"]] == [3]


def test_an_older_version_checks_out_byte_identical_and_back(workspace):
    dataset = workspace / "data" / "dataset"
    add_source(dataset, "a.mcap", 2)
    first = versioning.version_dataset(workspace, dataset)
    first_files = snapshot(dataset)
    add_source(dataset, "b.mcap", 3)
    second = versioning.version_dataset(workspace, dataset)
    second_files = snapshot(dataset)

    versioning.checkout_version(workspace, first.tag)
    assert snapshot(dataset) == first_files
    assert versioning.current_version(workspace, dataset) == first.version
    with pytest.raises(ValueError, match="older version"):
        versioning.require_latest(workspace, dataset)

    back = versioning.checkout_version(workspace, "latest")
    assert back.version == second.version and snapshot(dataset) == second_files
    versioning.require_latest(workspace, dataset)
    assert git(workspace, "status", "--porcelain", "data/dataset.dvc") == ""
    # by hash prefix too
    assert versioning.checkout_version(workspace, first.version[:8]).version == first.version
    versioning.checkout_version(workspace, second.version)

    add_source(dataset, "c.mcap", 1)  # changes no version holds: a checkout would lose them
    with pytest.raises(ValueError, match="no dataset version holds"):
        versioning.checkout_version(workspace, first.tag)
    with pytest.raises(ValueError, match="no such dataset version"):
        versioning.find_version(workspace, "0123456789ab")


def test_a_crash_between_commit_and_tag_is_completed(workspace):
    dataset = workspace / "data" / "dataset"
    add_source(dataset, "a.mcap", 2)
    made = versioning.version_dataset(workspace, dataset, push=False)
    git(workspace, "tag", "-d", made.tag)
    (workspace / versioning.LEDGER).unlink()
    redone = versioning.version_dataset(workspace, dataset, push=False)
    assert not redone.new and redone.commit == made.commit and redone.sources_added == 1
    assert git(workspace, "rev-parse", f"{made.tag}^{{commit}}").strip() == made.commit
    assert [v.version for v in versioning.list_versions(workspace)] == [made.version]


def test_dvc_push_to_an_s3_remote(tmp_path, s3_env):  # noqa: F811
    bucket = f"realloop-{uuid.uuid4().hex[:12]}"
    s3_client().create_bucket(Bucket=bucket)
    root = tmp_path / "ws"
    root.mkdir()
    versioning.ensure_workspace(root, f"s3://{bucket}/dvc")
    dataset = root / "data" / "dataset"
    add_source(dataset, "a.mcap", 2)
    version = versioning.version_dataset(root, dataset)
    listed = s3_client().list_objects_v2(Bucket=bucket, Prefix="dvc/")
    keys = {item["Key"] for item in listed.get("Contents", [])}
    assert len(keys) == 3  # two Parquet files and the .dir listing
    assert any(k.endswith(version.version[2:] + ".dir") for k in keys)


@pytest.fixture
def dvc_add_targets(monkeypatch) -> list[list[str]]:
    """What each `dvc add` in versioning was given (the paths, relative to the dataset)."""
    from dvc.repo import Repo

    calls: list[list[str]] = []
    original = Repo.add

    def add(repo, targets, *args, **kwargs):
        paths = [targets] if isinstance(targets, str) else list(targets)
        calls.append([Path(p).as_posix().split("/data/dataset")[-1].lstrip("/") for p in paths])
        return original(repo, targets, *args, **kwargs)

    monkeypatch.setattr(Repo, "add", add)
    return calls


def full_add_version(workspace: Path, dataset: Path) -> dict:
    """The `.dvc` out that `dvc add` of the whole folder records now."""
    with versioning._dvc_repo(workspace) as repo:
        repo.add(str(dataset))
    return versioning._tracked_out(workspace, Path("data/dataset"))


def test_adding_a_source_adds_only_its_files_and_makes_the_folders_version(
    workspace, dvc_add_targets
):
    dataset = workspace / "data" / "dataset"
    add_source(dataset, "a.mcap", 2)
    add_source(dataset, "b.mcap", 3)
    first = versioning.version_dataset(workspace, dataset)
    assert dvc_add_targets == [[""]]  # the first version: the folder

    sha_c = add_source(dataset, "c.mcap", 4)
    second = versioning.version_dataset(workspace, dataset)
    assert dvc_add_targets[-1] == [f"episodes/{sha_c}.parquet", f"steps/{sha_c}.parquet"]
    assert second.new and second.sources_added == 1 and second.files == 6
    with versioning._dvc_repo(workspace) as repo:
        assert repo.status() == {}  # the workspace matches the version
    recorded = versioning._tracked_out(workspace, Path("data/dataset"))
    folder = full_add_version(workspace, dataset)  # what adding the folder would have made
    assert folder == recorded and folder["md5"] == f"{second.version}.dir"
    assert folder["size"] == sum(p.stat().st_size for p in dataset.rglob("*") if p.is_file())

    calls = len(dvc_add_targets)
    again = versioning.version_dataset(workspace, dataset)  # nothing new: nothing added
    assert len(dvc_add_targets) == calls and again.version == second.version and not again.new
    files = snapshot(dataset)
    versioning.checkout_version(workspace, first.tag)
    versioning.checkout_version(workspace, "latest")
    assert snapshot(dataset) == files


def test_a_changed_or_missing_old_file_makes_dvc_add_the_whole_folder(workspace, dvc_add_targets):
    dataset = workspace / "data" / "dataset"
    sha_a = add_source(dataset, "a.mcap", 2)
    add_source(dataset, "b.mcap", 3)
    first = versioning.version_dataset(workspace, dataset, push=False)

    # An old file rewritten after the version was recorded, and a new source: the folder.
    old = dataset / "episodes" / f"{sha_a}.parquet"
    pq.write_table(pa.table({"source_uri": ["s3://fleet/line/a2.mcap"]}), old)
    add_source(dataset, "c.mcap", 1)
    second = versioning.version_dataset(workspace, dataset, push=False)
    assert dvc_add_targets[-1] == [""]
    assert second.new and second.version != first.version
    with versioning._dvc_repo(workspace) as repo:
        assert repo.status() == {}

    (dataset / "steps" / f"{sha_a}.parquet").unlink()  # a listed file gone: the folder
    third = versioning.version_dataset(workspace, dataset, push=False)
    assert dvc_add_targets[-1] == [""] and third.files == second.files - 1


def test_a_git_ignored_data_folder_still_versions_each_addition(workspace, dvc_add_targets):
    # Like the project repository: DVC's index does not see data/dataset.dvc under /data/*.
    (workspace / ".gitignore").write_text("/data/*\n!/data/*.dvc\n")
    dataset = workspace / "data" / "dataset"
    add_source(dataset, "a.mcap", 1)
    first = versioning.version_dataset(workspace, dataset, push=False)
    add_source(dataset, "b.mcap", 1)
    second = versioning.version_dataset(workspace, dataset, push=False)
    assert second.new and second.files == 4 and second.version != first.version
    assert dvc_add_targets[-1] == [""]
    assert not list(dataset.rglob("*.dvc"))  # no per-file .dvc files were made


def test_a_workspace_made_here_git_ignores_the_unversioned_folders(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    versioning.ensure_workspace(
        root,
        ".realloop/dvc-remote",
        unversioned=(root / "data" / "landing", tmp_path / "elsewhere"),
    )
    lines = (root / ".gitignore").read_text().splitlines()
    assert "/data/landing/" in lines and "/.realloop/" in lines
    assert not any("elsewhere" in line for line in lines)  # outside: nothing to ignore
