"""Install, roll back and report model bundles on the edge box.

Layout of the destination folder:
```
DIR/releases/<bundle_id>/       model.safetensors, config.json, manifest.json (complete, verified)
DIR/current  -> releases/<id>   the model the cell runs; swapped atomically
DIR/previous -> releases/<id>   what `rollback` goes back to
DIR/history.jsonl               one line per activation
DIR/.staging/                   downloads in progress; never read by the cell
```
A bundle is downloaded into .staging, every file's size and sha256 is checked against the
manifest, and only then is it renamed into releases/ and `current` re-pointed with os.replace,
so a reader of DIR/current always sees one complete model. Files are opaque bytes here: nothing
is ever deserialised, let alone unpickled.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.bundle import (
    MANIFEST_NAME,
    MODEL_FILE,
    bundle_file_key,
    check_manifest,
    check_name,
    parse_json,
    parse_pointer,
    pointer_key,
    utc_timestamp,
)
from edge.channel import Channel
from edge.channels import open_channel
from edge.errors import EdgeError, KeyNotFoundError, describe_os_error
from edge.integrity import sha256_bytes, sha256_file, verify_manifest

CURRENT_LINK = "current"
PREVIOUS_LINK = "previous"
RELEASES_DIR = "releases"
STAGING_DIR = ".staging"
HISTORY_FILE = "history.jsonl"
LOCK_FILE = ".lock"


@dataclass(frozen=True)
class ChannelBundle:
    """A bundle's manifest as fetched from the channel and checked against the pointer."""

    cell_id: str
    bundle_id: str
    manifest: dict[str, Any]
    manifest_bytes: bytes


def pull(
    channel_uri: str, cell_id: str, dest: Path, public_key: Path | None = None
) -> dict[str, Any]:
    """Install and activate the bundle the channel's CURRENT.json names for `cell_id`.

    Nothing on the box changes unless the whole bundle downloaded and verified; then the
    `current` link is swapped and the replaced model becomes `previous`.
    """
    dest = _prepared(dest)
    with _exclusive(dest):
        with _unchanged_on_failure():
            channel = open_channel(channel_uri)
            bundle = fetch_bundle(channel, cell_id, public_key)
            if _link_target(dest, CURRENT_LINK) == bundle.bundle_id:
                return {"action": "already_active", **_summary(dest)}
            _install_release(channel, bundle, dest)
        _activate(dest, bundle.bundle_id, action="pull")
        _prune_releases(dest)
        return {"action": "activated", **_summary(dest)}


def rollback(dest: Path) -> dict[str, Any]:
    """Swap `current` and `previous`: the model that ran before the last activation runs again."""
    dest = Path(dest)
    if not dest.is_dir():
        raise EdgeError(f"{dest}: no such folder; nothing was ever pulled there (check --dest)")
    with _exclusive(dest):
        with _unchanged_on_failure():
            previous = _link_target(dest, PREVIOUS_LINK)
            if previous is None:
                raise EdgeError(
                    f"{dest}: no previous model to roll back to (fewer than two bundles were "
                    "activated here)"
                )
            manifest = _release_manifest(dest, previous)
            _verify_files(dest / RELEASES_DIR / previous, manifest, previous)
        _activate(dest, previous, action="rollback")
        return {"action": "rolled_back", **_summary(dest)}


def status(dest: Path) -> dict[str, Any]:
    """What runs now: the active release's folder, manifest fields, model sha256, previous."""
    return _summary(Path(dest))


def fetch_bundle(channel: Channel, cell_id: str, public_key: Path | None = None) -> ChannelBundle:
    """Read CURRENT.json and the manifest it names; check the manifest sha and the signature."""
    key = pointer_key(cell_id)
    try:
        pointer = parse_pointer(channel.get_bytes(key), channel.describe(key))
    except KeyNotFoundError as exc:
        raise EdgeError(
            f"{exc}; nothing has been published for cell {cell_id!r} on this channel "
            "(check --channel and --cell)"
        ) from None
    bundle_id = pointer.bundle_id
    with _prefixed(f"bundle {bundle_id} file {MANIFEST_NAME}: "):
        manifest_bytes = channel.get_bytes(bundle_file_key(cell_id, bundle_id, MANIFEST_NAME))
    actual = sha256_bytes(manifest_bytes)
    if actual != pointer.manifest_sha256:
        raise EdgeError(
            f"bundle {bundle_id} file {MANIFEST_NAME}: sha256 mismatch with CURRENT.json "
            f"(expected {pointer.manifest_sha256}, got {actual}); refusing to activate"
        )
    with _prefixed(f"bundle {bundle_id} file "):
        manifest = check_manifest(parse_json(manifest_bytes, MANIFEST_NAME), cell_id, bundle_id)
        if public_key is not None:
            verify_manifest(manifest, public_key)
    return ChannelBundle(cell_id, bundle_id, manifest, manifest_bytes)


def _install_release(channel: Channel, bundle: ChannelBundle, dest: Path) -> None:
    """Download into staging, verify every file, then rename the folder into releases/."""
    staging_root = dest / STAGING_DIR
    shutil.rmtree(staging_root, ignore_errors=True)  # leftovers of an interrupted pull
    staging = staging_root / bundle.bundle_id
    staging.mkdir(parents=True)
    try:
        for name in bundle.manifest["files"]:
            with _prefixed(f"bundle {bundle.bundle_id} file {name}: "):
                key = bundle_file_key(bundle.cell_id, bundle.bundle_id, name)
                channel.get_file(key, staging / name)
        (staging / MANIFEST_NAME).write_bytes(bundle.manifest_bytes)
        _verify_files(staging, bundle.manifest, bundle.bundle_id)
        # Durable before visible: a power cut must not leave an activated but empty file.
        for path in [*staging.iterdir(), staging]:
            _fsync(path)
        release = dest / RELEASES_DIR / bundle.bundle_id
        release.parent.mkdir(exist_ok=True)
        # A same-id release can only be a stale copy (e.g. the one rolled back from); this
        # fresh, verified download replaces it. It is never the active one (checked by caller).
        _remove_tree(release)
        os.rename(staging, release)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)


def _verify_files(folder: Path, manifest: dict[str, Any], bundle_id: str) -> None:
    """Raise EdgeError unless every file listed in the manifest has its size and sha256."""
    for name, expected in manifest["files"].items():
        path = folder / name
        where = f"bundle {bundle_id} file {name}"
        if not path.is_file():
            raise EdgeError(f"{where}: missing from {folder}; refusing to activate")
        size = path.stat().st_size
        if size != expected["size"]:
            raise EdgeError(
                f"{where}: size mismatch (expected {expected['size']} bytes, got {size}); "
                "refusing to activate"
            )
        digest = sha256_file(path)
        if digest != expected["sha256"]:
            raise EdgeError(
                f"{where}: sha256 mismatch (expected {expected['sha256']}, got {digest}); "
                "refusing to activate"
            )


def _activate(dest: Path, bundle_id: str, action: str) -> None:
    """Point `current` at releases/<bundle_id>; the replaced target becomes `previous`.

    `previous` is re-pointed first: a crash between the two swaps leaves both links on the old
    model, which is consistent, instead of losing the way back.
    """
    replaced = _link_target(dest, CURRENT_LINK)
    if replaced is not None and replaced != bundle_id:
        _point_link(dest, PREVIOUS_LINK, replaced)
    _point_link(dest, CURRENT_LINK, bundle_id)
    manifest = _release_manifest(dest, bundle_id)
    _append_history(dest, action, bundle_id, manifest.get("model_version"))


def _point_link(dest: Path, link_name: str, bundle_id: str) -> None:
    # A relative target keeps the folder relocatable; os.replace makes the swap atomic.
    temp = dest / f".{link_name}.{secrets.token_hex(4)}.tmp"
    os.symlink(f"{RELEASES_DIR}/{bundle_id}", temp)
    try:
        os.replace(temp, dest / link_name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync(dest)


def _link_target(dest: Path, link_name: str) -> str | None:
    """The bundle id a link points at, None when the link does not exist."""
    link = dest / link_name
    if not link.is_symlink():
        if link.exists():
            raise EdgeError(
                f"{link}: exists but is not a symlink; realloop-edge manages it, move it aside"
            )
        return None
    return check_name(Path(os.readlink(link)).name, f"{link} target")


def _release_manifest(dest: Path, bundle_id: str) -> dict[str, Any]:
    path = dest / RELEASES_DIR / bundle_id / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EdgeError(
            f"{describe_os_error(exc)}; the release is damaged, pull again to reinstall it"
        ) from None
    manifest = parse_json(data, str(path))
    if not isinstance(manifest, dict):
        raise EdgeError(f"{path}: not a JSON object; pull again to reinstall the release")
    return manifest


def _summary(dest: Path) -> dict[str, Any]:
    bundle_id = _link_target(dest, CURRENT_LINK)
    if bundle_id is None:
        raise EdgeError(f"{dest}: no active model; run `realloop-edge pull` first")
    manifest = _release_manifest(dest, bundle_id)
    # Resolved from the id just read, not from the link again: stays consistent mid-swap.
    path = os.path.realpath(dest / RELEASES_DIR / bundle_id)
    model_sha256 = sha256_file(Path(path) / MODEL_FILE)
    previous = _link_target(dest, PREVIOUS_LINK)
    return {
        "path": path,
        "bundle_id": bundle_id,
        "cell_id": manifest.get("cell_id"),
        "model_name": manifest.get("model_name"),
        "model_version": manifest.get("model_version"),
        "dataset_version": manifest.get("dataset_version"),
        "mlflow_run_id": manifest.get("mlflow_run_id"),
        "created_at": manifest.get("created_at"),
        "activated_at": _activated_at(dest, bundle_id),
        "sha256": model_sha256,
        "intact": model_sha256 == manifest.get("files", {}).get(MODEL_FILE, {}).get("sha256"),
        "signed": bool(manifest.get("signature")),
        "previous": _previous_summary(dest, previous),
    }


def _previous_summary(dest: Path, bundle_id: str | None) -> dict[str, Any] | None:
    if bundle_id is None:
        return None
    try:
        model_version = _release_manifest(dest, bundle_id).get("model_version")
    except EdgeError:  # a damaged previous release must not hide what runs now
        model_version = None
    return {"bundle_id": bundle_id, "model_version": model_version}


def _append_history(dest: Path, action: str, bundle_id: str, model_version: Any) -> None:
    record = {
        "time": utc_timestamp(),
        "action": action,
        "bundle_id": bundle_id,
        "model_version": model_version,
    }
    with open(dest / HISTORY_FILE, "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")
        log.flush()
        os.fsync(log.fileno())


def read_history(dest: Path) -> list[dict[str, Any]]:
    """Activation records, oldest first; unreadable lines (e.g. a torn last write) are skipped."""
    try:
        lines = (Path(dest) / HISTORY_FILE).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _activated_at(dest: Path, bundle_id: str) -> str | None:
    matching = [r.get("time") for r in read_history(dest) if r.get("bundle_id") == bundle_id]
    return matching[-1] if matching else None


def _prune_releases(dest: Path) -> None:
    """Delete releases neither `current` nor `previous` points at: the box's disk is small."""
    keep = {_link_target(dest, CURRENT_LINK), _link_target(dest, PREVIOUS_LINK)}
    for release in (dest / RELEASES_DIR).iterdir():
        if release.name not in keep:
            _remove_tree(release)


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _prepared(dest: Path) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (renames, new links), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _exclusive(dest: Path) -> Iterator[None]:
    """One pull or rollback at a time per destination folder."""
    with open(dest / LOCK_FILE, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EdgeError(
                f"{dest}: another realloop-edge pull or rollback is running; try again later"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _prefixed(prefix: str) -> Iterator[None]:
    """Say which bundle/file an error is about, whatever layer raised it."""
    try:
        yield
    except EdgeError as exc:
        raise type(exc)(f"{prefix}{exc}") from None


@contextmanager
def _unchanged_on_failure() -> Iterator[None]:
    """Failures before activation leave the box as it was; say so, so nobody has to check."""
    try:
        yield
    except EdgeError as exc:
        raise EdgeError(f"{exc}; the active model is unchanged") from None
    except OSError as exc:
        raise EdgeError(f"{describe_os_error(exc)}; the active model is unchanged") from None
