"""edge.trials: the signed trial-request protocol of docs/operations.md, on a folder and on S3:
the publisher signs `<cell>/trials.json` and both arms' files with the cell's key, the box reads
them through its TUF client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge import agent
from edge.bundle import MANIFEST_NAME, bundle_file_key
from edge.channels import open_channel, upload_bundle
from edge.errors import EdgeError
from edge.integrity import sha256_bytes
from edge.trials import (
    Signing,
    close_request,
    fetch_signed_arm,
    new_request_id,
    open_requests,
    publish_request,
    read_history,
    signed_requests,
    withdraw_request,
)
from edge.tuf_client import SignedChannel
from edge.tuf_repo import named_release
from tests.edge.conftest import fake_policy
from tests.edge.signed import EXPIRY_S


def arm_of(channel, cell: str, manifest: dict) -> dict:
    key = bundle_file_key(cell, manifest["bundle_id"], MANIFEST_NAME)
    return {
        "bundle_id": manifest["bundle_id"],
        "manifest_sha256": sha256_bytes(channel.get_bytes(key)),
    }


def upload_candidate(channel, cell: str, folder: Path, version: int) -> dict:
    """A candidate's bundle on the channel, not released (what the loop uploads for trials)."""
    meta = {"model_name": "pusher-policy", "model_version": version, "mlflow_run_id": "r"}
    manifest, _ = upload_bundle(channel, cell, fake_policy(folder, version), meta)
    return manifest


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


def box_view(box: Path, dest: Path) -> list[dict]:
    signed = SignedChannel(box)
    signed.refresh()
    return signed_requests(signed, dest)


@pytest.fixture
def signing(keys: Path) -> Signing:
    return Signing(keys, EXPIRY_S)


@pytest.fixture(params=["folder", pytest.param("s3", marks=pytest.mark.slow)])
def channel_uri(request, channel) -> str:
    if request.param == "folder":
        return channel
    return f"s3://{request.getfixturevalue('s3_bucket')}/releases"


def test_a_signed_request_round_trips_and_is_withdrawn(
    publish, enroll_box, channel_uri, cell, signing, tmp_path: Path
):
    incumbent = publish(channel_uri, 1)
    channel = open_channel(channel_uri)
    candidate = upload_candidate(channel, cell, tmp_path / "cand", 2)
    box = enroll_box(channel_uri, tmp_path / "box")
    first = a_request(channel, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00")
    second = a_request(channel, cell, candidate, incumbent, "2026-12-03T09:00:00+00:00")
    publish_request(channel, first, signing)
    publish_request(channel, second, signing)

    listed = box_view(box, tmp_path / "view")
    assert [r["request_id"] for r in listed] == [second["request_id"], first["request_id"]]
    assert open_requests(channel, cell) == listed  # the publisher's view agrees
    signed = SignedChannel(box)
    signed.refresh()
    folder = fetch_signed_arm(signed, listed[0]["arms"]["candidate"], tmp_path / "arms")
    assert (folder / "model.safetensors").read_bytes() == b"weights-v2" * 100
    assert not list((tmp_path / "arms").glob(".*"))  # no staging left behind
    incumbent_folder = fetch_signed_arm(signed, listed[0]["arms"]["incumbent"], tmp_path / "arms")
    assert (incumbent_folder / "model.safetensors").read_bytes() == b"weights-v1" * 100

    assert withdraw_request(channel, cell, second["request_id"], "timed out", signing)
    assert not withdraw_request(channel, cell, second["request_id"], "again", signing)
    assert [r["request_id"] for r in box_view(box, tmp_path / "view")] == [first["request_id"]]
    assert close_request(channel, cell, first["request_id"], "judged", signing)
    assert box_view(box, tmp_path / "view") == []
    actions = [event["action"] for event in read_history(channel, cell)]
    trial_actions = [action for action in actions if action != "release"]  # publish's own
    assert trial_actions == [
        "trial_requested",
        "trial_requested",
        "trial_withdrawn",
        "trial_closed",
    ]


def test_a_release_keeps_open_requests_and_their_arms(
    publish, enroll_box, channel, cell, signing, tmp_path
):
    incumbent = publish(channel, 1)
    ch = open_channel(channel)
    candidate = upload_candidate(ch, cell, tmp_path / "cand", 2)
    request = publish_request(
        ch, a_request(ch, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00"), signing
    )
    publish(channel, 3)  # a release (a rollback, an override) while the trial is open
    box = enroll_box(channel, tmp_path / "box")
    assert agent.pull(box)["model_version"] == 3  # the trial's targets beside it change nothing
    assert [r["request_id"] for r in box_view(box, tmp_path / "view")] == [request["request_id"]]
    signed = SignedChannel(box)
    signed.refresh()
    for arm in ("candidate", "incumbent"):
        assert fetch_signed_arm(signed, request["arms"][arm], tmp_path / "arms").is_dir()
    # Once closed, only the release's bundle stays listed.
    close_request(ch, cell, request["request_id"], "judged", signing)
    signed = SignedChannel(box)
    signed.refresh()
    with pytest.raises(EdgeError, match="not listed in the signed metadata"):
        fetch_signed_arm(signed, request["arms"]["candidate"], tmp_path / "gone")
    assert named_release(ch, cell)["model_version"] == 3


def test_a_candidate_whose_bytes_differ_from_its_manifest_is_not_signed(
    publish, channel, cell, signing, tmp_path
):
    incumbent = publish(channel, 1)
    ch = open_channel(channel)
    candidate = upload_candidate(ch, cell, tmp_path / "cand", 2)
    request = a_request(ch, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00")
    weights = bundle_file_key(cell, candidate["bundle_id"], "model.safetensors")
    ch.put_bytes(weights, b"someone else's weights")
    with pytest.raises(EdgeError, match="differs from its manifest; not signing it"):
        publish_request(ch, request, signing)
    assert open_requests(ch, cell) == []


def test_a_request_naming_another_manifest_is_refused(publish, channel, cell, signing, tmp_path):
    incumbent = publish(channel, 1)
    ch = open_channel(channel)
    candidate = upload_candidate(ch, cell, tmp_path / "cand", 2)
    request = a_request(ch, cell, candidate, incumbent, "2026-12-03T10:00:00+00:00")
    request["arms"]["candidate"]["manifest_sha256"] = "0" * 64
    with pytest.raises(EdgeError, match="differs from the trial request"):
        publish_request(ch, request, signing)
    assert open_requests(ch, cell) == []


def test_a_request_before_any_release_is_refused(channel, cell, keys, signing, tmp_path):
    from edge.rotation import init_keys

    init_keys(keys, channel, EXPIRY_S)
    ch = open_channel(channel)
    candidate = upload_candidate(ch, cell, tmp_path / "cand", 2)
    request = a_request(ch, cell, candidate, candidate, "2026-12-03T10:00:00+00:00")
    with pytest.raises(EdgeError, match="no signed release yet"):
        publish_request(ch, request, signing)


def test_a_malformed_request_list_is_reported_not_run(publish, channel, cell, keys, tmp_path):
    # Signed by the cell's key but malformed: reported, never skipped silently.
    from edge.trials import trials_target
    from edge.tuf_repo import Repository, publishing

    publish(channel, 1)
    ch = open_channel(channel)
    with publishing(keys):
        repo = Repository(ch, keys, EXPIRY_S)
        document = {"format": 1, "requests": [{"format": 1, "cell_id": cell}]}
        repo.set_target(cell, trials_target(cell), json.dumps(document).encode())
        repo.commit()
    with pytest.raises(EdgeError, match="trial request lacks request_id"):
        open_requests(ch, cell)
