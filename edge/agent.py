"""Install, repair, roll back and report signed releases on the edge box.

Layout of the box folder:
```
BOX/tuf/                        enrolment (channel, cell) and the trusted TUF metadata
BOX/releases/<folder>/          the files, release.json and attestation.json (verified)
BOX/current  -> releases/<id>   the model the cell runs; swapped atomically
BOX/previous -> releases/<id>   what `rollback` goes back to
BOX/history.jsonl               one line per activation
BOX/.staging/                   downloads in progress; never read by the cell
```
A pull refreshes the signed metadata (edge.tuf_client), downloads the cell's release.json and
every file it names into .staging, each checked against its signed length and sha256; a gated
release's attestation is verified against the signed gate keys and the model's sha256. Only
then is the folder renamed into releases/ and `current` re-pointed with os.replace, so a reader
of BOX/current always sees one complete model. A release older than the active one is refused
unless its signed decision is a rollback. An active model whose files no longer match is
re-fetched (repair), or the box rolls back to `previous`; if neither works it fails. Files are
opaque bytes here: nothing is ever deserialised, let alone unpickled.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edge.attestation import gate_keys_from, verify_gate_attestation
from edge.attestation import summary as attestation_summary
from edge.bundle import MODEL_FILE, check_name, parse_json, utc_timestamp
from edge.errors import EdgeError, NothingPublishedError, describe_os_error
from edge.integrity import sha256_file
from edge.release import check_release
from edge.tuf_client import SignedChannel
from edge.tuf_repo import (
    ATTESTATION_NAME,
    GATE_KEYS_TARGET,
    RELEASE_NAME,
    bundle_target,
    release_target,
)

CURRENT_LINK = "current"
PREVIOUS_LINK = "previous"
RELEASES_DIR = "releases"
STAGING_DIR = ".staging"
HISTORY_FILE = "history.jsonl"
LOCK_FILE = ".lock"


def pull(box: Path) -> dict[str, Any]:
    """Install and activate the release the signed channel names for the enrolled cell.

    Nothing on the box changes unless the whole release downloaded and verified; then the
    `current` link is swapped and the replaced model becomes `previous`. A damaged active
    model is repaired from the channel, or replaced by `previous` when that fails.
    """
    box = _prepared(box)
    with _exclusive(box):
        damaged = _damage(box)
        try:
            with _unchanged_on_failure():
                return _update(box, repair=damaged is not None)
        except EdgeError as exc:
            if damaged is None:
                raise
            return _fall_back(box, damaged, str(exc))


def rollback(box: Path) -> dict[str, Any]:
    """Swap `current` and `previous`: the model that ran before the last activation runs again."""
    box = Path(box)
    if not box.is_dir():
        raise EdgeError(f"{box}: no such folder; nothing was ever pulled there (check --box)")
    with _exclusive(box):
        with _unchanged_on_failure():
            previous = _link_target(box, PREVIOUS_LINK)
            if previous is None:
                raise EdgeError(
                    f"{box}: no previous model to roll back to (fewer than two releases were "
                    "activated here)"
                )
            _verify_files(box / RELEASES_DIR / previous, _release_doc(box, previous), previous)
        _activate(box, previous, action="rollback")
        return {"action": "rolled_back", **_summary(box)}


def status(box: Path) -> dict[str, Any]:
    """What runs now: the active release, its decision, its files' integrity, previous."""
    return _summary(Path(box))


def _update(box: Path, repair: bool) -> dict[str, Any]:
    signed = SignedChannel(box)
    signed.refresh()
    staging_root = box / STAGING_DIR
    shutil.rmtree(staging_root, ignore_errors=True)  # leftovers of an interrupted pull
    staging_root.mkdir()
    try:
        target = release_target(signed.cell_id)
        if signed.info(target) is None:
            raise NothingPublishedError(
                f"{signed.channel_uri}: no signed release for cell {signed.cell_id} yet"
            )
        data = signed.fetch_bytes(target, staging_root / RELEASE_NAME)
        release = check_release(parse_json(data, target), signed.cell_id)
        bundle_id = release["bundle_id"]
        active = _active_release(box)
        if active is not None and active.get("bundle_id") == bundle_id and not repair:
            return {"action": "already_active", **_summary(box)}
        _check_not_downgrade(release, active)
        folder = _download_release(signed, release, data, staging_root, repair)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    if repair and active is not None and active.get("bundle_id") == bundle_id:
        damaged = _link_target(box, CURRENT_LINK)
        _point_link(box, CURRENT_LINK, folder)
        _append_history(box, "repair", folder, release)
        if damaged and damaged != folder:
            _remove_tree(box / RELEASES_DIR / damaged)
        return {"action": "repaired", **_summary(box)}
    _activate(box, folder, action="pull")
    _prune_releases(box)
    return {"action": "activated", **_summary(box)}


def _download_release(
    signed: SignedChannel, release: dict, data: bytes, staging_root: Path, repair: bool
) -> str:
    """Every file of the release, checked against its signed target; the attestation checked
    against the signed gate keys. Returns the folder name it was installed under."""
    cell_id, bundle_id = signed.cell_id, release["bundle_id"]
    staging = staging_root / bundle_id
    staging.mkdir()
    for name, entry in release["files"].items():
        path = bundle_target(cell_id, bundle_id, name)
        info = signed.info(path)
        if info is None or info.hashes.get("sha256") != entry["sha256"]:
            raise EdgeError(
                f"release {bundle_id} file {name}: not signed with the hash release.json "
                "names (mixed releases); refusing it"
            )
        signed.download(info, staging / name)
    if release.get("attestation"):
        path = bundle_target(cell_id, bundle_id, ATTESTATION_NAME)
        envelope = signed.fetch_bytes(path, staging / ATTESTATION_NAME)
        gate_keys = gate_keys_from(
            signed.fetch_bytes(GATE_KEYS_TARGET, staging_root / GATE_KEYS_TARGET)
        )
        verify_gate_attestation(
            envelope,
            gate_keys,
            release["files"][MODEL_FILE]["sha256"],
            f"release {bundle_id} attestation",
        )
    (staging / RELEASE_NAME).write_bytes(data)
    _verify_files(staging, release, bundle_id)
    # Durable before visible: a power cut must not leave an activated but empty file.
    for path in [*staging.iterdir(), staging]:
        _fsync(path)
    box = staging_root.parent
    # A repaired copy of the active release gets a folder of its own: the active one stays
    # whole (if damaged) until `current` moves. Otherwise a same-id folder is a stale copy
    # (e.g. the one rolled back from), never the active one, and this download replaces it.
    folder = f"{bundle_id}.r{secrets.token_hex(3)}" if repair else bundle_id
    release_dir = box / RELEASES_DIR / folder
    release_dir.parent.mkdir(exist_ok=True)
    if folder != _link_target(box, CURRENT_LINK):
        _remove_tree(release_dir)
    os.rename(staging, release_dir)
    return folder


def _check_not_downgrade(release: dict[str, Any], active: dict[str, Any] | None) -> None:
    new, old = release.get("model_version"), (active or {}).get("model_version")
    kind = release["decision"]["kind"]
    if isinstance(new, int) and isinstance(old, int) and new < old and kind != "rollback":
        raise EdgeError(
            f"release {release['bundle_id']}: model version {new} is older than the active "
            f"{old} and its signed decision is {kind!r}, not a rollback; refusing the downgrade"
        )


def _damage(box: Path) -> str | None:
    """Why the active release is damaged (a file differs from its signed hash), or None."""
    folder = _link_target(box, CURRENT_LINK)
    if folder is None:
        return None
    try:
        _verify_files(box / RELEASES_DIR / folder, _release_doc(box, folder), folder)
    except EdgeError as exc:
        return str(exc)
    return None


def _fall_back(box: Path, damaged: str, failure: str) -> dict[str, Any]:
    """The active model is damaged and could not be re-fetched: run `previous` if it is whole."""
    previous = _link_target(box, PREVIOUS_LINK)
    try:
        if previous is None:
            raise EdgeError("no previous release on the box")
        _verify_files(box / RELEASES_DIR / previous, _release_doc(box, previous), previous)
    except EdgeError as exc:
        raise EdgeError(
            f"active model damaged ({damaged}); repair failed ({failure}); cannot roll back "
            f"({exc}); the box has no intact model"
        ) from None
    _activate(box, previous, action="rollback_damaged")
    return {
        "action": "rolled_back_damaged",
        "damaged": damaged,
        "repair_failed": failure,
        **_summary(box),
    }


def _verify_files(folder: Path, release: dict[str, Any], label: str) -> None:
    """Raise EdgeError unless every file the release lists has its size and sha256."""
    for name, expected in release["files"].items():
        path = folder / name
        where = f"release {label} file {name}"
        if not path.is_file() or path.is_symlink():
            raise EdgeError(f"{where}: missing from {folder} (or a symlink); refusing it")
        size = path.stat().st_size
        if size != expected["size"]:
            raise EdgeError(
                f"{where}: size mismatch (signed {expected['size']} bytes, got {size}); refusing it"
            )
        digest = sha256_file(path)
        if digest != expected["sha256"]:
            raise EdgeError(
                f"{where}: sha256 mismatch (signed {expected['sha256']}, got {digest}); refusing it"
            )


def _activate(box: Path, folder: str, action: str) -> None:
    """Point `current` at releases/<folder>; the replaced target becomes `previous`.

    `previous` is re-pointed first: a crash between the two swaps leaves both links on the old
    model, which is consistent, instead of losing the way back.
    """
    replaced = _link_target(box, CURRENT_LINK)
    if replaced is not None and replaced != folder:
        _point_link(box, PREVIOUS_LINK, replaced)
    _point_link(box, CURRENT_LINK, folder)
    _append_history(box, action, folder, _release_doc(box, folder))


def _point_link(box: Path, link_name: str, folder: str) -> None:
    # A relative target keeps the folder relocatable; os.replace makes the swap atomic.
    temp = box / f".{link_name}.{secrets.token_hex(4)}.tmp"
    os.symlink(f"{RELEASES_DIR}/{folder}", temp)
    try:
        os.replace(temp, box / link_name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync(box)


def _link_target(box: Path, link_name: str) -> str | None:
    """The release folder a link points at, None when the link does not exist."""
    link = box / link_name
    if not link.is_symlink():
        if link.exists():
            raise EdgeError(
                f"{link}: exists but is not a symlink; realloop-edge manages it, move it aside"
            )
        return None
    return check_name(Path(os.readlink(link)).name, f"{link} target")


def _release_doc(box: Path, folder: str) -> dict[str, Any]:
    path = box / RELEASES_DIR / folder / RELEASE_NAME
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EdgeError(
            f"{describe_os_error(exc)}; the release is damaged, pull again to reinstall it"
        ) from None
    release = parse_json(data, str(path))
    if not isinstance(release, dict) or not isinstance(release.get("files"), dict):
        raise EdgeError(f"{path}: not a release description; pull again to reinstall it")
    return release


def _active_release(box: Path) -> dict[str, Any] | None:
    folder = _link_target(box, CURRENT_LINK)
    if folder is None:
        return None
    try:
        return _release_doc(box, folder)
    except EdgeError:
        return None


def _summary(box: Path) -> dict[str, Any]:
    folder = _link_target(box, CURRENT_LINK)
    if folder is None:
        raise EdgeError(f"{box}: no active model; run `realloop-edge pull` first")
    release = _release_doc(box, folder)
    # Resolved from the folder just read, not from the link again: stays consistent mid-swap.
    path = Path(os.path.realpath(box / RELEASES_DIR / folder))
    model = path / MODEL_FILE
    model_sha256 = sha256_file(model) if model.is_file() else None
    try:
        _verify_files(path, release, folder)
        damage = None
    except EdgeError as exc:
        damage = str(exc)
    return {
        "path": str(path),
        "bundle_id": release.get("bundle_id"),
        "cell_id": release.get("cell_id"),
        "model_name": release.get("model_name"),
        "model_version": release.get("model_version"),
        "dataset_version": release.get("dataset_version"),
        "mlflow_run_id": release.get("mlflow_run_id"),
        "created_at": release.get("published_at"),
        "activated_at": _activated_at(box, folder),
        "sha256": model_sha256,
        "intact": damage is None,
        "damage": damage,
        "signed": True,  # only a release that verified against the signed metadata is installed
        "decision": _decision_summary(path, release),
        "previous": _previous_summary(box, _link_target(box, PREVIOUS_LINK)),
    }


def _decision_summary(path: Path, release: dict[str, Any]) -> dict[str, Any]:
    decision = dict(release.get("decision") or {})
    if (path / ATTESTATION_NAME).is_file():
        predicate = attested_predicate(path)
        decision["attestation"] = (
            attestation_summary(predicate)
            if predicate is not None
            else {"error": f"{path / ATTESTATION_NAME}: unreadable"}
        )
    return decision


def attested_predicate(release_folder: str | Path) -> dict[str, Any] | None:
    """The gate's predicate (request, arms' statistics with intervals, verdict) of an installed
    release, None when it has no attestation. Read from the envelope a pull verified before
    installing it (signature, subject, verdict), so it is not verified again here."""
    envelope = Path(release_folder) / ATTESTATION_NAME
    try:
        statement = json.loads(base64.b64decode(json.loads(envelope.read_bytes())["payload"]))
        predicate = statement["predicate"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return predicate if isinstance(predicate, dict) else None


def _previous_summary(box: Path, folder: str | None) -> dict[str, Any] | None:
    if folder is None:
        return None
    try:
        release = _release_doc(box, folder)
    except EdgeError:  # a damaged previous release must not hide what runs now
        release = {}
    return {
        "bundle_id": release.get("bundle_id", folder),
        "model_version": release.get("model_version"),
    }


def _append_history(box: Path, action: str, folder: str, release: dict[str, Any]) -> None:
    record = {
        "time": utc_timestamp(),
        "action": action,
        "bundle_id": release.get("bundle_id", folder),
        "folder": folder,
        "model_version": release.get("model_version"),
        "decision": (release.get("decision") or {}).get("kind"),
    }
    with open(box / HISTORY_FILE, "a", encoding="utf-8") as log:
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


def _activated_at(box: Path, folder: str) -> str | None:
    matching = [
        r.get("time") for r in read_history(box) if r.get("folder", r.get("bundle_id")) == folder
    ]
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
def _unchanged_on_failure() -> Iterator[None]:
    """Failures before activation leave the box as it was; say so, so nobody has to check."""
    try:
        yield
    except EdgeError as exc:
        raise type(exc)(f"{exc}; the active model is unchanged") from None
    except OSError as exc:
        raise EdgeError(f"{describe_os_error(exc)}; the active model is unchanged") from None
