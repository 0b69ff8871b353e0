"""`realloop deploy --initial PATH --cell ID`: a cell's first production model, as an override.

A new cell has nothing on the channel and idles (docs/operations.md). Its first model cannot
pass the gate, since there is no incumbent to trial it against, so this publish bypasses the
gate and is recorded as an override in both places people look:

- the registry: a version of `train.registered_model` tagged override=true, override_by,
  override_at, override_reason (and override_cell), with the alias `<cell><promote.alias_suffix>`;
- the channel: the bundle's manifest `gate` is {"override": {...}}, and the cell's history
  holds an `override_initial_deploy` event.

The order is promote's: register, publish (files, manifest, then CURRENT.json), history, and
the alias last, since it says what the cell runs. A run cut short anywhere is completed by
running the same command again: it finds the version it registered (same weights, same cell,
override tags, no alias yet) and carries on from there. A cell that already has a production
model (the alias, or a pointer on the channel) is refused unless --force.
"""

from __future__ import annotations

import getpass
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.console import CommandError, emit, fails_cleanly, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]

# Deploy runs are kept apart from the fine-tuning runs that reviewers compare on val_loss.
DEPLOY_EXPERIMENT = "realloop-deploy"
HISTORY_ACTION = "override_initial_deploy"
OVERRIDE_FILE = "override.json"  # the override record, on the deploy run


@fails_cleanly
def deploy_command(
    initial: Annotated[
        Path,
        typer.Option(
            "--initial",
            help="policy folder (model.safetensors + config.json) to run as the cell's first "
            "production model",
        ),
    ],
    cell: Annotated[str, typer.Option("--cell", help="the cell id (its channel path)")],
    reason: Annotated[
        str | None, typer.Option(help="why, for the override record (default: first deploy)")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="replace a cell's production model anyway")
    ] = False,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Publish a policy as a cell's first production model, bypassing the gate: recorded as
    an override (who, when, why) in the registry and in the channel's history."""
    from pipelines.contract.params import load_params
    from pipelines.training import use_workspace

    workspace = Path.cwd()
    params = load_params(params_path)
    use_workspace(workspace)
    payload = deploy_initial(workspace, params, initial, cell, reason, force=force)
    emit(payload, as_json, _print_deploy)


def deploy_initial(
    workspace: Path,
    params,
    policy_folder: Path,
    cell_id: str,
    reason: str | None = None,
    *,
    force: bool = False,
) -> dict[str, Any]:
    """Register `policy_folder` as an override version, publish it as `cell_id`'s production
    bundle, record the override in the channel's history and point the cell's alias at it."""
    from edge.bundle import check_name
    from edge.channels import open_channel
    from edge.errors import EdgeError
    from pipelines.release import channel_location

    try:
        check_name(cell_id, "cell id")
        with tempfile.TemporaryDirectory(prefix="realloop-deploy-") as tmp:
            staged = _staged_policy(Path(policy_folder), Path(tmp))
            channel_uri = channel_location(params.promote.channel, workspace)
            channel = open_channel(channel_uri)
            return _deploy(params, staged, cell_id, reason, force, channel, channel_uri)
    except EdgeError as exc:
        raise CommandError(str(exc)) from None


def _deploy(params, staged, cell_id, reason, force, channel, channel_uri) -> dict[str, Any]:
    from edge.channels import publish_bundle
    from edge.trials import record_history
    from pipelines.training import set_production_alias

    model = params.train.registered_model
    alias = f"{cell_id}{params.promote.alias_suffix}"
    sha256 = _sha256(staged.files["model.safetensors"])
    earlier = _interrupted_deploy(model, cell_id, alias, sha256)
    production = _production_now(model, alias, channel, cell_id, earlier)
    if production and not force:
        raise CommandError(
            f"cell {cell_id} already has a production model ({'; '.join(production)}); "
            "--initial deploys a cell's first model: pass --force to replace it anyway "
            "(recorded as an override)"
        )
    override = {
        "kind": "initial_deploy",
        "by": getpass.getuser(),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "reason": reason or f"first deployment of {cell_id}: no incumbent to trial against",
        "forced": force,
        "replaced": production,
    }
    tags = _override_tags(cell_id, override)
    version, run_id = earlier or _register(model, cell_id, staged.folder, tags)
    _record_override(model, version, run_id, tags, override)
    manifest = publish_bundle(
        channel_uri,
        cell_id,
        staged.files,
        metadata={
            "model_name": model,
            "model_version": int(version),
            "dataset_version": staged.trained_on.get("dataset_version"),
            "mlflow_run_id": run_id,
            "gate": {"override": override},
        },
    )
    details = {"model_name": model, "model_version": int(version), "override": override}
    record_history(channel, cell_id, HISTORY_ACTION, manifest["bundle_id"], details)
    set_production_alias(model, alias, version)
    return {
        "cell": cell_id,
        "registered_model": model,
        "model_version": version,
        "mlflow_run_id": run_id,
        "alias": alias,
        "channel": channel_uri,
        "bundle_id": manifest["bundle_id"],
        "policy_sha256": sha256,
        "override": override,
        "resumed": earlier is not None,
    }


class _Staged:
    """A private copy of the policy: what was loaded is what is registered and published."""

    def __init__(self, folder: Path, trained_on: dict):
        self.folder = folder
        self.files = {name: folder / name for name in ("model.safetensors", "config.json")}
        self.trained_on = trained_on


def _staged_policy(source: Path, tmp: Path) -> _Staged:
    from pipelines.training import load_policy

    try:
        load_policy(source)  # a broken folder is refused before anything is written
        folder = tmp / "policy"
        folder.mkdir()
        for name in ("model.safetensors", "config.json"):
            shutil.copyfile(source / name, folder / name)
        policy = load_policy(folder)
    except (FileNotFoundError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise CommandError(
            f"{source}: not a policy that loads, refusing to deploy it: {reason}"
        ) from None
    return _Staged(folder, dict(policy.net.config.trained_on or {}))


def _interrupted_deploy(
    model: str, cell_id: str, alias: str, sha256: str
) -> tuple[str, str] | None:
    """(version, run id) of an earlier deploy of these weights to this cell that the alias
    does not name: a run cut short before its last step, to be completed, not repeated."""
    from pipelines.training import POLICY_SHA256_TAG, production_version
    from pipelines.training.tracking import mlflow_client

    aliased = production_version(model, alias)
    for mv in mlflow_client(None).search_model_versions(f"name = '{model}'"):
        tags = mv.tags or {}
        if (
            tags.get("override") == "true"
            and tags.get("override_cell") == cell_id
            and tags.get(POLICY_SHA256_TAG) == sha256
            and (aliased is None or aliased.version != str(mv.version))
        ):
            return str(mv.version), mv.run_id
    return None


def _production_now(
    model: str, alias: str, channel, cell_id: str, earlier: tuple[str, str] | None
) -> list[str]:
    """What says the cell already runs a model: the registry alias, the channel's pointer
    (unless it names the version an interrupted deploy left behind)."""
    from edge.bundle import MANIFEST_NAME, bundle_file_key, parse_json, parse_pointer, pointer_key
    from edge.errors import KeyNotFoundError
    from pipelines.training import production_version

    found = []
    info = production_version(model, alias)
    if info is not None:
        found.append(f"registry alias {alias} -> {model} version {info.version}")
    key = pointer_key(cell_id)
    try:
        pointer = parse_pointer(channel.get_bytes(key), channel.describe(key))
    except KeyNotFoundError:
        return found
    manifest_key = bundle_file_key(cell_id, pointer.bundle_id, MANIFEST_NAME)
    try:
        manifest = parse_json(channel.get_bytes(manifest_key), channel.describe(manifest_key))
    except KeyNotFoundError:
        manifest = {}
    ours = earlier is not None and (
        manifest.get("model_name") == model and str(manifest.get("model_version")) == earlier[0]
    )
    if not ours:
        found.append(f"channel {channel.describe(key)} -> bundle {pointer.bundle_id}")
    return found


def _register(model: str, cell_id: str, folder: Path, tags: dict) -> tuple[str, str]:
    """A deploy run in DEPLOY_EXPERIMENT, and the policy registered from it with the override
    tags (all of them at once: an interrupted deploy is found by them)."""
    from pipelines.training import register_policy
    from pipelines.training.tracking import current_workspace, ensure_experiment, mlflow_client

    client = mlflow_client(None)
    experiment = ensure_experiment(client, current_workspace(), DEPLOY_EXPERIMENT)
    run = client.create_run(experiment, run_name=f"deploy-initial-{cell_id}")
    run_id, status = run.info.run_id, "FAILED"
    try:
        version = register_policy(run_id, folder, model, tags=tags)
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status)
    return version, run_id


def _override_tags(cell_id: str, override: dict) -> dict[str, str]:
    return {
        "override": "true",
        "override_by": override["by"],
        "override_at": override["at"],
        "override_reason": override["reason"],
        "override_cell": cell_id,
    }


def _record_override(model: str, version: str, run_id: str, tags: dict, override: dict) -> None:
    """The override's tags on the version and its run (this attempt's, when an interrupted
    one is completed), and the whole record as the run's override.json."""
    from pipelines.training.tracking import mlflow_client

    client = mlflow_client(None)
    for key, value in tags.items():
        client.set_model_version_tag(model, version, key, value)
        client.set_tag(run_id, key, value)
    client.log_dict(run_id, override, OVERRIDE_FILE)


def _sha256(path: Path) -> str:
    from edge.integrity import sha256_file

    return sha256_file(path)


def _print_deploy(p: dict) -> None:
    stdout.print(
        f"{p['cell']}: {p['registered_model']} version {p['model_version']} published as bundle "
        f"{p['bundle_id']} on {p['channel']}; alias {p['alias']} -> version "
        f"{p['model_version']}",
        highlight=False,
        soft_wrap=True,
    )
    o = p["override"]
    stdout.print(
        f"recorded as an override (the gate was bypassed) by {o['by']} at {o['at']}: {o['reason']}",
        highlight=False,
        soft_wrap=True,
    )
