"""edge.trials: the trial-request protocol of docs/operations.md, on a folder and on S3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.bundle import MANIFEST_NAME, bundle_file_key, pointer_key
from edge.channels import open_channel
from edge.errors import EdgeError
from edge.integrity import sha256_bytes
from edge.trials import (
    fetch_arm,
    new_request_id,
    open_requests,
    publish_request,
    read_history,
    request_key,
    withdraw_request,
)


def arm_of(channel, cell: str, manifest: dict) -> dict:
    key = bundle_file_key(cell, manifest["bundle_id"], MANIFEST_NAME)
    return {
        "bundle_id": manifest["bundle_id"],
        "manifest_sha256": sha256_bytes(channel.get_bytes(key)),
    }


def a_request(channel, cell: str, candidate: dict, incumbent: dict, created: str) -> dict:
    return {
        "request_id": new_request_id(cell),
        "cell_id": cell,
        "episodes_per_arm": 4,
        "arms": {
            "candidate": arm_of(channel, cell, candidate),
            "incumbent": arm_of(channel, cell, incumbent),
        },
        "created_at": created,
        "deadline": "2099-01-01T00:00:00+00:00",
    }


@pytest.fixture(params=["folder", "s3"])
def channel_uri(request, channel) -> str:
    if request.param == "folder":
        return channel
    return f"s3://{request.getfixturevalue('s3_bucket')}/releases"


def test_a_request_round_trips_and_is_withdrawn(publish, channel_uri, cell, tmp_path: Path):
    incumbent, candidate = publish(channel_uri, 1), publish(channel_uri, 2)
    channel = open_channel(channel_uri)
    first = a_request(channel, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00")
    second = a_request(channel, cell, candidate, incumbent, "2026-12-03T09:00:00+00:00")
    publish_request(channel, first)
    publish_request(channel, second)

    listed = open_requests(channel, cell)
    assert [r["request_id"] for r in listed] == [second["request_id"], first["request_id"]]
    assert open_requests(channel, "cell-8") == []

    folder = fetch_arm(channel, cell, listed[0]["arms"]["candidate"], tmp_path / "arms")
    assert (folder / "model.safetensors").read_bytes() == b"weights-v2" * 100
    assert not list((tmp_path / "arms").glob(".*"))  # no staging left behind

    assert withdraw_request(channel, cell, second["request_id"], "timed out")
    assert not withdraw_request(channel, cell, second["request_id"], "again")
    assert [r["request_id"] for r in open_requests(channel, cell)] == [first["request_id"]]
    actions = [event["action"] for event in read_history(channel, cell)]
    assert actions == ["trial_requested", "trial_requested", "trial_withdrawn"]


def test_an_arm_whose_bundle_was_tampered_with_is_refused(publish, channel, cell, tmp_path):
    incumbent, candidate = publish(channel, 1), publish(channel, 2)
    ch = open_channel(channel)
    request = publish_request(
        ch, a_request(ch, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00")
    )
    weights = Path(channel, bundle_file_key(cell, candidate["bundle_id"], "model.safetensors"))
    weights.write_bytes(b"someone else's weights")
    with pytest.raises(EdgeError, match="sha256 differs from its manifest"):
        fetch_arm(ch, cell, request["arms"]["candidate"], tmp_path / "arms")
    assert not (tmp_path / "arms" / candidate["bundle_id"]).exists()


def test_a_request_naming_another_manifest_is_refused(publish, channel, cell, tmp_path):
    incumbent, candidate = publish(channel, 1), publish(channel, 2)
    ch = open_channel(channel)
    request = a_request(ch, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00")
    request["arms"]["candidate"]["manifest_sha256"] = "0" * 64
    with pytest.raises(EdgeError, match="differs from the trial request"):
        publish_request(ch, request)
    assert open_requests(ch, cell) == []


def test_a_malformed_request_on_the_channel_is_reported_not_run(publish, channel, cell):
    publish(channel, 1)
    ch = open_channel(channel)
    ch.put_bytes(request_key(cell, "bad"), json.dumps({"format": 1, "cell_id": cell}).encode())
    with pytest.raises(EdgeError, match="trial request lacks request_id"):
        open_requests(ch, cell)


def test_requests_do_not_touch_the_production_pointer(publish, channel, cell):
    incumbent, candidate = publish(channel, 1), publish(channel, 2)
    ch = open_channel(channel)
    pointer = ch.get_bytes(pointer_key(cell))
    publish_request(ch, a_request(ch, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00"))
    assert ch.get_bytes(pointer_key(cell)) == pointer
