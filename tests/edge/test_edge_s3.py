"""The S3 channel against a real S3-compatible HTTP server on loopback (moto server mode)."""

from __future__ import annotations

import socket
from pathlib import Path

import boto3
import pytest


def pull_args(uri: str, cell: str, dest: Path) -> list[str | Path]:
    return ["pull", "--channel", uri, "--cell", cell, "--dest", dest, "--json"]


def test_publish_and_pull_through_s3(publish, cli, cli_process, s3_bucket, s3_env, tmp_path, cell):
    uri = f"s3://{s3_bucket}/releases/line-a"
    dest = tmp_path / "box"
    first = publish(uri, 1)

    pulled = cli_process(*pull_args(uri, cell, dest))  # a separate process, over HTTP
    assert pulled.code == 0, pulled.stderr
    second = publish(uri, 2)
    assert cli(*pull_args(uri, cell, dest)).json()["bundle_id"] == second["bundle_id"]

    status = cli("status", "--dest", dest, "--json").json()
    assert status["model_version"] == 2
    assert status["sha256"] == second["files"]["model.safetensors"]["sha256"]
    assert status["previous"]["bundle_id"] == first["bundle_id"]
    assert (Path(status["path"]) / "model.safetensors").read_bytes() == b"weights-v2" * 100

    keys = boto3.client("s3", endpoint_url=s3_env).list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert f"releases/line-a/{cell}/CURRENT.json" in {item["Key"] for item in keys}
    assert f"releases/line-a/{cell}/bundles/{first['bundle_id']}/manifest.json" in {
        item["Key"] for item in keys
    }


def test_tampered_s3_object_is_refused(publish, cli, s3_bucket, s3_env, tmp_path, cell):
    uri = f"s3://{s3_bucket}/releases"
    bundle = publish(uri, 1)
    key = f"releases/{cell}/bundles/{bundle['bundle_id']}/model.safetensors"
    client = boto3.client("s3", endpoint_url=s3_env)
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[0] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))

    dest = tmp_path / "box"
    cli(*pull_args(uri, cell, dest)).expect_error("model.safetensors", "sha256 mismatch")
    assert not (dest / "current").exists()


def test_missing_bucket_is_reported(cli, s3_env, tmp_path, cell):
    cli(*pull_args("s3://no-such-bucket-here/x", cell, tmp_path / "box")).expect_error(
        "no-such-bucket-here", "does not exist"
    )


def test_missing_pointer_on_s3_is_reported(cli, s3_bucket, tmp_path, cell):
    cli(*pull_args(f"s3://{s3_bucket}/empty", cell, tmp_path / "box")).expect_error(
        "CURRENT.json", "not found"
    )


def test_unreachable_endpoint_is_reported(cli, s3_env, monkeypatch, tmp_path, cell):
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    monkeypatch.setenv("REALLOOP_S3_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail fast instead of retrying with backoff

    cli(*pull_args("s3://bucket/x", cell, tmp_path / "box")).expect_error(
        "S3 endpoint", str(closed_port), "REALLOOP_S3_ENDPOINT_URL"
    )


@pytest.mark.parametrize("variable", ["REALLOOP_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"])
def test_endpoint_variables(variable, monkeypatch, s3_env, s3_bucket):
    from edge.channels import open_channel

    for name in ("REALLOOP_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, s3_env)
    channel = open_channel(f"s3://{s3_bucket}")
    channel.put_bytes("k", b"v")
    assert channel.get_bytes("k") == b"v"
