"""Hardware-trial requests on the channel, and the channel's history of what was published.

The orchestrator publishes a request at `<cell_id>/trials/<request_id>.json` once both arms'
bundles are on the channel; the cell lists its open requests, fetches and verifies both arms
like a release, and runs them interleaved. Withdrawing a request deletes it. docs/operations.md
("The cell contract") is the reference; this module is the one place that knows the keys.

History: every publish, override, request and withdrawal is one JSON object under
`<cell_id>/history/`, named so that listing them sorts them by time (S3 has no append).
"""

from __future__ import annotations

import json
import secrets
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edge.bundle import MANIFEST_NAME, bundle_file_key, check_manifest, check_name, parse_json
from edge.channel import Channel
from edge.errors import EdgeError, KeyNotFoundError
from edge.integrity import sha256_bytes, sha256_file

TRIALS_DIR = "trials"
HISTORY_DIR = "history"
REQUEST_FORMAT = 1
ARMS = ("candidate", "incumbent")
_REQUIRED = ("request_id", "cell_id", "episodes_per_arm", "arms", "created_at", "deadline")


def request_key(cell_id: str, request_id: str) -> str:
    return (
        f"{check_name(cell_id, 'cell id')}/{TRIALS_DIR}/{check_name(request_id, 'request id')}.json"
    )


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
    return request


def publish_request(channel: Channel, request: dict[str, Any]) -> dict[str, Any]:
    """Write a request (after checking that both arms' manifests are on the channel)."""
    key = request_key(request["cell_id"], request["request_id"])
    request = check_request({"format": REQUEST_FORMAT, **request}, channel.describe(key))
    for arm in ARMS:
        _manifest(channel, request["cell_id"], request["arms"][arm])
    channel.put_bytes(key, _encode(request))
    record_history(channel, request["cell_id"], "trial_requested", request["request_id"], request)
    return request


def withdraw_request(channel: Channel, cell_id: str, request_id: str, reason: str) -> bool:
    """Delete a request before it completed; True if it was there. The cell stops working on it."""
    return _remove_request(channel, cell_id, request_id, "trial_withdrawn", reason)


def close_request(channel: Channel, cell_id: str, request_id: str, reason: str) -> bool:
    """Delete a request that was judged, so that no box (a replaced one included) runs it
    again; True if it was there."""
    return _remove_request(channel, cell_id, request_id, "trial_closed", reason)


def _remove_request(channel: Channel, cell_id: str, request_id: str, action: str, reason: str):
    key = request_key(cell_id, request_id)
    if not channel.exists(key):
        return False
    channel.delete(key)
    record_history(channel, cell_id, action, request_id, {"reason": reason})
    return True


def open_requests(channel: Channel, cell_id: str) -> list[dict[str, Any]]:
    """The cell's open requests, oldest first. A malformed one raises: it must not be skipped
    silently, nor run."""
    prefix = f"{check_name(cell_id, 'cell id')}/{TRIALS_DIR}/"
    requests = []
    for key in channel.list(prefix):
        if not key.endswith(".json") or "/" in key[len(prefix) :]:
            continue
        try:
            data = channel.get_bytes(key)
        except KeyNotFoundError:  # withdrawn between the listing and the read
            continue
        requests.append(check_request(parse_json(data, channel.describe(key)), key))
    return sorted(requests, key=lambda r: (r["created_at"], r["request_id"]))


def fetch_arm(channel: Channel, cell_id: str, arm: dict[str, Any], dest: Path) -> Path:
    """Download one arm's bundle into `dest/<bundle_id>` and verify it like a release (the
    manifest's sha256 against the request, every file's size and sha256 against the
    manifest); return the folder. Nothing unverified is left behind."""
    manifest, manifest_bytes = _manifest(channel, cell_id, arm)
    folder = Path(dest) / arm["bundle_id"]
    staging = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name, expected in manifest["files"].items():
            path = staging / name
            channel.get_file(bundle_file_key(cell_id, arm["bundle_id"], name), path)
            _check_file(path, expected, f"bundle {arm['bundle_id']} file {name}")
        (staging / MANIFEST_NAME).write_bytes(manifest_bytes)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


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


def _manifest(channel: Channel, cell_id: str, arm: dict[str, Any]) -> tuple[dict, bytes]:
    bundle_id = check_name(arm["bundle_id"], "bundle id")
    key = bundle_file_key(cell_id, bundle_id, MANIFEST_NAME)
    manifest_bytes = channel.get_bytes(key)
    if sha256_bytes(manifest_bytes) != arm["manifest_sha256"]:
        raise EdgeError(
            f"{channel.describe(key)}: sha256 differs from the trial request's; refusing to run"
        )
    manifest = check_manifest(parse_json(manifest_bytes, key), cell_id, bundle_id)
    return manifest, manifest_bytes


def _check_file(path: Path, expected: dict[str, Any], where: str) -> None:
    size, digest = path.stat().st_size, sha256_file(path)
    if size != expected["size"] or digest != expected["sha256"]:
        raise EdgeError(f"{where}: size or sha256 differs from its manifest; refusing to run")


def _encode(document: dict[str, Any]) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
