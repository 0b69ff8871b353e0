"""The keys-refresh deployment's flow: a channel with no new release stays trusted by boxes
because the schedule re-signs its timestamp; without it the box refuses it as frozen."""

from __future__ import annotations

import shutil

import pytest

from edge import agent
from edge.channels import open_channel
from edge.errors import EdgeError
from edge.tuf_repo import Repository, publishing
from flows.keys_refresh import keys_refresh_flow
from tests.conftest import ROOT
from tests.edge.signed import enrolled, publish_override


def test_the_schedule_keeps_an_idle_channel_trusted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    run = keys_refresh_flow.fn  # the flow's body, without a Prefect server
    assert "nothing published yet" in run("params.yaml", str(tmp_path))["skipped"]

    keys, channel = tmp_path / ".realloop" / "keys", str(tmp_path / "data" / "edge-channel")
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"w1")
    meta = {"model_name": "m", "model_version": 1}
    publish_override(channel, "cell-07", {"model.safetensors": model}, meta, keys)
    box = enrolled(channel, keys, "cell-07", tmp_path / "box")
    assert agent.pull(box)["action"] == "activated"
    # A day without a release, without refreshes: the timestamp is past its expiry.
    with publishing(keys):
        Repository(open_channel(channel), keys, timestamp_expiry_s=-60).refresh_timestamp()
    with pytest.raises(EdgeError, match="freeze attack"):
        agent.pull(box)

    refreshed = run("params.yaml", str(tmp_path))
    assert refreshed["expires_in_s"] == 86400 and refreshed["channel"] == channel
    assert agent.pull(box)["action"] == "already_active"
