"""Fault: the S3 store goes down in the middle of a promotion.

A real outage of the profile's S3 store (its server process stopped) at the worst moment:
after the new bundle's first file is on the channel, before its manifest and the signed
release (TUF metadata, the timestamp last). The moment is chosen by a hook on the S3 channel's
put (injected: the window between two puts is milliseconds wide, too narrow to hit from
outside); what follows is
not: every later request meets a closed port. The store comes back with `realloop services up`
(with its objects: a plant's S3 is durable, the profile's moto keeps them across a stop).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from edge import s3 as edge_s3
from edge.errors import EdgeError
from edge.release import current_release
from edge.rotation import init_keys
from flows import services as sv
from pipelines.release import attest_gate, production_alias, promote
from pipelines.training import production_version
from tests.faults.conftest import bring_back, train_and_register

pytestmark = pytest.mark.faults
CELL = "cell-31"  # its own cell: the tests share the profile's registry


def _pull(channel: str, box, env, root) -> subprocess.CompletedProcess:
    """What the cell's edge box does: enrol once, then follow the signed release, verify,
    activate."""
    edge = [sys.executable, "-m", "edge.cli"]
    if not (box / "tuf").exists():
        init = [*edge, "init", "--channel", channel, "--cell", CELL, "--root", str(root)]
        subprocess.run([*init, "--box", str(box)], env=env, check=True, capture_output=True)
    return subprocess.run(
        [*edge, "pull", "--box", str(box), "--json"], env=env, capture_output=True, text=True
    )


def test_the_channel_never_names_an_incomplete_release_and_the_next_promotion_succeeds(
    in_profile, params, tmp_path, monkeypatch
):
    profile, workspace = in_profile, tmp_path / "workspace"
    channel = f"s3://{sv.BUCKET}/channel-{tmp_path.name}"
    promote_params = dataclasses.replace(params.promote, channel=channel)
    model = params.train.registered_model
    keys = workspace / params.promote.keys
    init_keys(keys, None, params.promote.timestamp_expiry_s)
    root = keys / "root.json"
    passed = {"passed": True, "reasons": ["test gate: passed"], "trial_request_id": "t-1"}

    def promote_version(trained):
        run_id, version, folder = trained
        return promote(
            attest_gate(passed, folder, keys), CELL, promote_params, model, version, run_id,
            folder, "data-v1", workspace=workspace,
        )  # fmt: skip

    first = promote_version(train_and_register(params, workspace, CELL, seed=1))
    assert first.promoted
    box = tmp_path / "box"
    assert _pull(channel, box, dict(os.environ), root).returncode == 0

    # The second promotion: the store goes down after the bundle's first file.
    second_trained = train_and_register(params, workspace, CELL, seed=2)
    real_put_file, puts = edge_s3.S3Channel.put_file, []

    def put_file_then_outage(self, key, path):
        real_put_file(self, key, path)
        puts.append(key)
        if len(puts) == 1:
            assert sv.stop_s3(profile)  # snapshot, then the server process is gone

    monkeypatch.setattr(edge_s3.S3Channel, "put_file", put_file_then_outage)
    with pytest.raises(EdgeError) as failed:
        promote_version(second_trained)
    message = str(failed.value)
    assert "\n" not in message and channel.split("//")[1] in message, message
    monkeypatch.setattr(edge_s3.S3Channel, "put_file", real_put_file)

    # While it is down, and after it is back: the alias and the release still name release 1.
    alias = production_alias(CELL, promote_params)
    assert production_version(model, alias, workspace=workspace).version == str(
        first.bundle["model_version"]
    )
    back_s = bring_back(profile)
    listed = [k for k in _keys(profile, channel) if "/bundles/" in k]
    second_id = _bundle_ids(listed) - {first.bundle["bundle_id"]}
    assert len(second_id) == 1  # the incomplete bundle: one file, no manifest
    assert not [k for k in listed if k.endswith("manifest.json") and second_id & set(k.split("/"))]
    assert current_release(channel, CELL)["bundle_id"] == first.bundle["bundle_id"]
    pulled = _pull(channel, box, dict(os.environ), root)
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["bundle_id"] == first.bundle["bundle_id"]

    # The next promotion of the same version completes what was cut, and the box follows.
    again = promote_version(second_trained)
    assert again.promoted and again.bundle["bundle_id"] in second_id
    assert production_version(model, alias, workspace=workspace).version == second_trained[1]
    pulled = _pull(channel, box, dict(os.environ), root)
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["bundle_id"] == again.bundle["bundle_id"]
    # Nothing lost: release 1 is whole on the channel still, as the box's rollback needs.
    first_keys = [k for k in _keys(profile, channel) if first.bundle["bundle_id"] in k]
    # model, config, manifest (the trial copy); model, config, attestation (signed targets)
    assert len(first_keys) == 6, first_keys
    print(f"S3 store back in {back_s:.1f} s")


def _split(channel: str) -> tuple[str, str]:
    bucket, _, prefix = channel.removeprefix("s3://").partition("/")
    return bucket, prefix


def _keys(profile: sv.Profile, channel: str) -> list[str]:
    bucket, prefix = _split(channel)
    listed = sv.s3_client(profile).list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return [item["Key"].removeprefix(prefix + "/") for item in listed.get("Contents", [])]


def _get(profile: sv.Profile, channel: str, key: str) -> bytes:
    bucket, prefix = _split(channel)
    return sv.s3_client(profile).get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def _bundle_ids(keys: list[str]) -> set[str]:
    return {k.split("/bundles/")[1].split("/")[0] for k in keys}
