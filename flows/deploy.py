"""Releases a person decides: `realloop deploy --initial`, `realloop promote --override`,
`realloop rollback`. Each is a named decision (who, when, why) recorded in both places people
look, and signed like every release (there is no unsigned path):

- the registry: the version's tags `<kind>`=true, `<kind>_by`, `<kind>_at`, `<kind>_reason`,
  `<kind>_cell` (kind: override or rollback), and `<kind>.json` on its run; the alias
  `<cell><promote.alias_suffix>` moves to the version;
- the channel: the release's signed decision (edge.release) and the cell's history.

`deploy --initial PATH --cell ID`: a new cell has nothing on the channel and idles
(docs/operations.md). Its first model cannot pass the gate, since there is no incumbent to
trial it against, so this publish is an override. It makes the signing keys on first use
(`promote.keys`; root in its offline/). The order is promote's: register, publish, and the
alias last, since it says what the cell runs. A run cut short anywhere is completed by running
the same command again: it finds the version it registered (same weights, same cell, override
tags, no alias yet) and carries on from there. A cell that already has a production model (the
alias, or a release on the channel) is refused unless --force.

`rollback --cell ID --to VERSION` republishes an older registered version as a new release
(TUF versions go up) whose decision is a rollback, which is what lets a box accept the
downgrade.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.console import CommandError, emit, fails_cleanly, stderr, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]

# Deploy runs are kept apart from the fine-tuning runs that reviewers compare on val_loss.
DEPLOY_EXPERIMENT = "realloop-deploy"


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


CellOpt = Annotated[str, typer.Option("--cell", help="the cell id (its channel path)")]
ReasonOpt = Annotated[str, typer.Option("--reason", help="why, for the record (required)")]
ByOpt = Annotated[
    str | None,
    typer.Option("--by", help="who decides (default: $REALLOOP_USER, then the login name)"),
]


@fails_cleanly
def promote_command(
    cell: CellOpt,
    version: Annotated[str, typer.Option("--version", help="the registered model version")],
    reason: ReasonOpt,
    override: Annotated[
        bool, typer.Option("--override", help="publish without a passing gate (recorded)")
    ] = False,
    by: ByOpt = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Publish a registered version to a cell bypassing the gate: an override, recorded with
    who, when and why in the registry and in the channel's signed release."""
    from pipelines.release import named_decision

    if not override:
        raise CommandError(
            "realloop promote publishes without the gate only as a recorded override: pass "
            "--override --reason '...'; gated promotions happen in `realloop loop`"
        )
    _decided(params_path, cell, version, named_decision("override", reason, by), as_json)


@fails_cleanly
def rollback_command(
    cell: CellOpt,
    to: Annotated[str, typer.Option("--to", help="the registered version to go back to")],
    reason: ReasonOpt,
    by: ByOpt = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Republish an older registered version as a cell's release, signed as a rollback (the
    one decision that lets an edge box accept a lower model version)."""
    from pipelines.release import named_decision

    _decided(params_path, cell, to, named_decision("rollback", reason, by), as_json)


def _decided(params_path: Path, cell: str, version: str, decision: dict, as_json: bool) -> None:
    from pipelines.contract.params import load_params
    from pipelines.training import use_workspace

    workspace = Path.cwd()
    params = load_params(params_path)
    use_workspace(workspace)
    payload = decided_release(workspace, params, cell, version, decision)
    emit(payload, as_json, _print_decided)


def decided_release(workspace: Path, params, cell_id: str, version: str, decision: dict) -> dict:
    """Publish registered `version` to `cell_id` under a person's `decision` (override or
    rollback): signed release, registry tags, alias."""
    from edge.bundle import check_name
    from edge.errors import EdgeError
    from edge.release import current_release
    from pipelines.release import channel_location, promote
    from pipelines.training import download_policy, model_version_info

    model = params.train.registered_model
    channel_uri = channel_location(params.promote.channel, workspace)
    try:
        check_name(cell_id, "cell id")
        info = model_version_info(model, version)
        running = current_release(channel_uri, cell_id)
        if decision["kind"] == "rollback" and running is None:
            raise CommandError(f"{cell_id}: no release on {channel_uri}; nothing to roll back")
        ensure_keys(workspace, params, channel_uri)
        with tempfile.TemporaryDirectory(prefix="realloop-decided-") as tmp:
            folder = download_policy(model, info.version, Path(tmp) / "download")
            staged = _staged_policy(folder, Path(tmp))
            result = promote(
                None,
                cell_id,
                params.promote,
                model,
                info.version,
                str(info.run_id),
                staged.folder,
                staged.trained_on.get("dataset_version"),
                decision=decision,
                workspace=workspace,
            )
    except (EdgeError, LookupError, ValueError) as exc:
        raise CommandError(str(exc).splitlines()[0]) from None
    release = result.bundle or {}
    return {
        "cell": cell_id,
        "registered_model": model,
        "model_version": info.version,
        "replaced": (running or {}).get("model_version"),
        "alias": result.alias,
        "channel": channel_uri,
        "bundle_id": release.get("bundle_id"),
        "decision": decision,
        "signed": True,
    }


def _print_decided(p: dict) -> None:
    d = p["decision"]
    stdout.print(
        f"{p['cell']}: {p['registered_model']} version {p['model_version']} published as signed "
        f"release {p['bundle_id']} ({d['kind']}, replacing version {p['replaced']}); alias "
        f"{p['alias']} -> version {p['model_version']}\n{d['kind']} by {d['by']} at {d['at']}: "
        f"{d['reason']}",
        highlight=False,
        soft_wrap=True,
    )


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
            return _deploy(workspace, params, staged, cell_id, reason, force, channel, channel_uri)
    except EdgeError as exc:
        raise CommandError(str(exc)) from None


def _deploy(
    workspace, params, staged, cell_id, reason, force, channel, channel_uri
) -> dict[str, Any]:
    from edge.release import publish_release
    from pipelines.release import named_decision
    from pipelines.release.promote import decision_tags, record_decision
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
    override = named_decision(
        "override", reason or f"first deployment of {cell_id}: no incumbent to trial against"
    ) | {"initial_deploy": True, "forced": force, "replaced": production}
    keys = ensure_keys(workspace, params, channel_uri)
    version, run_id = earlier or _register(
        model, cell_id, staged.folder, decision_tags(cell_id, override)
    )
    record_decision(model, version, run_id, cell_id, override)
    release = publish_release(
        channel_uri,
        keys,
        cell_id,
        staged.files,
        metadata={
            "model_name": model,
            "model_version": int(version),
            "dataset_version": staged.trained_on.get("dataset_version"),
            "mlflow_run_id": run_id,
        },
        decision=override,
        attestation=None,
        timestamp_expiry_s=params.promote.timestamp_expiry_s,
    )
    set_production_alias(model, alias, version)
    return {
        "cell": cell_id,
        "registered_model": model,
        "model_version": version,
        "mlflow_run_id": run_id,
        "alias": alias,
        "channel": channel_uri,
        "bundle_id": release["bundle_id"],
        "policy_sha256": sha256,
        "override": override,
        "signed": True,
        "resumed": earlier is not None,
    }


def ensure_keys(workspace: Path, params, channel_uri: str) -> Path:
    """The workspace's keys folder (`promote.keys`), made on first use, and the channel's
    first signed metadata. Root is written to `<keys>/offline/`: move it off this machine."""
    from edge.rotation import init_keys
    from pipelines.release import keys_location

    keys = keys_location(params.promote.keys, workspace)
    made = init_keys(keys, channel_uri, params.promote.timestamp_expiry_s)
    if made["made"]:
        stderr.print(
            f"made the signing keys in {keys}; the root key is in {made['offline']}: keep it "
            "offline (needed only by `realloop keys rotate`)",
            highlight=False,
            soft_wrap=True,
        )
    return keys


class _Staged:
    """A private copy of the policy: what was loaded is what is registered and published."""

    def __init__(self, folder: Path, trained_on: dict):
        from pipelines.release.promote import bundle_files

        self.folder = folder
        self.files = bundle_files(folder)  # weights, config, and the edge files when present
        self.trained_on = trained_on


def _staged_policy(source: Path, tmp: Path) -> _Staged:
    from pipelines.release.promote import bundle_files
    from pipelines.training import load_policy

    try:
        load_policy(source)  # a broken folder is refused before anything is written
        folder = tmp / "policy"
        folder.mkdir()
        for name, path in bundle_files(source).items():  # policy.onnx, ood.json travel too
            shutil.copyfile(path, folder / name)
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
    """What says the cell already runs a model: the registry alias, the channel's signed
    release (unless it names the version an interrupted deploy left behind)."""
    from edge.tuf_repo import named_release, release_target
    from pipelines.training import production_version

    found = []
    info = production_version(model, alias)
    if info is not None:
        found.append(f"registry alias {alias} -> {model} version {info.version}")
    release = named_release(channel, cell_id)
    if release is None:
        return found
    ours = earlier is not None and (
        release.get("model_name") == model and str(release.get("model_version")) == earlier[0]
    )
    if not ours:
        found.append(
            f"channel {channel.describe(release_target(cell_id))} -> release {release['bundle_id']}"
        )
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
