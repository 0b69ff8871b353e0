"""A signed release: which bundle a cell runs and the decision that put it there.

`<cell>/release.json` is a TUF target of the cell's role (signed by the cell's key), like the
bundle's files (`<cell>/<bundle_id>/<name>`) and, for a gated release, the gate attestation
(`<cell>/<bundle_id>/attestation.json`). The decision is named: `gate`, `approval` (a gate
pass signed off by a person) and `rollout` (the canary's attested version to another cell)
carry the attestation; `override` and `rollback` carry who, when and why instead. There is no
unsigned path: a box follows nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from edge.bundle import MODEL_FILE, check_files, check_name, utc_timestamp
from edge.channels import open_channel, upload_bundle
from edge.errors import EdgeError
from edge.integrity import sha256_bytes, sha256_file
from edge.trials import kept_trial_targets, record_history
from edge.tuf_repo import (
    ATTESTATION_NAME,
    Repository,
    bundle_target,
    named_release,
    publishing,
    release_target,
)

FORMAT = 1
# A passing gate attestation is part of the release: the gate's own pass, a person's sign-off
# on it, and the staged rollout of the canary's attested version to the other cells.
GATED_KINDS = ("gate", "approval", "rollout")
NAMED_KINDS = ("override", "rollback")  # a person's decision instead of the gate
DECISION_KINDS = GATED_KINDS + NAMED_KINDS
HISTORY_ACTION = "release"


def check_decision(decision: object) -> dict[str, Any]:
    """A decision has a known kind; every kind but the gate's own says who, when and why."""
    if not isinstance(decision, dict) or decision.get("kind") not in DECISION_KINDS:
        kind = decision.get("kind") if isinstance(decision, dict) else decision
        raise EdgeError(f"release decision: kind {kind!r} is not one of {list(DECISION_KINDS)}")
    if decision["kind"] != "gate":
        missing = [f for f in ("by", "at", "reason") if not decision.get(f)]
        if missing:
            raise EdgeError(f"release decision {decision['kind']}: missing {missing}")
    return decision


def check_release(release: object, cell_id: str) -> dict[str, Any]:
    """Raise EdgeError unless this is a format-1 release for this cell with safe file names."""
    if not isinstance(release, dict) or release.get("format") != FORMAT:
        raise EdgeError(f"{release_target(cell_id)}: not a format-{FORMAT} release description")
    if release.get("cell_id") != cell_id:
        raise EdgeError(
            f"{release_target(cell_id)}: is for cell {release.get('cell_id')!r}, not {cell_id!r}"
        )
    check_name(release.get("bundle_id"), "bundle id")
    check_files(release.get("files"))
    check_decision(release.get("decision"))
    if release["decision"]["kind"] in GATED_KINDS and not release.get("attestation"):
        raise EdgeError(
            f"release {release['bundle_id']}: decision {release['decision']['kind']} without "
            "a gate attestation; refusing it"
        )
    return release


def publish_release(
    channel_uri: str | os.PathLike[str],
    keys_dir: Path,
    cell_id: str,
    files: dict[str, Path],
    metadata: dict[str, Any],
    decision: dict[str, Any],
    attestation: bytes | None,
    timestamp_expiry_s: float,
) -> dict[str, Any]:
    """Publish a signed release for `cell_id`; return its description.

    Uploads the bundle (files and manifest, the layout trials use), then the TUF targets (the
    files, the attestation, release.json) and metadata, the timestamp last. `metadata` holds
    model_name, model_version, dataset_version and mlflow_run_id.
    """
    check_decision(decision)
    if decision["kind"] in GATED_KINDS and attestation is None:
        raise EdgeError(f"release for {cell_id}: decision {decision['kind']} needs an attestation")
    channel = open_channel(channel_uri)
    manifest, manifest_bytes = upload_bundle(channel, cell_id, files, metadata)
    bundle_id = manifest["bundle_id"]
    with publishing(keys_dir):
        repo = Repository(channel, keys_dir, timestamp_expiry_s)
        repo.ensure_top_targets()
        repo.ensure_cell(cell_id)
        # The cell's role lists its current release, and what its open trial requests need.
        repo.clear_targets(cell_id, keep=kept_trial_targets(repo, cell_id))
        for name, path in sorted(files.items()):
            repo.set_target_file(cell_id, bundle_target(cell_id, bundle_id, name), Path(path))
        if attestation is not None:
            repo.set_target(
                cell_id, bundle_target(cell_id, bundle_id, ATTESTATION_NAME), attestation
            )
        release = {
            "format": FORMAT,
            "cell_id": cell_id,
            "bundle_id": bundle_id,
            **{k: manifest.get(k) for k in ("model_name", "model_version", "dataset_version")},
            "mlflow_run_id": manifest.get("mlflow_run_id"),
            "files": manifest["files"],
            "manifest_sha256": sha256_bytes(manifest_bytes),  # the trial layout's copy
            "attestation": ATTESTATION_NAME if attestation is not None else None,
            "decision": decision,
            "published_at": utc_timestamp(),
        }
        data = (json.dumps(release, indent=2, sort_keys=True) + "\n").encode()
        repo.set_target(cell_id, release_target(cell_id), data)
        release["tuf_version"] = repo.commit()
    details = {"model_version": release["model_version"], "decision": decision}
    record_history(channel, cell_id, HISTORY_ACTION, bundle_id, details)
    return release


def current_release(channel_uri: str | os.PathLike[str], cell_id: str) -> dict[str, Any] | None:
    """The release the channel names for `cell_id` (unverified: see tuf_repo.named_release)."""
    return named_release(open_channel(channel_uri), cell_id)


def model_sha256(files: dict[str, Path]) -> str:
    return sha256_file(Path(files[MODEL_FILE]))
