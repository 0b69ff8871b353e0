"""The S3 channel against a real S3-compatible HTTP server on loopback (moto server mode)."""

from __future__ import annotations

import socket
from pathlib import Path

import boto3
import pytest


def pull_args(dest: Path) -> list[str | Path]:
    return ["pull", "--box", dest, "--json"]


def test_publish_and_pull_through_s3(
    publish, enroll_box, cli, cli_process, s3_bucket, s3_env, tmp_path, cell
):
    uri = f"s3://{s3_bucket}/releases/line-a"
    dest = enroll_box(uri, tmp_path / "box")
    first = publish(uri, 1)

    pulled = cli_process(*pull_args(dest))  # a separate process, over HTTP
    assert pulled.code == 0, pulled.stderr
    second = publish(uri, 2)
    assert cli(*pull_args(dest)).json()["bundle_id"] == second["bundle_id"]

    status = cli("status", "--box", dest, "--json").json()
    assert status["model_version"] == 2 and status["signed"] is True
    assert status["sha256"] == second["files"]["model.safetensors"]["sha256"]
    assert status["previous"]["bundle_id"] == first["bundle_id"]
    assert (Path(status["path"]) / "model.safetensors").read_bytes() == b"weights-v2" * 100

    keys = boto3.client("s3", endpoint_url=s3_env).list_objects_v2(Bucket=s3_bucket)["Contents"]
    names = {item["Key"] for item in keys}
    assert "releases/line-a/tuf/metadata/timestamp.json" in names
    assert f"releases/line-a/{cell}/bundles/{first['bundle_id']}/manifest.json" in names


def test_tampered_s3_object_is_refused(publish, enroll_box, cli, s3_bucket, s3_env, tmp_path, cell):
    uri = f"s3://{s3_bucket}/releases"
    release = publish(uri, 1)
    sha = release["files"]["model.safetensors"]["sha256"]
    key = f"releases/tuf/targets/{cell}/{release['bundle_id']}/{sha}.model.safetensors"
    client = boto3.client("s3", endpoint_url=s3_env)
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[0] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))

    dest = enroll_box(uri, tmp_path / "box")
    cli(*pull_args(dest)).expect_error("model.safetensors", "hash mismatch")
    assert not (dest / "current").exists()


def _enrolled_on(uri: str, box: Path, tmp_path: Path, cell: str) -> Path:
    from edge.rotation import init_keys
    from edge.tuf_client import enroll

    init_keys(tmp_path / "keys", None, 86400)  # a root, without writing to the channel
    enroll(uri, cell, box, tmp_path / "keys" / "root.json")
    return box


def test_missing_bucket_is_reported(cli, s3_env, tmp_path, cell):
    box = _enrolled_on("s3://no-such-bucket-here/x", tmp_path / "box", tmp_path, cell)
    cli(*pull_args(box)).expect_error("no-such-bucket-here", "does not exist")


def test_empty_s3_channel_is_reported(cli, s3_bucket, tmp_path, cell):
    box = _enrolled_on(f"s3://{s3_bucket}/empty", tmp_path / "box", tmp_path, cell)
    cli(*pull_args(box)).expect_error("no signed releases yet", "timestamp.json")


def test_unreachable_endpoint_is_reported(cli, s3_env, monkeypatch, tmp_path, cell):
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    monkeypatch.setenv("REALLOOP_S3_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail fast instead of retrying with backoff

    box = _enrolled_on("s3://bucket/x", tmp_path / "box", tmp_path, cell)
    cli(*pull_args(box)).expect_error("S3 endpoint", str(closed_port), "REALLOOP_S3_ENDPOINT_URL")


@pytest.mark.parametrize("variable", ["REALLOOP_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"])
def test_endpoint_variables(variable, monkeypatch, s3_env, s3_bucket):
    from edge.channels import open_channel

    for name in ("REALLOOP_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, s3_env)
    channel = open_channel(f"s3://{s3_bucket}")
    channel.put_bytes("k", b"v")
    assert channel.get_bytes("k") == b"v"
