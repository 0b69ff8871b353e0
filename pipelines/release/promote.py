"""Promotion: a candidate that passed the gate goes to the cell's edge channel.

No gate, no promotion: on a failed (or malformed) gate decision nothing is published and the
registry alias stays where it was. On a pass the policy's two files are published as a bundle
for the cell (edge.channels.publish_bundle: every file with its sha256, then the cell's
CURRENT.json pointer in one atomic write), and then the cell's registry alias
`<cell_id><suffix>` is moved to the version. Each cell has its own channel path and alias.

Publish first, alias second: the alias says which model the cell runs, and the next cycle
records with it and gates against it, so it must never name a model that did not reach the
channel. Both steps are idempotent; a crash between them is completed by running promote again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from edge.bundle import CONFIG_FILE, MODEL_FILE
from edge.channels import publish_bundle
from edge.integrity import sha256_file
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
    channel: str | None  # where the bundle was published
    bundle: dict[str, Any] | None  # its manifest

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def promote(
    decision: Any,
    cell_id: str,
    params: PromoteParams,
    registered_model: str,
    version: str,
    run_id: str,
    policy_folder: Path,
    dataset_version: str,
    signing_key: Path | None = None,
    *,
    workspace: Path | None = None,
) -> PromotionResult:
    """Publish the gated version to `params.channel` for `cell_id` and point its alias at it.

    `decision` is a GateDecision or its record (a dict with `passed` and `reasons`); only
    `passed is True` promotes. The bundle carries the model name and version, the dataset
    version, the MLflow run id and the whole gate record. `policy_folder` must hold exactly the
    registered version's weights (checked against the registry's sha256), so a bundle can never
    claim a version it is not. The registry is the one of `workspace` (default: the workspace
    in use, see pipelines.training.tracking), and a relative local channel is taken relative to it.
    """
    gate = _gate_record(decision)
    reasons = [str(reason) for reason in gate.get("reasons", [])]
    if gate.get("passed") is not True:
        reasons.append("not promoted: the gate did not pass; channel and alias are unchanged")
        return PromotionResult(False, reasons, None, None, None)

    # A policy folder and a bundle use the same two file names
    # (pipelines.training.policy, edge.bundle).
    files = {name: Path(policy_folder) / name for name in (MODEL_FILE, CONFIG_FILE)}
    check_is_registered_version(workspace, registered_model, version, run_id, files)
    channel = channel_location(params.channel, workspace)
    manifest = publish_bundle(
        channel,
        cell_id,
        files,
        metadata={
            "model_name": registered_model,
            "model_version": _version_number(version),
            "dataset_version": dataset_version,
            "mlflow_run_id": run_id,
            "gate": gate,
        },
        signing_key=signing_key,
    )
    alias = production_alias(cell_id, params)
    set_production_alias(registered_model, alias, version, workspace=workspace)
    reasons.append(
        f"promoted: {registered_model} version {version} published as bundle "
        f"{manifest['bundle_id']} for {cell_id}; alias {alias} -> version {version}"
    )
    return PromotionResult(True, reasons, alias, channel, manifest)


def production_alias(cell_id: str, params: PromoteParams) -> str:
    """The registry alias naming the version a cell runs: `<cell_id>-production`."""
    return f"{cell_id}{params.alias_suffix}"


def _gate_record(decision: Any) -> dict[str, Any]:
    record = decision.as_record() if hasattr(decision, "as_record") else decision
    if not isinstance(record, Mapping) or "passed" not in record:
        raise TypeError(
            f"gate decision: expected a GateDecision or a record with 'passed' and 'reasons', "
            f"got {type(decision).__name__}"
        )
    return dict(record)


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


def _version_number(version: str) -> int | str:
    """Registry versions are whole numbers; the manifest carries them as such."""
    text = str(version)
    return int(text) if text.isdigit() else text
