"""The S3 channel (AWS S3 or any S3-compatible store: MinIO, Ceph, moto).

Imported by `edge.channels.open_channel` only for s3:// URIs, because boto3 is slow to import.
Every object is written with a single PUT, which S3 applies atomically: a reader of timestamp.json
sees the old metadata or the new, never a mix. (Single PUTs cap an object at 5 GB.)
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
from botocore.exceptions import ConnectionError as EndpointUnreachable

from edge.channel import Channel, check_key
from edge.errors import EdgeError, KeyNotFoundError

ENDPOINT_ENV_VARS = ("REALLOOP_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
_CHUNK = 1 << 20


def endpoint_url() -> str | None:
    return next((os.environ[name] for name in ENDPOINT_ENV_VARS if os.environ.get(name)), None)


class S3Channel(Channel):
    def __init__(self, bucket: str, prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        endpoint = endpoint_url()
        # Self-hosted S3 (MinIO, Ceph, moto) rarely has wildcard DNS for virtual-host buckets.
        config = Config(s3={"addressing_style": "path"}) if endpoint else None
        try:
            self._client = boto3.client("s3", endpoint_url=endpoint, config=config)
        except ValueError as exc:  # e.g. an endpoint URL without a scheme
            raise EdgeError(
                f"S3 endpoint {endpoint!r}: {exc}; "
                "set REALLOOP_S3_ENDPOINT_URL to http(s)://host:port"
            ) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._translated(key):
            self._client.put_object(Bucket=self.bucket, Key=self._object_key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        with self._translated(key), open(path, "rb") as body:
            self._client.put_object(Bucket=self.bucket, Key=self._object_key(key), Body=body)

    def get_bytes(self, key: str) -> bytes:
        with self._translated(key):
            response = self._client.get_object(Bucket=self.bucket, Key=self._object_key(key))
            return response["Body"].read()

    def get_file(self, key: str, dest: Path) -> None:
        with self._translated(key):
            response = self._client.get_object(Bucket=self.bucket, Key=self._object_key(key))
            with open(dest, "wb") as out:
                for chunk in response["Body"].iter_chunks(_CHUNK):
                    out.write(chunk)

    def exists(self, key: str) -> bool:
        try:
            with self._translated(key):
                self._client.head_object(Bucket=self.bucket, Key=self._object_key(key))
        except KeyNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        with self._translated(key):  # S3 deletes of a missing key succeed
            self._client.delete_object(Bucket=self.bucket, Key=self._object_key(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        keys = []
        with self._translated(prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            for page in pages:
                keys.extend(item["Key"][len(base) :] for item in page.get("Contents", []))
        return sorted(keys)

    def sweep_partials(self, older_than_s: float) -> builtins.list[str]:
        """`*.partial` objects (an uploader's in-flight name) and multipart uploads that were
        never completed (a killed large upload, billed until aborted), older than the limit."""
        base = f"{self.prefix}/" if self.prefix else ""
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
        swept = []
        with self._translated(base or "/"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base
            )
            for page in pages:
                for item in page.get("Contents", []):
                    if item["Key"].endswith(".partial") and item["LastModified"] < cutoff:
                        self._client.delete_object(Bucket=self.bucket, Key=item["Key"])
                        swept.append(item["Key"][len(base) :])
            uploads = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=base)
            for upload in uploads.get("Uploads", []):
                if upload["Initiated"] < cutoff:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    swept.append(f"{upload['Key'][len(base) :]} (unfinished multipart upload)")
        return swept

    def _object_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextmanager
    def _translated(self, key: str) -> Iterator[None]:
        """Turn boto errors into one-line EdgeErrors that say where and what to check."""
        try:
            yield
        except ClientError as exc:
            raise self._client_error(key, exc) from None
        except NoCredentialsError:
            raise EdgeError(
                f"{self.describe(key)}: no S3 credentials; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            ) from None
        except EndpointUnreachable as exc:  # refused, unresolvable, timed out
            raise EdgeError(
                f"{self.describe(key)}: cannot reach S3 endpoint {self._client.meta.endpoint_url} "
                f"({exc}); check REALLOOP_S3_ENDPOINT_URL and the network"
            ) from None
        except BotoCoreError as exc:  # e.g. an invalid bucket name, a broken response stream
            raise EdgeError(f"{self.describe(key)}: S3 request failed ({exc})") from None

    def _client_error(self, key: str, exc: ClientError) -> EdgeError:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "unknown"))
        where = self.describe(key)
        if code in _NOT_FOUND_CODES:
            return KeyNotFoundError(f"{where}: not found")
        if code == "NoSuchBucket":
            return EdgeError(f"{where}: bucket {self.bucket!r} does not exist; check --channel")
        if code in _DENIED_CODES:
            return EdgeError(f"{where}: access denied ({code}); check the S3 credentials")
        return EdgeError(f"{where}: S3 error {code} ({error.get('Message', exc)})")
