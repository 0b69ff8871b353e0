"""The release channel between the publisher (promote stage) and the edge boxes.

A channel is a local directory (a path or a file:// URI) or an S3 prefix (s3://bucket/prefix).
`upload_bundle` puts a bundle's files, then its manifest, under the cell's path (what trials
run); releases are signed on top of it (edge.release, edge.tuf_repo). Edge side: `open_channel`
plus `get_file`/`get_bytes`; see `edge.tuf_client`.

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
    build_manifest,
    bundle_file_key,
    encode_manifest,
    parse_json,
    utc_timestamp,
)
from edge.channel import Channel, LocalChannel
from edge.errors import EdgeError, KeyNotFoundError
from edge.integrity import sha256_file

__all__ = [
    "Channel",
    "EdgeError",
    "KeyNotFoundError",
    "LocalChannel",
    "open_channel",
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


def upload_bundle(
    channel: Channel,
    cell_id: str,
    files: dict[str, Path],
    metadata: dict[str, Any],
) -> tuple[dict[str, Any], bytes]:
    """Upload a bundle's files, then its manifest (a trial candidate, or the trial copy of a
    release); return the manifest and its exact bytes. Identical content gives identical
    bytes, so it is idempotent."""
    channel.sweep_partials(PARTIAL_MAX_AGE_S)  # what killed publishes left, never cleaned else
    entries = {name: _file_entry(Path(path)) for name, path in sorted(files.items())}
    manifest = build_manifest(cell_id, metadata, entries)
    bundle_id = manifest["bundle_id"]
    manifest_key = bundle_file_key(cell_id, bundle_id, MANIFEST_NAME)
    manifest["created_at"] = _published_at(channel, manifest_key) or utc_timestamp()
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
