"""`realloop serve`: run the ingest and retrain-loop schedules against a Prefect server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.console import CommandError, fails_cleanly

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]


@fails_cleanly
def serve_command(
    params_path: ParamsOpt = Path("params.yaml"),
    ingest_source: Annotated[
        str | None,
        typer.Option(help="what the ingest schedule reads: a folder or s3://bucket/prefix"),
    ] = None,
) -> None:
    """Serve ingest (every ingest.schedule_interval_s) and retrain-loop (serve.loop_cron)
    as Prefect deployments until Ctrl-C; needs a server at PREFECT_API_URL."""
    from flows.prefect_env import api_url, configure_prefect
    from flows.serve import NO_SERVER, schedules, serve
    from pipelines.contract.params import load_params

    server = api_url()
    if server is None:
        raise CommandError(NO_SERVER)
    configure_prefect(Path.cwd())
    served = ", ".join(
        f"{name} {when}" for name, when in schedules(load_params(params_path)).items()
    )
    ui = os.environ.get("PREFECT_UI_URL") or server.rstrip("/").removesuffix("/api")
    print(f"serving {served} via {server}; UI {ui}; Ctrl-C stops", flush=True)
    serve(params_path, ingest_source)
