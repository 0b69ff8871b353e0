"""Promotion: a candidate with a passing, signed gate attestation goes to the cell's channel.

No gate, no promotion: `promote` takes the gate's attestation (a DSSE envelope signed by the
gate key, edge.attestation), never a verdict a caller asserts. It verifies the signature, the
verdict and that the attested model is exactly the registered version's weights; otherwise
nothing is published and the registry alias stays. A person's decision (an override, a
rollback, an approval after the gate) is named, with who, when and why, in the registry's
version tags and in the signed release on the channel.

On a pass the policy folder's files are published as a signed TUF release for the cell
(edge.release.publish_release: targets, the cell's metadata, snapshot, the timestamp last),
and then the cell's registry alias `<cell_id><suffix>` is moved to the version.

Publish first, alias second: the alias says which model the cell runs, and the next cycle
records with it and gates against it, so it must never name a model that did not reach the
channel. Both steps are idempotent; a crash between them is completed by running promote again.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from edge.attestation import sign_gate_attestation, verify_gate_attestation
from edge.bundle import MODEL_FILE, check_name
from edge.errors import EdgeError
from edge.integrity import sha256_file
from edge.keys import GATE, load_public, load_signer, public_path
from edge.release import GATED_KINDS, check_decision, publish_release
from pipelines.contract.params import PromoteParams
from pipelines.training import (
    POLICY_SHA256_TAG,
    current_workspace,
    model_version_info,
    set_production_alias,
)


@dataclass(frozen=True)
class PromotionResult:
    promoted: bool
    reasons: list[str]
    alias: str | None  # the registry alias moved to the version
    channel: str | None  # where the release was published
    bundle: dict[str, Any] | None  # the signed release description

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def promote(
    attestation: bytes | None,
    cell_id: str,
    params: PromoteParams,
    registered_model: str,
    version: str,
    run_id: str,
    policy_folder: Path,
    dataset_version: str | None,
    *,
    decision: dict[str, Any] | None = None,
    workspace: Path | None = None,
) -> PromotionResult:
    """Publish the version to `params.channel` for `cell_id`, signed, and point its alias at it.

    `attestation`: the gate's DSSE envelope for these weights; required unless `decision` is an
    override or a rollback (a dict with kind, by, at, reason; kind "approval" is a sign-off on
    top of a passing gate). `policy_folder` must hold exactly the registered version's weights
    (checked against the registry's sha256). The registry is the one of `workspace` (default:
    the workspace in use); a relative channel or keys folder is taken relative to it.
    """
    decision = check_decision(dict(decision or {"kind": "gate"}))
    keys_dir = keys_location(params.keys, workspace)
    files = bundle_files(Path(policy_folder))
    check_is_registered_version(workspace, registered_model, version, run_id, files)
    if decision["kind"] in GATED_KINDS:
        refused = _refused_attestation(attestation, keys_dir, files)
        if refused:
            return PromotionResult(False, [refused], None, None, None)
    channel = channel_location(params.channel, workspace)
    release = publish_release(
        channel,
        keys_dir,
        cell_id,
        files,
        metadata={
            "model_name": registered_model,
            "model_version": _version_number(version),
            "dataset_version": dataset_version,
            "mlflow_run_id": run_id,
        },
        decision=decision,
        attestation=attestation,
        timestamp_expiry_s=params.timestamp_expiry_s,
    )
    if decision["kind"] != "gate":
        record_decision(registered_model, version, run_id, cell_id, decision, workspace=workspace)
    alias = production_alias(cell_id, params)
    set_production_alias(registered_model, alias, version, workspace=workspace)
    reasons = [
        f"promoted ({decision['kind']}): {registered_model} version {version} published as "
        f"signed release {release['bundle_id']} for {cell_id}; alias {alias} -> version {version}"
    ]
    return PromotionResult(True, reasons, alias, channel, release)


def attest_gate(record: dict[str, Any], policy_folder: Path, keys_dir: Path) -> bytes:
    """The gate's verdict on the candidate in `policy_folder`, signed with the gate key: an
    in-toto statement whose subject is its model.safetensors and whose predicate holds the
    trial request, both arms' statistics, the verdict and the reasons."""
    predicate = {
        "request_id": record.get("trial_request_id"),
        "attempt": record.get("trial_attempt"),
        "episodes_per_arm": record.get("episodes_per_arm"),
        "bundles": record.get("arms"),
        "arms": {"candidate": record.get("candidate"), "incumbent": record.get("incumbent")},
        "stopped": record.get("stopped"),  # how the sequential test ended
        "verdict": "pass" if record.get("passed") is True else "fail",
        "reasons": [str(reason) for reason in record.get("reasons", [])],
    }
    model = sha256_file(Path(policy_folder) / MODEL_FILE)
    return sign_gate_attestation(model, predicate, load_signer(keys_dir, GATE))


def named_decision(kind: str, reason: str, by: str | None = None) -> dict[str, Any]:
    """A person's decision: who (`by`, else REALLOOP_USER, else the login name), now, why."""
    return check_decision(
        {
            "kind": kind,
            "by": by or os.environ.get("REALLOOP_USER") or getpass.getuser(),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "reason": reason,
        }
    )


def decision_tags(cell_id: str, decision: dict[str, Any]) -> dict[str, str]:
    """The registry's record of a named decision: `<kind>`=true, `<kind>_by`, `_at`,
    `_reason` and `_cell` (e.g. override_by), on the version and on its run."""
    kind = decision["kind"]
    return {
        kind: "true",
        f"{kind}_by": str(decision["by"]),
        f"{kind}_at": str(decision["at"]),
        f"{kind}_reason": str(decision["reason"]),
        f"{kind}_cell": cell_id,
    }


def record_decision(
    registered_model: str,
    version: str,
    run_id: str,
    cell_id: str,
    decision: dict[str, Any],
    *,
    workspace: Path | None = None,
) -> None:
    """The decision's tags on the version and its run, and the whole record as the run's
    `<kind>.json`: what a reviewer sees in the MLflow UI."""
    from pipelines.training.tracking import mlflow_client

    client = mlflow_client(workspace)
    for key, value in decision_tags(cell_id, decision).items():
        client.set_model_version_tag(registered_model, str(version), key, value)
        client.set_tag(run_id, key, value)
    client.log_dict(run_id, decision, f"{decision['kind']}.json")


def production_alias(cell_id: str, params: PromoteParams) -> str:
    """The registry alias naming the version a cell runs: `<cell_id>-production`."""
    return f"{cell_id}{params.alias_suffix}"


def bundle_files(policy_folder: Path) -> dict[str, Path]:
    """Every file of the policy folder (weights, config, and the edge files when present:
    policy.onnx, ood.json): they travel and are signed together."""
    files = {
        path.name: path
        for path in sorted(Path(policy_folder).iterdir())
        if path.is_file() and not path.name.startswith(".")
    }
    for name in files:
        check_name(name, f"{policy_folder}: file name")
    if MODEL_FILE not in files:
        raise ValueError(f"{policy_folder}: no {MODEL_FILE}; not a policy folder")
    return files


def _refused_attestation(
    attestation: bytes | None, keys_dir: Path, files: dict[str, Path]
) -> str | None:
    """Why the attestation does not allow promoting these weights, or None when it does."""
    suffix = "; not promoted: channel and alias are unchanged"
    if attestation is None:
        return f"no gate attestation for {files[MODEL_FILE]}{suffix}"
    gate_key = load_public(public_path(keys_dir, GATE))
    try:
        verify_gate_attestation(attestation, [gate_key], sha256_file(files[MODEL_FILE]))
    except EdgeError as exc:
        return f"{exc}{suffix}"
    return None


def check_is_registered_version(
    workspace: Path | None,
    registered_model: str,
    version: str,
    run_id: str,
    files: dict[str, Path],
) -> None:
    info = model_version_info(registered_model, version, workspace=workspace)
    where = f"{registered_model} version {info.version}"
    if info.run_id != run_id:
        raise ValueError(f"{where}: registered from run {info.run_id}, not from run {run_id}")
    expected = info.tags.get(POLICY_SHA256_TAG)
    actual = sha256_file(files[MODEL_FILE])
    if expected != actual:
        raise ValueError(
            f"{where}: {files[MODEL_FILE]} has sha256 {actual}, the registry has "
            f"{expected}; refusing to publish weights that are not this version"
        )


def channel_location(channel: str, workspace: Path | None) -> str:
    """The channel as a URI, or a local folder resolved against the workspace."""
    scheme = urlparse(channel).scheme
    if scheme and len(scheme) > 1:  # s3://, file://: not relative to anything
        return channel
    return str(current_workspace(workspace) / channel)


def keys_location(keys: str, workspace: Path | None) -> Path:
    """The keys folder, relative to the workspace unless absolute."""
    return current_workspace(workspace) / keys


def _version_number(version: str) -> int | str:
    """Registry versions are whole numbers; the release carries them as such."""
    text = str(version)
    return int(text) if text.isdigit() else text
