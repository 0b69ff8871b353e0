"""The release channel between the publisher (promote stage) and the edge boxes.

A channel is a local directory (a path or a file:// URI) or an S3 prefix (s3://bucket/prefix).
Publisher side: `publish_bundle` uploads a bundle's files, then its manifest, then, last, the
cell's CURRENT.json pointer: one atomic write that makes the new bundle visible to edge boxes.
Edge side: `open_channel` plus `get_file`/`get_bytes`; see `edge.agent`.

S3: the endpoint comes from REALLOOP_S3_ENDPOINT_URL (or AWS_ENDPOINT_URL), credentials from
boto3's usual chain. boto3 is imported only when an s3:// channel is opened.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from edge.bundle import (
    MANIFEST_NAME,
    Pointer,
    build_manifest,
    bundle_file_key,
    encode_manifest,
    encode_pointer,
    parse_json,
    pointer_key,
    utc_timestamp,
)
from edge.channel import Channel, LocalChannel
from edge.errors import EdgeError, KeyNotFoundError
from edge.integrity import generate_keypair, sha256_bytes, sha256_file, sign_manifest

__all__ = [
    "Channel",
    "EdgeError",
    "KeyNotFoundError",
    "LocalChannel",
    "generate_keypair",
    "open_channel",
    "publish_bundle",
    "upload_bundle",
]


# A write in flight is seconds old (bundles are megabytes); an hour-old `*.partial` is litter.
PARTIAL_MAX_AGE_S = 3600.0


def open_channel(uri: str | os.PathLike[str]) -> Channel:
    """A channel for a directory path, a file:// URI or an s3://bucket/prefix URI."""
    text = os.fspath(uri)
    parsed = urlparse(text)
    if parsed.scheme == "s3":
        from edge.s3 import S3Channel  # boto3 only when needed: keeps the CLI start fast

        if not parsed.netloc:
            raise EdgeError(f"channel {text!r}: an S3 channel is s3://bucket/prefix")
        return S3Channel(parsed.netloc, parsed.path.strip("/"))
    if parsed.scheme == "file":
        return LocalChannel(Path(unquote(parsed.path)))
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise EdgeError(f"channel {text!r}: unsupported scheme; use a path, file:// or s3://")
    return LocalChannel(Path(text))


def publish_bundle(
    channel_uri: str | os.PathLike[str],
    cell_id: str,
    files: dict[str, Path],
    metadata: dict[str, Any],
    signing_key: Path | None = None,
) -> dict[str, Any]:
    """Publish a bundle for `cell_id` and point the cell's CURRENT.json at it; return the manifest.

    `files` maps bundle file names ("model.safetensors" required, "config.json") to local paths;
    they must not change while publishing. `metadata` holds model_name and model_version, and
    optionally dataset_version, mlflow_run_id and gate (any JSON). With `signing_key` (an Ed25519
    private key PEM) the manifest is signed. Publishing identical content again gives the same
    bundle id and the same manifest bytes, so it is idempotent.
    """
    channel = open_channel(channel_uri)
    manifest, manifest_bytes = upload_bundle(channel, cell_id, files, metadata, signing_key)
    # Order is the protocol: an edge box only follows CURRENT.json, so files and manifest must
    # be complete on the channel before the pointer names them.
    pointer = Pointer(manifest["bundle_id"], sha256_bytes(manifest_bytes))
    channel.put_bytes(pointer_key(cell_id), encode_pointer(pointer))
    return manifest


def upload_bundle(
    channel: Channel,
    cell_id: str,
    files: dict[str, Path],
    metadata: dict[str, Any],
    signing_key: Path | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Upload a bundle's files, then its manifest, without pointing CURRENT.json at it (a trial
    candidate); return the manifest and its exact bytes."""
    channel.sweep_partials(PARTIAL_MAX_AGE_S)  # what killed publishes left, never cleaned else
    entries = {name: _file_entry(Path(path)) for name, path in sorted(files.items())}
    manifest = build_manifest(cell_id, metadata, entries)
    bundle_id = manifest["bundle_id"]
    manifest_key = bundle_file_key(cell_id, bundle_id, MANIFEST_NAME)
    manifest["created_at"] = _published_at(channel, manifest_key) or utc_timestamp()
    if signing_key is not None:
        manifest["signature"] = sign_manifest(manifest, Path(signing_key))
    manifest_bytes = encode_manifest(manifest)
    for name, path in files.items():
        channel.put_file(bundle_file_key(cell_id, bundle_id, name), Path(path))
    channel.put_bytes(manifest_key, manifest_bytes)
    return manifest, manifest_bytes


def _file_entry(path: Path) -> dict[str, Any]:
    try:
        return {"sha256": sha256_file(path), "size": path.stat().st_size}
    except OSError as exc:
        raise EdgeError(f"bundle file {path}: cannot read ({exc.strerror})") from None


def _published_at(channel: Channel, manifest_key: str) -> str | None:
    """created_at of an earlier publish of this very bundle, so a republish rewrites equal bytes."""
    try:
        data = channel.get_bytes(manifest_key)
    except KeyNotFoundError:
        return None
    try:
        earlier = parse_json(data, channel.describe(manifest_key))
    except EdgeError:  # a corrupt earlier manifest is simply replaced
        return None
    created_at = earlier.get("created_at") if isinstance(earlier, dict) else None
    return created_at if isinstance(created_at, str) else None
