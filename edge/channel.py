"""The release channel between the publisher (promote stage) and the edge boxes.

A channel is a local directory (a path or a file:// URI) or an S3 prefix (s3://bucket/prefix).
Publisher side: `publish_bundle` uploads a bundle's files, then its manifest, then, last, the
cell's CURRENT.json pointer: one atomic write that makes the new bundle visible to edge boxes.
Edge side: `open_channel` plus `get_file`/`get_bytes`; see `edge.agent`.

S3: the endpoint comes from REALLOOP_S3_ENDPOINT_URL (or AWS_ENDPOINT_URL), credentials from
boto3's usual chain. boto3 is imported only when an s3:// channel is opened.
"""

from __future__ import annotations

import builtins
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any
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
]


class Channel(ABC):
    """Flat key → bytes storage. Keys are relative, '/'-separated, e.g. "cell-1/CURRENT.json"."""

    uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` at `key` in one atomic write: readers see the old or the new object."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Like put_bytes, streaming from a local file."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The object at `key`; KeyNotFoundError when absent."""

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> None:
        """Stream the object at `key` into the local file `dest`; KeyNotFoundError when absent."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Sorted keys that start with `prefix`."""

    def describe(self, key: str) -> str:
        """Where a key lives, for messages an operator can act on."""
        return f"{self.uri.rstrip('/')}/{key}"


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


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(part in ("", ".", "..") for part in parts):
        raise EdgeError(f"channel key {key!r}: must be a relative path without '.' or '..'")
    return key


class LocalChannel(Channel):
    """A channel on a local or mounted file system; writes are atomic via os.replace."""

    _PARTIAL = ".partial"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write_atomically(key, lambda out: out.write(data))

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as source:
            self._write_atomically(key, lambda out: shutil.copyfileobj(source, out))

    def get_bytes(self, key: str) -> bytes:
        with self._reading(key) as path:
            return path.read_bytes()

    def get_file(self, key: str, dest: Path) -> None:
        with self._reading(key) as path:
            shutil.copyfile(path, dest)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> builtins.list[str]:
        # Walk only the deepest directory the prefix names, not the whole channel.
        start = self.root.joinpath(*prefix.split("/")[:-1])
        keys = [
            path.relative_to(self.root).as_posix()
            for path in start.rglob("*")
            if path.is_file() and not path.name.endswith(self._PARTIAL)
        ]
        return sorted(key for key in keys if key.startswith(prefix))

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    @contextmanager
    def _reading(self, key: str) -> Iterator[Path]:
        try:
            yield self._path(key)
        except FileNotFoundError:
            raise KeyNotFoundError(f"{self.describe(key)}: not found") from None
        except OSError as exc:
            raise EdgeError(f"{self.describe(key)}: cannot read ({exc.strerror})") from None

    def _write_atomically(self, key: str, write: Callable[[IO[bytes]], Any]) -> None:
        # The temp file lives in the target's directory so os.replace never crosses a file system.
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=self._PARTIAL, dir=target.parent
        )
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, target)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise


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
    entries = {name: _file_entry(Path(path)) for name, path in sorted(files.items())}
    manifest = build_manifest(cell_id, metadata, entries)
    bundle_id = manifest["bundle_id"]
    manifest_key = bundle_file_key(cell_id, bundle_id, MANIFEST_NAME)
    manifest["created_at"] = _published_at(channel, manifest_key) or utc_timestamp()
    if signing_key is not None:
        manifest["signature"] = sign_manifest(manifest, Path(signing_key))
    manifest_bytes = encode_manifest(manifest)

    # Order is the protocol: an edge box only follows CURRENT.json, so files and manifest must
    # be complete on the channel before the pointer names them.
    for name, path in files.items():
        channel.put_file(bundle_file_key(cell_id, bundle_id, name), Path(path))
    channel.put_bytes(manifest_key, manifest_bytes)
    pointer = Pointer(bundle_id, sha256_bytes(manifest_bytes))
    channel.put_bytes(pointer_key(cell_id), encode_pointer(pointer))
    return manifest


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
