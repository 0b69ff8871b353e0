"""Ingest refuses, in one line and before it writes, to version a dataset where the commit
would go to no branch, into a user's merge or rebase, or over someone's uncommitted edit of
the `.dvc` file; an unfinished version of its own (a run killed between `dvc add` and the
commit) is completed instead."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipelines.ingest import check_can_version, versioning
from pipelines.ingest.dvc_repo import _dvc_add, _dvc_repo
from tests.pipelines.test_versioning import add_source, git, no_user_git_config, snapshot  # noqa: F401


@pytest.fixture
def workspace(tmp_path) -> Path:
    """A workspace with one dataset version, on branch main."""
    root = tmp_path / "ws"
    root.mkdir()
    versioning.ensure_workspace(root, ".realloop/dvc-remote")
    git(root, "checkout", "-q", "-B", "main")
    add_source(root / "data" / "dataset", "a.mcap", 2)
    versioning.version_dataset(root, root / "data" / "dataset", push=False)
    return root


def refusal(workspace: Path) -> str:
    before = snapshot(workspace)
    with pytest.raises(ValueError) as raised:
        check_can_version(workspace, workspace / "data" / "dataset")
    assert snapshot(workspace) == before  # refused before writing anything
    message = str(raised.value)
    assert "\n" not in message
    return message


def conflict(workspace: Path, command: list[str]) -> None:
    """Leave `command` (a merge or a rebase of branch `other`) stopped on a conflict."""
    notes = workspace / "notes.txt"
    notes.write_text("base\n")
    git(workspace, "add", "notes.txt")
    git(workspace, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qm", "base")
    git(workspace, "checkout", "-qb", "other")
    notes.write_text("theirs\n")
    git(workspace, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qam", "theirs")
    git(workspace, "checkout", "-q", "main")
    notes.write_text("ours\n")
    git(workspace, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qam", "ours")
    done = subprocess.run(
        ["git", "-C", str(workspace), "-c", "user.name=u", "-c", "user.email=u@x", *command],
        capture_output=True,
    )
    assert done.returncode != 0  # stopped on the conflict


def test_a_clean_workspace_on_a_branch_may_version(workspace):
    check_can_version(workspace, workspace / "data" / "dataset")


def test_a_detached_head_is_refused(workspace):
    git(workspace, "checkout", "-q", "--detach")
    assert "git HEAD is detached" in refusal(workspace)
    assert "git switch main" in refusal(workspace)


@pytest.mark.parametrize(
    ("command", "operation"),
    [(["merge", "other"], "a merge"), (["rebase", "other"], "a rebase")],
)
def test_a_merge_or_rebase_in_progress_is_refused(workspace, command, operation):
    conflict(workspace, command)
    assert f"{operation} is in progress" in refusal(workspace)


def test_an_uncommitted_edit_of_the_dvc_file_is_refused(workspace):
    dvc_file = workspace / "data" / "dataset.dvc"
    dvc_file.write_text(dvc_file.read_text() + "# a note\n")
    message = refusal(workspace)
    assert "dataset.dvc: has uncommitted changes" in message
    assert "git checkout HEAD -- data/dataset.dvc" in message


def test_an_unfinished_version_of_its_own_is_completed(workspace):
    """`dvc add` ran, the commit did not (the run was killed): the next ingest may go on."""
    add_source(workspace / "data" / "dataset", "b.mcap", 3)
    with _dvc_repo(workspace) as repo:
        _dvc_add(repo, workspace, Path("data/dataset"))
    assert git(workspace, "status", "--porcelain", "--", "data/dataset.dvc").strip()
    check_can_version(workspace, workspace / "data" / "dataset")
    assert versioning.version_dataset(workspace, workspace / "data" / "dataset", push=False).new
