"""Sources: a landing folder, or an S3 prefix against a real S3 server (moto) on loopback.

Transient faults are real: a small HTTP proxy in front of the server answers 503 SlowDown,
drops the connection, or cuts a response body short, for the first requests that match.
"""

from __future__ import annotations

import http.client
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipelines.ingest.sources import (
    STAGING_DIR,
    LandingFolder,
    ObjectGone,
    S3Prefix,
    SeenFiles,
    SourceError,
    SourceFile,
    TransientSourceError,
    open_source,
    s3_client,
)

SLOW_DOWN = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultyProxy:
    """An HTTP proxy to the S3 server that fails the first matching requests for real.

    kinds: "503" (SlowDown), "drop" (close without answering), "truncate" (half the body).
    """

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.faults: list[list] = []  # [kind, method, key fragment, remaining]
        self.requests: Counter[tuple[str, str]] = Counter()
        self.injected: Counter[str] = Counter()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # no request log in test output
                pass

            def do_GET(self) -> None:
                proxy.handle(self)

            do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def fail(self, kind: str, times: int, method: str = "GET", key: str = "") -> None:
        with self.lock:
            self.faults.append([kind, method, key, times])

    def _fault_for(self, method: str, path: str) -> str | None:
        with self.lock:
            self.requests[(method, path)] += 1
            for fault in self.faults:
                kind, want_method, key, remaining = fault
                if remaining > 0 and method == want_method and key in path:
                    fault[3] -= 1
                    self.injected[kind] += 1
                    return kind
        return None

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        fault = self._fault_for(request.command, request.path)
        if fault == "drop":
            request.close_connection = True
            return
        if fault == "503":
            request.send_response(503)
            request.send_header("Content-Type", "application/xml")
            request.send_header("Content-Length", str(len(SLOW_DOWN)))
            request.end_headers()
            request.wfile.write(SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection(*self.upstream, timeout=30)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "connection"}
        upstream.request(request.command, request.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        request.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("connection", "transfer-encoding", "content-length"):
                request.send_header(name, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if fault == "truncate" and request.command == "GET":
            request.wfile.write(data[: len(data) // 2])
            request.wfile.flush()
            request.close_connection = True
        elif request.command != "HEAD":
            request.wfile.write(data)
        upstream.close()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3-compatible HTTP server (moto) on loopback, shared by the session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def proxy(s3_server: str) -> Iterator[FaultyProxy]:
    faulty = FaultyProxy(s3_server)
    yield faulty
    faulty.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, proxy: FaultyProxy) -> FaultyProxy:
    """boto3 (and DVC) talk to the server through the proxy, with dummy credentials."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REALLOOP_S3_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    return proxy


@pytest.fixture
def bucket(s3_env: FaultyProxy) -> str:
    name = f"realloop-{uuid.uuid4().hex[:12]}"
    s3_client().create_bucket(Bucket=name)
    return name


def put(bucket: str, key: str, data: bytes) -> None:
    s3_client().put_object(Bucket=bucket, Key=key, Body=data)


# --- naming a source --------------------------------------------------------------------


def test_source_uris(tmp_path, s3_env):
    landing = tmp_path / "data" / "landing"
    default = open_source(None, landing, tmp_path)
    assert isinstance(default, LandingFolder) and default.root == landing
    relative = open_source("elsewhere/logs", landing, tmp_path)
    assert relative.root == tmp_path / "elsewhere" / "logs"
    assert open_source(f"file://{tmp_path}/x", landing, tmp_path).root == tmp_path / "x"
    s3 = open_source("s3://bucket-a/cells/cell-07", landing, tmp_path)
    assert isinstance(s3, S3Prefix) and s3.uri == "s3://bucket-a/cells/cell-07"
    assert s3.root == landing / STAGING_DIR / "bucket-a" / "cells" / "cell-07"
    for bad in ("ftp://host/logs", "s3:///no-bucket", "s3://b/../up"):
        with pytest.raises(SourceError):
            open_source(bad, landing, tmp_path)
    with pytest.raises(FileNotFoundError, match="landing folder not found"):
        open_source(None, landing, tmp_path).list()


def test_landing_folder_lists_logs_with_fingerprints(tmp_path):
    landing = tmp_path / "landing"
    (landing / "captures").mkdir(parents=True)
    (landing / "a.mcap").write_bytes(b"a" * 10)
    (landing / "b.mcap.partial").write_bytes(b"b")
    (landing / ".hidden.mcap").write_bytes(b"c")
    (landing / "captures" / "w.mcap").write_bytes(b"w")
    files = LandingFolder(landing).list()
    assert [f.name for f in files] == ["a.mcap"]
    assert files[0].uri == str((landing / "a.mcap").resolve()) and files[0].size == 10
    before = files[0].fingerprint
    (landing / "a.mcap").write_bytes(b"A" * 10)  # same size, rewritten: a new fingerprint
    assert LandingFolder(landing).list()[0].fingerprint != before


# --- an S3 prefix ----------------------------------------------------------------------


def test_s3_prefix_lists_and_stages_objects(bucket, tmp_path):
    put(bucket, "line/a.mcap", b"alpha" * 100)
    put(bucket, "line/sub/b.mcap", b"beta")
    put(bucket, "line/captures/c.json", b"{}")
    put(bucket, "line/.tmp/d.mcap", b"hidden")
    put(bucket, "line/e.mcap.partial", b"uploading")
    put(bucket, "line/dir/", b"")
    put(bucket, "other/f.mcap", b"not below the prefix")
    source = S3Prefix(bucket, "line", tmp_path / STAGING_DIR)
    files = source.list()
    assert [f.name for f in files] == ["a.mcap", "captures/c.json", "sub/b.mcap"]
    first = files[0]
    assert first.uri == f"s3://{bucket}/line/a.mcap" and first.size == 500
    assert len(first.fingerprint) == 32  # the ETag
    assert not source.is_staged(first)
    staged = source.fetch(first)
    assert staged == tmp_path / STAGING_DIR / bucket / "line" / "a.mcap"
    assert staged.read_bytes() == b"alpha" * 100 and source.is_staged(first)
    assert [p.name for p in staged.parent.iterdir()] == ["a.mcap"]  # no temporaries left
    source.discard(first)
    assert not staged.exists()


def test_503_slow_down_is_retried_inside_the_call(bucket, tmp_path, s3_env):
    put(bucket, "p/a.mcap", b"x" * 1000)
    source = S3Prefix(bucket, "p", tmp_path / STAGING_DIR)
    s3_env.fail("503", times=2, method="GET", key="/p/a.mcap")
    s3_env.fail("drop", times=1, method="GET", key="list-type")
    files = source.list()
    assert source.fetch(files[0]).read_bytes() == b"x" * 1000
    assert s3_env.injected == {"503": 2, "drop": 1}
    assert s3_env.requests[("GET", f"/{bucket}/p/a.mcap")] == 3  # two 503s, then the object


def test_exhausted_retries_and_cut_bodies_are_transient(bucket, tmp_path, s3_env, monkeypatch):
    put(bucket, "p/a.mcap", b"y" * 100_000)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    source = S3Prefix(bucket, "p", tmp_path / STAGING_DIR)
    (file,) = source.list()
    s3_env.fail("503", times=2, key="/p/a.mcap")
    with pytest.raises(TransientSourceError, match="SlowDown"):
        source.fetch(file)
    s3_env.fail("truncate", times=1, key="/p/a.mcap")  # botocore cannot retry a cut body
    with pytest.raises(TransientSourceError):
        source.fetch(file)
    assert not source.staged_path(file).exists()
    assert list(source.staged_path(file).parent.iterdir()) == []  # nothing partial stays
    assert source.fetch(file).read_bytes() == b"y" * 100_000  # the retry the flow makes


def test_permanent_errors_are_not_transient(bucket, tmp_path, s3_env):
    put(bucket, "p/a.mcap", b"z")
    source = S3Prefix(bucket, "p", tmp_path / STAGING_DIR)
    (file,) = source.list()
    s3_client().delete_object(Bucket=bucket, Key="p/a.mcap")
    with pytest.raises(ObjectGone):
        source.fetch(file)
    missing = S3Prefix(f"{bucket}-missing", "p", tmp_path / STAGING_DIR)
    with pytest.raises(SourceError, match="does not exist") as raised:
        missing.list()
    assert not isinstance(raised.value, TransientSourceError)


def test_unreachable_endpoint_is_transient(tmp_path, monkeypatch, s3_env):
    s3_env.stop()  # nothing listens there any more
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(TransientSourceError, match="failed"):
        S3Prefix("any-bucket", "p", tmp_path / STAGING_DIR).list()


def test_keys_that_would_escape_are_staged_under_safe_names(bucket, tmp_path):
    source = S3Prefix(bucket, "p", tmp_path / "landing" / STAGING_DIR)
    for name in ("../../evil.mcap", "a//b.mcap", "./c.mcap"):
        file = SourceFile(name, f"s3://{bucket}/p/{name}", 1, "etag")
        staged = source.staged_path(file)
        assert staged.parent == tmp_path / "landing" / STAGING_DIR / ".unsafe-keys"
        assert staged.name.endswith(".mcap")


def test_seen_files_survive_a_cut_line(tmp_path):
    seen = SeenFiles(tmp_path / "landed.jsonl")
    file = SourceFile("a.mcap", "s3://b/a.mcap", 10, "etag-1")
    seen.add(file, "f" * 64, "ingested")
    with (tmp_path / "landed.jsonl").open("a") as handle:
        handle.write('{"uri": "s3://b/cut.mcap", "si')
    again = SeenFiles(tmp_path / "landed.jsonl")
    assert again.get(file)["sha256"] == "f" * 64
    assert again.get(SourceFile("a.mcap", "s3://b/a.mcap", 10, "etag-2")) is None
