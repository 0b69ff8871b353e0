"""Serve the ingest and retrain-loop flows as Prefect deployments on their schedules.

`serve(params_path)` registers three deployments with the Prefect server at PREFECT_API_URL
and runs their flow runs from this process (each in a subprocess, in this working directory)
until Ctrl-C or SIGTERM:

    ingest        flows.ingest.ingest_flow              every ingest.schedule_interval_s seconds
    retrain-loop  flows.loop.loop_flow                  cron serve.loop_cron in serve.timezone
    keys-refresh  flows.keys_refresh.keys_refresh_flow  every promote.timestamp_expiry_s / 3
                  (a new signed timestamp: boxes refuse a channel idle past the expiry)

Every run gets parameters={"params_path": <the params path as given>, "workspace": <the working
directory of `serve`>}; paths inside params.yaml are relative to that workspace.

A Prefect server is required: the ephemeral API that `configure_prefect` falls back to runs no
scheduler service, so the schedules would never produce a run. On shutdown Prefect pauses the
two schedules; the next `serve` resumes them.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from flows.console import CommandError, stopped_like_ctrl_c
from flows.prefect_env import api_url
from pipelines.contract.params import Params, load_params

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

INGEST_DEPLOYMENT = "ingest"
LOOP_DEPLOYMENT = "retrain-loop"
REFRESH_DEPLOYMENT = "keys-refresh"
NO_SERVER = (
    "serve needs a Prefect server (the ephemeral API runs no scheduler): start one with "
    "`prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api"
)


def schedules(params: Params) -> dict[str, str]:
    """Deployment name → its schedule, in words."""
    return {
        INGEST_DEPLOYMENT: f"every {params.ingest.schedule_interval_s} s",
        LOOP_DEPLOYMENT: f"cron '{params.serve.loop_cron}' ({params.serve.timezone})",
        REFRESH_DEPLOYMENT: f"every {_refresh_s(params):g} s",
    }


def _refresh_s(params: Params) -> float:
    from flows.keys_refresh import refresh_interval_s

    return refresh_interval_s(params.promote.timestamp_expiry_s)


def build_deployments(
    params_path: Path,
    ingest_source: str | None = None,
    extra: dict[str, dict] | None = None,
) -> list[RunnerDeployment]:
    """The deployments, scheduled as params.yaml says; nothing is registered yet.
    `ingest_source` (a folder or an s3:// prefix) replaces the landing folder for ingest;
    `extra` adds to_deployment arguments by deployment name (`realloop deploy-flows`: the
    work pool's job variables, triggers; its "parameters" are added to the common ones)."""
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron, Interval

    from flows.ingest import ingest_flow
    from flows.keys_refresh import keys_refresh_flow
    from flows.loop import loop_flow

    params = load_params(params_path)
    # The workspace is pinned at serve time: a run must not depend on where its process starts.
    parameters = {"params_path": str(params_path), "workspace": str(Path.cwd())}
    # By module path, so a run finds the flow from any workspace the package is installed for.
    common = {"parameters": parameters, "entrypoint_type": EntrypointType.MODULE_PATH}
    ingest_parameters = {**parameters, **({"source": ingest_source} if ingest_source else {})}
    extra = extra or {}

    def more(name: str, parameters: dict) -> dict:
        added = dict(extra.get(name, {}))
        return added | {"parameters": parameters | added.pop("parameters", {})}

    return [
        ingest_flow.to_deployment(
            INGEST_DEPLOYMENT,
            schedule=Interval(timedelta(seconds=params.ingest.schedule_interval_s)),
            description=f"Ingest what landed: {ingest_source or 'landing folder'} → dataset.",
            entrypoint_type=EntrypointType.MODULE_PATH,
            **more(INGEST_DEPLOYMENT, ingest_parameters),
        ),
        loop_flow.to_deployment(
            LOOP_DEPLOYMENT,
            schedule=Cron(params.serve.loop_cron, timezone=params.serve.timezone),
            description="One cycle of the continual-retraining loop.",
            **common | more(LOOP_DEPLOYMENT, parameters),
        ),
        keys_refresh_flow.to_deployment(
            REFRESH_DEPLOYMENT,
            schedule=Interval(timedelta(seconds=_refresh_s(params))),
            description="Re-sign the release channel's timestamp so boxes keep trusting it.",
            **common | more(REFRESH_DEPLOYMENT, parameters),
        ),
    ]


def serve(params_path: Path, ingest_source: str | None = None) -> None:
    """Serve the deployments until Ctrl-C or SIGTERM; returns normally then."""
    if api_url() is None:
        raise CommandError(NO_SERVER)
    load_params(params_path)  # a bad params file fails here, in one line, before prefect loads
    # Until Prefect's runner installs its own graceful SIGTERM handler, stop like Ctrl-C.
    with stopped_like_ctrl_c():
        try:
            from prefect import serve as prefect_serve

            deployments = build_deployments(params_path, ingest_source)
            prefect_serve(*deployments, print_starting_message=False)
        except KeyboardInterrupt:
            pass
