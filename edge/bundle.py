"""The bundle format: channel layout and manifest, and the names both sides check.

```
<channel>/<cell_id>/bundles/<bundle_id>/model.safetensors
<channel>/<cell_id>/bundles/<bundle_id>/config.json
<channel>/<cell_id>/bundles/<bundle_id>/manifest.json
```
The trial copy of a candidate: the loop uploads it here, and edge.trials signs its manifest and
files as TUF targets of the cell's role (`<cell>/<bundle_id>/<name>`) with the request that
names them; a cell runs only what its box's TUF client verified, in trials (edge.trials) and in
production (edge.release), never an unsigned copy.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from edge.errors import EdgeError
from edge.integrity import canonical_json, sha256_bytes

FORMAT = 1
MANIFEST_NAME = "manifest.json"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
REQUIRED_METADATA = ("model_name", "model_version")
OPTIONAL_METADATA = ("dataset_version", "mlflow_run_id", "gate")
# Fields that do not change what is installed, so they stay out of the content-derived bundle id.
_NOT_CONTENT = ("bundle_id", "created_at")
# Cell ids, bundle ids and file names become path segments on the channel and the edge box:
# no separators, no leading dot (no "..", no hidden files), nothing a shell would mangle.
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value):
        raise EdgeError(
            f"{what} {value!r}: not a safe name (letters, digits, '.', '_', '-'; "
            "starting with a letter or digit; at most 128 characters)"
        )
    return value


def bundle_file_key(cell_id: str, bundle_id: str, name: str) -> str:
    check_name(cell_id, "cell id")
    check_name(bundle_id, "bundle id")
    return f"{cell_id}/bundles/{bundle_id}/{check_name(name, 'file name')}"


def build_manifest(
    cell_id: str, metadata: dict[str, Any], files: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The manifest without created_at and signature, its bundle id derived from its content."""
    unknown = sorted(set(metadata) - set(REQUIRED_METADATA) - set(OPTIONAL_METADATA))
    missing = [field for field in REQUIRED_METADATA if metadata.get(field) in (None, "")]
    if unknown or missing:
        raise EdgeError(
            f"bundle metadata: unknown fields {unknown}, missing fields {missing}; expected "
            f"{list(REQUIRED_METADATA)} and optionally {list(OPTIONAL_METADATA)}"
        )
    check_files(files)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "cell_id": check_name(cell_id, "cell id"),
        "model_name": metadata["model_name"],
        "model_version": metadata["model_version"],
        "dataset_version": metadata.get("dataset_version"),
        "mlflow_run_id": metadata.get("mlflow_run_id"),
        "gate": metadata.get("gate") or {},
        "files": files,
    }
    return {"bundle_id": bundle_id_for(manifest), **manifest}


def bundle_id_for(manifest: dict[str, Any]) -> str:
    """`<model_version>-<12 hex of the content hash>`: identical content gives the same id."""
    content = {key: value for key, value in manifest.items() if key not in _NOT_CONTENT}
    try:
        digest = sha256_bytes(canonical_json(content))
    except (TypeError, ValueError) as exc:
        raise EdgeError(f"bundle metadata: not JSON-serialisable ({exc})") from None
    return check_name(f"{manifest['model_version']}-{digest[:12]}", "bundle id")


def check_files(files: object) -> dict[str, dict[str, Any]]:
    """Validate a manifest's `files` table: safe names, a model file, sha256 and size each."""
    if not isinstance(files, dict) or MODEL_FILE not in files:
        raise EdgeError(f"manifest files: must be a table that includes {MODEL_FILE}")
    for name, entry in files.items():
        check_name(name, "file name")
        if name == MANIFEST_NAME:
            raise EdgeError(f"file name {name!r}: reserved for the bundle manifest")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
            and isinstance(entry.get("size"), int)
            and entry["size"] >= 0
        ):
            raise EdgeError(f"manifest files[{name!r}]: needs a hex sha256 and a byte size")
    return files


def check_manifest(manifest: object, cell_id: str, bundle_id: str) -> dict[str, Any]:
    """Raise EdgeError unless this is a format-1 manifest for exactly this cell and bundle."""
    if not isinstance(manifest, dict):
        raise EdgeError("manifest.json: not a JSON object")
    if manifest.get("format") != FORMAT:
        raise EdgeError(
            f"manifest.json: format {manifest.get('format')!r} is not supported (this edge "
            f"reads format {FORMAT}); upgrade realloop-edge"
        )
    for field, expected in (("cell_id", cell_id), ("bundle_id", bundle_id)):
        if manifest.get(field) != expected:
            raise EdgeError(
                f"manifest.json: {field} is {manifest.get(field)!r}, the release names "
                f"{expected!r}; the channel is inconsistent, republish the bundle"
            )
    check_files(manifest.get("files"))
    return manifest


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    # Sorted and indented: readable by operators, and byte-identical for identical manifests.
    return (json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def utc_timestamp() -> str:
    """Now, as manifests and the activation history write it: 2025-01-31T12:00:00Z."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EdgeError(f"{where}: not valid JSON ({exc}); the file is corrupt") from None
