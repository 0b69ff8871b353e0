"""Hardware-trial requests, signed, and the channel's history of what was published.

The open requests of a cell are one TUF target of the cell's delegated role, `<cell>/trials.json`
(`{"format": 1, "requests": [...]}`), signed by the cell's key like its release; both arms'
files (and their manifest) are targets `<cell>/<bundle_id>/<name>` of the same role. Publishing,
withdrawing or closing a request publishes a new signed version of the list (with or without
it). The cell reads the list and fetches the arms through its box's TUF client only
(`signed_requests`, `fetch_signed_arm`), so it runs nothing the cell's key did not sign.
`open_requests` and `fetch_arm` are the publisher's own unverified view (bookkeeping, tests).
docs/operations.md ("The cell contract", "Signed releases (TUF)") is the reference; this module
is the one place that knows the keys.

History: every publish, override, request and withdrawal is one JSON object under
`<cell_id>/history/`, named so that listing them sorts them by time (S3 has no append).
"""

from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edge.bundle import MANIFEST_NAME, bundle_file_key, check_manifest, check_name, parse_json
from edge.channel import Channel
from edge.errors import EdgeError
from edge.integrity import sha256_bytes, sha256_file
from edge.tuf_client import SignedChannel
from edge.tuf_repo import (
    Repository,
    bundle_target,
    named_target,
    publishing,
    release_target,
)

TRIALS_NAME = "trials.json"
HISTORY_DIR = "history"
REQUEST_FORMAT = 1
ARMS = ("candidate", "incumbent")
_REQUIRED = ("request_id", "cell_id", "episodes_per_arm", "arms", "created_at", "deadline")


@dataclass(frozen=True)
class Signing:
    """What signs a cell's trial targets: the keys folder (the cell's key) and how long the
    new timestamp stays valid (promote.timestamp_expiry_s)."""

    keys_dir: Path
    timestamp_expiry_s: float


def trials_target(cell_id: str) -> str:
    return f"{check_name(cell_id, 'cell id')}/{TRIALS_NAME}"


def new_request_id(cell_id: str, now: datetime | None = None) -> str:
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"{cell_id}-{stamp}-{secrets.token_hex(4)}"


def check_request(request: object, where: str) -> dict[str, Any]:
    """A request as the contract says, or EdgeError naming what is wrong."""
    if not isinstance(request, dict):
        raise EdgeError(f"{where}: a trial request is a JSON object")
    missing = [name for name in _REQUIRED if name not in request]
    if missing:
        raise EdgeError(f"{where}: trial request lacks {', '.join(missing)}")
    if request.get("format") != REQUEST_FORMAT:
        raise EdgeError(f"{where}: trial request format {request.get('format')!r} is not 1")
    check_name(request["request_id"], "request id")
    episodes = request["episodes_per_arm"]
    if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
        raise EdgeError(f"{where}: episodes_per_arm must be a positive integer")
    arms = request["arms"]
    if not isinstance(arms, dict) or sorted(arms) != sorted(ARMS):
        raise EdgeError(f"{where}: arms must be exactly {' and '.join(ARMS)}")
    for arm in ARMS:
        if not isinstance(arms[arm], dict) or not {"bundle_id", "manifest_sha256"} <= set(
            arms[arm]
        ):
            raise EdgeError(f"{where}: arm {arm} needs bundle_id and manifest_sha256")
        check_name(arms[arm]["bundle_id"], "bundle id")
    return request


# --- the publisher's side ------------------------------------------------------------------


def publish_request(channel: Channel, request: dict[str, Any], signing: Signing) -> dict[str, Any]:
    """Sign the request into the cell's trials.json, with both arms' files (checked against
    their manifests, the manifests against the request) as targets of the cell's role. The
    cell must have a signed release (its role). Publishing the same request again replaces it."""
    cell_id = request["cell_id"]
    where = channel.describe(trials_target(cell_id))
    request = check_request({"format": REQUEST_FORMAT, **request}, where)
    with publishing(signing.keys_dir):
        repo = Repository(channel, signing.keys_dir, signing.timestamp_expiry_s)
        if repo.targets(cell_id) is None:
            raise EdgeError(
                f"{channel.uri}: {cell_id} has no signed release yet; run realloop deploy "
                "--initial before requesting trials"
            )
        for arm in ARMS:
            _list_arm(repo, cell_id, request["arms"][arm])
        others = [r for r in _listed(repo, cell_id) if r["request_id"] != request["request_id"]]
        _write_list(repo, cell_id, [*others, request])
        repo.commit()
    record_history(channel, cell_id, "trial_requested", request["request_id"], request)
    return request


def withdraw_request(
    channel: Channel, cell_id: str, request_id: str, reason: str, signing: Signing
) -> bool:
    """Unlist a request before it completed; True if it was listed. The cell stops on it."""
    return _remove_request(channel, cell_id, request_id, "trial_withdrawn", reason, signing)


def close_request(
    channel: Channel, cell_id: str, request_id: str, reason: str, signing: Signing
) -> bool:
    """Unlist a request that was judged, so that no box (a replaced one included) runs it
    again; True if it was listed."""
    return _remove_request(channel, cell_id, request_id, "trial_closed", reason, signing)


def _remove_request(
    channel: Channel, cell_id: str, request_id: str, action: str, reason: str, signing: Signing
) -> bool:
    with publishing(signing.keys_dir):
        repo = Repository(channel, signing.keys_dir, signing.timestamp_expiry_s)
        listed = _listed(repo, cell_id)
        kept = [r for r in listed if r["request_id"] != request_id]
        if len(kept) == len(listed):
            return False
        _write_list(repo, cell_id, kept)
        repo.commit()
    record_history(channel, cell_id, action, request_id, {"reason": reason})
    return True


def kept_trial_targets(repo: Repository, cell_id: str) -> set[str]:
    """The cell role's targets that open requests need: a new release must keep them."""
    role = repo.targets(cell_id)
    if role is None:
        return set()
    bundles = {r["arms"][arm]["bundle_id"] for r in _listed(repo, cell_id) for arm in ARMS}
    return {
        path
        for path in role.signed.targets
        if path == trials_target(cell_id) or path.split("/")[1] in bundles
    }


def open_requests(channel: Channel, cell_id: str) -> list[dict[str, Any]]:
    """The requests the channel's current metadata lists for the cell, oldest first. The
    publisher's view (signatures unchecked, hashes checked); a box uses `signed_requests`."""
    return _parse_list(named_target(channel, cell_id, trials_target(cell_id)), cell_id)


def fetch_arm(channel: Channel, cell_id: str, arm: dict[str, Any], dest: Path) -> Path:
    """The publisher's unverified copy of an arm (the bundle layout, manifest checked against
    the request, files against the manifest) in `dest/<bundle_id>`; a box uses
    `fetch_signed_arm`."""
    bundle_id = check_name(arm["bundle_id"], "bundle id")
    manifest_bytes = channel.get_bytes(bundle_file_key(cell_id, bundle_id, MANIFEST_NAME))

    def get(name: str, path: Path) -> None:
        channel.get_file(bundle_file_key(cell_id, bundle_id, name), path)

    return _staged_arm(cell_id, arm, manifest_bytes, get, dest)


# --- the box's side ------------------------------------------------------------------------


def signed_requests(signed: SignedChannel, dest: Path) -> list[dict[str, Any]]:
    """The open requests of the box's cell as its key signed them, oldest first (none when
    the role lists no trials.json). Call `signed.refresh()` first."""
    path = trials_target(signed.cell_id)
    info = signed.info(path)
    if info is None:
        return []
    Path(dest).mkdir(parents=True, exist_ok=True)
    return _parse_list(signed.download(info, Path(dest) / TRIALS_NAME).read_bytes(), signed.cell_id)


def fetch_signed_arm(signed: SignedChannel, arm: dict[str, Any], dest: Path) -> Path:
    """One arm's bundle in `dest/<bundle_id>`, every file a signed target of the cell's role
    (ngclient checks each against its signed hash), the manifest against the request's sha256.
    Nothing unverified is left behind."""
    cell_id, bundle_id = signed.cell_id, check_name(arm["bundle_id"], "bundle id")
    Path(dest).mkdir(parents=True, exist_ok=True)
    scratch = Path(dest) / f".{bundle_id}.manifest"
    try:
        manifest_bytes = signed.fetch_bytes(
            bundle_target(cell_id, bundle_id, MANIFEST_NAME), scratch
        )
    finally:
        scratch.unlink(missing_ok=True)

    def get(name: str, path: Path) -> None:
        signed.fetch_bytes(bundle_target(cell_id, bundle_id, name), path)

    return _staged_arm(cell_id, arm, manifest_bytes, get, dest)


# --- shared --------------------------------------------------------------------------------


def _staged_arm(cell_id: str, arm: dict[str, Any], manifest_bytes: bytes, get, dest: Path) -> Path:
    bundle_id = arm["bundle_id"]
    manifest = _checked_manifest(manifest_bytes, cell_id, arm)
    folder = Path(dest) / bundle_id
    staging = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name, expected in manifest["files"].items():
            get(name, staging / name)
            _check_file(staging / name, expected, f"bundle {bundle_id} file {name}")
        (staging / MANIFEST_NAME).write_bytes(manifest_bytes)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _checked_manifest(manifest_bytes: bytes, cell_id: str, arm: dict[str, Any]) -> dict:
    bundle_id = arm["bundle_id"]
    if sha256_bytes(manifest_bytes) != arm["manifest_sha256"]:
        raise EdgeError(
            f"bundle {bundle_id} of {cell_id}: manifest sha256 differs from the trial "
            "request's; refusing to run"
        )
    return check_manifest(
        parse_json(manifest_bytes, f"{bundle_id}/{MANIFEST_NAME}"), cell_id, bundle_id
    )


def _list_arm(repo: Repository, cell_id: str, arm: dict[str, Any]) -> None:
    """List an arm's manifest and files as the cell role's targets, from the bundle layout
    the loop uploaded, each checked before it is signed."""
    channel, bundle_id = repo.channel, check_name(arm["bundle_id"], "bundle id")
    manifest_bytes = channel.get_bytes(bundle_file_key(cell_id, bundle_id, MANIFEST_NAME))
    manifest = _checked_manifest(manifest_bytes, cell_id, arm)
    repo.set_target(cell_id, bundle_target(cell_id, bundle_id, MANIFEST_NAME), manifest_bytes)
    for name, expected in manifest["files"].items():
        key = bundle_file_key(cell_id, bundle_id, name)
        data = channel.get_bytes(key)
        if len(data) != expected["size"] or sha256_bytes(data) != expected["sha256"]:
            raise EdgeError(
                f"{channel.describe(key)}: size or sha256 differs from its manifest; not "
                "signing it (upload the candidate again)"
            )
        repo.set_target(cell_id, bundle_target(cell_id, bundle_id, name), data)


def _listed(repo: Repository, cell_id: str) -> list[dict[str, Any]]:
    return _parse_list(repo.target_bytes(cell_id, trials_target(cell_id)), cell_id)


def _write_list(repo: Repository, cell_id: str, requests: list[dict[str, Any]]) -> None:
    """The new signed list; bundles no request and not the release names are unlisted."""
    document = {"format": REQUEST_FORMAT, "requests": _oldest_first(requests)}
    repo.set_target(cell_id, trials_target(cell_id), _encode(document))
    release = repo.target_bytes(cell_id, release_target(cell_id))
    needed = {r["arms"][arm]["bundle_id"] for r in requests for arm in ARMS}
    if release is not None:
        needed.add(json.loads(release)["bundle_id"])
    role = repo.targets(cell_id)
    assert role is not None
    unused = [p for p in role.signed.targets if p.count("/") == 2 and p.split("/")[1] not in needed]
    repo.clear_targets(cell_id, keep=set(role.signed.targets) - set(unused))


def _parse_list(data: bytes | None, cell_id: str) -> list[dict[str, Any]]:
    """A trials.json's requests for `cell_id`, checked; a malformed one raises: it must not
    be skipped silently, nor run."""
    if data is None:
        return []
    where = trials_target(cell_id)
    document = parse_json(data, where)
    if not isinstance(document, dict) or not isinstance(document.get("requests"), list):
        raise EdgeError(f"{where}: not a list of trial requests")
    requests = [check_request(r, where) for r in document["requests"]]
    strangers = [r["request_id"] for r in requests if r["cell_id"] != cell_id]
    if strangers:
        raise EdgeError(f"{where}: lists requests of another cell ({strangers}); refusing them")
    return _oldest_first(requests)


def _oldest_first(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(requests, key=lambda r: (r["created_at"], r["request_id"]))


def record_history(
    channel: Channel, cell_id: str, action: str, subject: str, details: dict[str, Any]
) -> None:
    now = datetime.now(UTC)
    event = {"at": now.isoformat(timespec="seconds"), "action": action, "subject": subject}
    name = f"{now.strftime('%Y%m%dT%H%M%S.%fZ')}-{action}-{secrets.token_hex(3)}.json"
    channel.put_bytes(f"{cell_id}/{HISTORY_DIR}/{name}", _encode(event | details))


def read_history(channel: Channel, cell_id: str) -> list[dict[str, Any]]:
    keys = channel.list(f"{check_name(cell_id, 'cell id')}/{HISTORY_DIR}/")
    return [parse_json(channel.get_bytes(key), channel.describe(key)) for key in keys]


def _check_file(path: Path, expected: dict[str, Any], where: str) -> None:
    size, digest = path.stat().st_size, sha256_file(path)
    if size != expected["size"] or digest != expected["sha256"]:
        raise EdgeError(f"{where}: size or sha256 differs from its manifest; refusing to run")


def _encode(document: dict[str, Any]) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
