"""Git states in which ingest must not make a dataset version, refused before it writes.

Ingest commits `<dataset>.dvc` and tags the commit. On a detached HEAD that commit belongs to
no branch (and back on a branch, the dataset and `data/dataset.dvc` disagree); during a merge,
rebase, cherry-pick or revert it would land in the user's half-done operation; over
uncommitted edits of `<dataset>.dvc` it would commit someone else's change as a version.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# git's marker files for an operation in progress, and how a user leaves each one.
_IN_PROGRESS = {
    "MERGE_HEAD": ("a merge", "finish it with `git commit` or abort it with `git merge --abort`"),
    "rebase-merge": ("a rebase", "finish it (`git rebase --continue`) or `git rebase --abort`"),
    "rebase-apply": ("a rebase", "finish it (`git rebase --continue`) or `git rebase --abort`"),
    "CHERRY_PICK_HEAD": ("a cherry-pick", "finish it or `git cherry-pick --abort`"),
    "REVERT_HEAD": ("a revert", "finish it or `git revert --abort`"),
}


def git_state_refusal(workspace: Path) -> str | None:
    """Why ingest must not commit in `workspace`'s repository now (one line saying what to
    do): an operation in progress or a detached HEAD; None when it may."""
    if not (workspace / ".git").exists():
        return None  # no repository of its own yet: ingest makes one (versioning)
    git_dir = _git(workspace, "rev-parse", "--absolute-git-dir") or str(workspace / ".git")
    for marker, (operation, leave) in _IN_PROGRESS.items():
        if (Path(git_dir) / marker).exists():
            return (
                f"{workspace}: {operation} is in progress in the workspace's git repository; "
                f"{leave}, then ingest again (a dataset version must not go into it)"
            )
    if _git(workspace, "symbolic-ref", "-q", "HEAD") is None:
        at = _git(workspace, "rev-parse", "--short", "HEAD") or "no commit"
        return (
            f"{workspace}: git HEAD is detached (at {at}), so a dataset version would be "
            "committed to no branch; `git switch main` (or `git switch -c <branch>`) first"
        )
    return None


def dvc_file_refusal(workspace: Path, dvc_file: Path) -> str | None:
    """Why the uncommitted state of `dvc_file` (relative to `workspace`) forbids a version."""
    changed = _git(workspace, "status", "--porcelain", "--", dvc_file.as_posix())
    if changed and not _unfinished_version(workspace, dvc_file):
        return (
            f"{workspace / dvc_file}: has uncommitted changes ({changed.split()[0]}); commit "
            f"them, or `git checkout HEAD -- {dvc_file.as_posix()}` to drop them, then ingest"
        )
    return None


def _unfinished_version(workspace: Path, dvc_file: Path) -> bool:
    """Whether the uncommitted `.dvc` file is ingest's own version that a killed run added
    (`dvc add` wrote it and its listing) but did not commit: the next run completes it. A
    user's edit names no listing in DVC's cache; an older version checked out by hand is an
    existing version (and `require_latest` says what to do about it)."""
    from pipelines.ingest import versioning

    dataset = workspace / dvc_file.with_suffix("")
    try:
        held = versioning.current_version(workspace, dataset)
        versioning.version_files(workspace, held)  # its listing is in the cache
    except (ValueError, KeyError, OSError):
        return False
    return held not in {v.version for v in versioning.list_versions(workspace)}


def _git(workspace: Path, *args: str) -> str | None:
    """git's output (stripped), or None when it fails."""
    done = subprocess.run(["git", *args], cwd=workspace, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def check_can_version(workspace: Path, dataset: Path) -> None:
    """Raise ValueError (one line saying what to do) when ingest must not make a dataset
    version in `workspace` now: an unsafe git state, or a dataset checked out at an older
    version. Called before anything is written."""
    from pipelines.ingest.versioning import require_latest

    workspace = Path(workspace).resolve()
    relative = Path(dataset).resolve().relative_to(workspace)
    refusal = git_state_refusal(workspace)
    if refusal:
        raise ValueError(refusal)
    require_latest(workspace, dataset)  # an older version checked out: says how to go back
    refusal = dvc_file_refusal(workspace, relative.with_name(relative.name + ".dvc"))
    if refusal:
        raise ValueError(refusal)
