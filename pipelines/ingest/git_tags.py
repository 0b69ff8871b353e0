"""The git side of dataset versions: what a version records (DatasetVersion), the commit of
exactly `<dataset>.dvc`, and the annotated `dataset-<hash[:12]>` tag whose message ends in
trailers that carry the record, so that one `git for-each-ref` lists every version, also in
a fresh clone. VersioningError is what git or DVC refusing raises."""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

TAG_PREFIX = "dataset-"
GIT_IDENTITY = ("-c", "user.name=realloop", "-c", "user.email=realloop@localhost")
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
