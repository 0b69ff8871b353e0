"""Where landed files come from: a landing folder, or an S3 prefix read through boto3.

A source is named by a URI:
    data/landing, /abs/landing, file:///abs/landing   a landing folder; files are ingested in place
    s3://bucket/prefix                                every object below the prefix

S3 objects are staged before they are ingested: each is downloaded to a temporary name in
`<landing>/.s3-staging/<bucket>/<prefix>/<key below the prefix>` (a dot-folder, so a
landing-folder ingest never lists it), checked against the object's size, and moved into
place. The staged tree then reads like a landing folder (shift logs, `captures/` next to
them) and each staged log is ingested with `source_uri` = its s3:// URI. A staged log is
deleted once it is in the dataset; the bucket keeps the original. A key that would escape
the staging folder (`..`, empty parts) is staged under a safe name and quarantined.

A local file is named relative to the workspace when it lies inside it
(`data/landing/<name>`; `workspace_uri`), so that the records of a workspace (manifest,
episodes' source_uri, lineage) name the same files after it is moved or cloned; a file outside
it keeps its absolute path. Readers take both, and records written before stay absolute.

`SeenFiles` remembers what happened to each file (by URI, size and fingerprint: the ETag,
or inode and mtime), so a later run skips a file that is already in the dataset without
downloading or re-hashing it. It is a cache: the dataset stays the truth.

Transient S3 errors (connection errors, 5xx, throttling) are retried at two levels: inside
each call by botocore's standard retry mode (exponential backoff with jitter; AWS_MAX_ATTEMPTS
attempts, 3 by default), and around a whole download by the ingest flow's task retries, for
which they surface as `TransientSourceError`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from pipelines.ingest.disk import on_disk_full
from pipelines.ingest.landing_layout import landing_files
from pipelines.ingest.s3_endpoint import s3_endpoint_url

STAGING_DIR = ".s3-staging"
UNSAFE_DIR = ".unsafe-keys"  # inside the staging folder, outside every staged prefix
_TMP_PREFIX = ".download-"
_CHUNK = 1 << 20
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "TooManyRequestsException",
}
_GONE_CODES = {"NoSuchKey", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


class SourceError(ValueError):
    """A source that cannot be read; the message is the one-line reason."""


class TransientSourceError(SourceError):
    """A failure worth retrying: the connection dropped, the store was busy or failed (5xx)."""


class ObjectGone(SourceError):
    """The object was deleted between listing and download: nothing landed to report."""


@dataclass(frozen=True)
class SourceFile:
    """One landed file as its source lists it."""

    name: str  # the path below the source's root, '/'-separated
    uri: str  # a path (relative to the workspace when inside it), or s3://bucket/key
    size: int
    fingerprint: str  # changes when the content may have: the ETag, or inode and mtime


class Source(Protocol):
    uri: str
    root: Path  # the local folder that reads like a landing folder (what ingest walks)

    def list(self) -> list[SourceFile]: ...


# --- a landing folder -----------------------------------------------------------------


class LandingFolder:
    """Files ingested where they landed; what counts as a log is `landing_layout`'s rule."""

    def __init__(
        self, folder: Path, exclude: Iterable[Path] = (), workspace: Path | None = None
    ) -> None:
        self.root = Path(folder)
        self.uri = workspace_uri(self.root, workspace)
        self.exclude = tuple(exclude)

    def list(self) -> list[SourceFile]:
        return self.scan()[0]

    def scan(self) -> tuple[list[SourceFile], list[Path]]:
        """(logs and exports, capture sidecars) in the folder."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: landing folder not found")
        logs, sidecars = landing_entries(self.root, self.exclude)
        resolved = Path(self.uri)
        files = [local_file(p, self.root, resolved) for p in logs]
        return [f for f in files if f is not None], sidecars


def workspace_uri(path: Path, workspace: Path | None) -> str:
    """How a local file or folder is recorded: '/'-separated and relative to `workspace` when
    it lies inside it (symlinks resolved), else its absolute path."""
    resolved = Path(path).resolve()
    if workspace is not None:
        root = Path(workspace).resolve()
        if resolved.is_relative_to(root):
            return resolved.relative_to(root).as_posix()
    return str(resolved)


def local_file(path: Path, root: Path, resolved_root: Path | None = None) -> SourceFile | None:
    """A SourceFile for `path` below `root`, or None when it is gone already; its URI is
    `resolved_root` (the root's recorded name, default: its absolute path) / its name."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    name = path.relative_to(root).as_posix()
    return SourceFile(
        name=name,
        uri=str((resolved_root or root.resolve()) / name),
        size=stat.st_size,
        fingerprint=f"{stat.st_ino}:{stat.st_mtime_ns}",
    )


def landing_entries(landing: Path, exclude: Iterable[Path] = ()) -> tuple[list[Path], list[Path]]:
    """(logs and exports, capture sidecars) that ingest finds in `landing`."""
    return landing_files(landing, exclude=tuple(exclude))


# --- an S3 prefix ---------------------------------------------------------------------


class S3Prefix:
    """Every object below s3://bucket/prefix, staged into `<staging>/<bucket>/<prefix>/`."""

    def __init__(self, bucket: str, prefix: str, staging: Path, client=None) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        if not safe_parts(bucket) or (self.prefix and not safe_parts(self.prefix)):
            raise SourceError(f"{self.uri}: bucket or prefix is not a plain path")
        self.staging = Path(staging)
        self.root = self.staging / bucket / self.prefix if self.prefix else self.staging / bucket
        self._client = client or s3_client()

    def list(self) -> list[SourceFile]:
        """Every object below the prefix except folder markers, dotfiles and `*.partial`."""
        base = f"{self.prefix}/" if self.prefix else ""
        found = []
        with self._translated(self.uri):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base
            )
            for page in pages:
                for item in page.get("Contents", []):
                    name = item["Key"][len(base) :]
                    if not name or name.endswith("/") or _hidden(name):
                        continue
                    found.append(
                        SourceFile(
                            name=name,
                            uri=f"s3://{self.bucket}/{item['Key']}",
                            size=int(item["Size"]),
                            fingerprint=str(item.get("ETag", "")).strip('"'),
                        )
                    )
        return sorted(found, key=lambda f: f.name)

    def check(self) -> None:
        """Raise SourceError unless the bucket can be listed (one request)."""
        with self._translated(self.uri):
            self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)

    def staged_path(self, file: SourceFile) -> Path:
        """Where `file` is staged: under its own name, or a safe one if that would escape."""
        if safe_parts(file.name):
            return self.root / file.name
        digest = hashlib.sha256(file.uri.encode()).hexdigest()[:16]
        tail = next((p for p in reversed(file.name.split("/")) if p not in ("", ".", "..")), "")
        return self.staging / UNSAFE_DIR / f"{digest}-{tail or 'object'}"

    def is_staged(self, file: SourceFile) -> bool:
        path = self.staged_path(file)
        return path.is_file() and path.stat().st_size == file.size

    def fetch(self, file: SourceFile) -> Path:
        """Download `file` to its staged path (atomically, size-checked); return that path."""
        dest = self.staged_path(file)
        with on_disk_full("downloading from S3", self.root):
            dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{_TMP_PREFIX}{dest.name}.{uuid.uuid4().hex[:8]}")
        key = file.uri.removeprefix(f"s3://{self.bucket}/")
        try:
            with on_disk_full("downloading from S3", self.root), self._translated(file.uri):
                response = self._client.get_object(Bucket=self.bucket, Key=key)
                expected = int(response["ContentLength"])
                with tmp.open("wb") as out:
                    for chunk in response["Body"].iter_chunks(_CHUNK):
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
            written = tmp.stat().st_size
            if written != expected:
                raise TransientSourceError(
                    f"{file.uri}: downloaded {written} of {expected} bytes (connection cut)"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def discard(self, file: SourceFile) -> None:
        """Delete the staged copy of a file the dataset now holds."""
        self.staged_path(file).unlink(missing_ok=True)

    @contextmanager
    def _translated(self, where: str) -> Iterator[None]:
        """boto errors → SourceError (one line) or TransientSourceError (worth a retry)."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
        )

        try:
            yield
        except ClientError as exc:
            raise _client_error(where, self.bucket, exc) from None
        except NoCredentialsError:
            raise SourceError(
                f"{where}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE)"
            ) from None
        except (ConnectionError, HTTPClientError, IncompleteReadError) as exc:
            raise TransientSourceError(
                f"{where}: S3 endpoint {self._client.meta.endpoint_url} failed ({exc})"
            ) from None
        except BotoCoreError as exc:  # e.g. an invalid bucket name
            raise SourceError(f"{where}: S3 request failed ({exc})") from None


def _client_error(where: str, bucket: str, exc) -> SourceError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", "unknown"))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    message = f"{where}: S3 error {code} ({error.get('Message') or exc})"
    if code in _TRANSIENT_CODES or status >= 500 or status == 429:
        return TransientSourceError(message)
    if code in _GONE_CODES:
        return ObjectGone(f"{where}: deleted since it was listed")
    if code == "NoSuchBucket":
        return SourceError(f"{where}: bucket {bucket!r} does not exist")
    if code in _DENIED_CODES:
        return SourceError(f"{where}: access denied ({code}); check the S3 credentials")
    return SourceError(message)


def s3_client(max_pool_connections: int = 16):
    """A boto3 S3 client for the configured endpoint; thread-safe, so one per flow run."""
    import boto3
    from botocore.config import Config

    endpoint = s3_endpoint_url()
    options: dict = {
        # standard mode: backoff with jitter on throttling, 5xx and connection errors;
        # the number of attempts comes from AWS_MAX_ATTEMPTS (3 when unset).
        "retries": {"mode": os.environ.get("AWS_RETRY_MODE") or "standard"},
        "max_pool_connections": max_pool_connections,
    }
    if endpoint:  # self-hosted S3 (MinIO, Ceph, moto) rarely has virtual-host bucket DNS
        options["s3"] = {"addressing_style": "path"}
    try:
        return boto3.client("s3", endpoint_url=endpoint, config=Config(**options))
    except ValueError as exc:  # e.g. an endpoint URL without a scheme
        raise SourceError(
            f"S3 endpoint {endpoint!r}: {exc}; set REALLOOP_S3_ENDPOINT_URL to http(s)://host:port"
        ) from None


def safe_parts(name: str) -> bool:
    """True when `name` stays inside a folder: relative, no '..', '.', empty parts or NULs."""
    parts = name.split("/")
    return (
        bool(name)
        and "\\" not in name
        and "\x00" not in name
        and all(p not in ("", ".", "..") for p in parts)
    )


def _hidden(name: str) -> bool:
    """Skipped like in a landing folder: dot-folders, dotfiles, files still being written."""
    return any(p.startswith(".") for p in name.split("/") if p not in ("", ".", "..")) or (
        name.endswith(".partial")
    )


# --- naming a source --------------------------------------------------------------------


def open_source(uri: str | None, landing: Path, workspace: Path, exclude: Iterable[Path] = ()):
    """The source a URI names; None is the landing folder. Relative paths are in `workspace`."""
    if uri is None or uri == "":
        return LandingFolder(landing, exclude, workspace)
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise SourceError(f"{uri}: no bucket; use s3://bucket/prefix")
        return S3Prefix(parsed.netloc, unquote(parsed.path), Path(landing) / STAGING_DIR)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise SourceError(f"{uri}: only local file:// URIs are supported")
        return LandingFolder(Path(unquote(parsed.path)), exclude, workspace)
    if parsed.scheme and len(parsed.scheme) > 1:  # "C:" is a drive, not a scheme
        raise SourceError(f"{uri}: unsupported source; use a folder, file:// or s3:// URI")
    folder = Path(uri)
    folder = folder if folder.is_absolute() else Path(workspace) / folder
    return LandingFolder(folder, exclude, workspace)


# --- what happened to each file -----------------------------------------------------------


class SeenFiles:
    """An append-only JSON-lines record of each landed file's sha256 and ingest result,
    keyed by (uri, size, fingerprint). Safe to share between the threads of one run; lines
    from runs in other processes are appended whole (one write each)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, int, str], dict] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self._rows[(row["uri"], int(row["size"]), row["fingerprint"])] = row
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash: that file is simply looked at again

    def get(self, file: SourceFile) -> dict | None:
        row = self._rows.get((file.uri, file.size, file.fingerprint))
        if row is None and not file.uri.startswith(("/", "s3://")):
            # A line written when landed files were named by their absolute path: the same
            # file (inode and mtime) under that name, not one hashed again after an upgrade.
            row = self._absolute.get((file.size, file.fingerprint))
            if row is not None and not row["uri"].endswith(f"/{file.uri}"):
                row = None
        return row

    @functools.cached_property
    def _absolute(self) -> dict[tuple[int, str], dict]:
        return {(s, f): row for (uri, s, f), row in self._rows.items() if uri.startswith("/")}

    def add(self, file: SourceFile, sha256: str, result: str, reason: str | None = None) -> None:
        row = {
            "uri": file.uri,
            "size": file.size,
            "fingerprint": file.fingerprint,
            "sha256": sha256,
            "result": result,
        }
        if reason:
            row["reason"] = reason
        line = (json.dumps(row) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
            self._rows[(file.uri, file.size, file.fingerprint)] = row
