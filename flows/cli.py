"""The `realloop` command line. Heavy imports live inside commands, so --help is instant."""

from __future__ import annotations

from pathlib import Path

import typer

from flows import (
    calibrate_cli,
    campaign,
    cell,
    commands,
    demo,
    deploy,
    deployments,
    drift_cli,
    gc_cli,
    keys_cli,
    serve_cli,
    services_cli,
    triage_cli,
    validate_cli,
)
from flows.services import load_services_env

app = typer.Typer(
    help="realloop: real line logs in, gated and promoted models out to the edge box.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _print_version(requested: bool) -> None:
    if requested:
        from importlib.metadata import version

        print(f"realloop {version('realloop')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="print the version"
    ),
) -> None:
    """realloop: real line logs in, gated and promoted models out to the edge box."""
    # Before any command reads PREFECT_API_URL, MLFLOW_TRACKING_URI or the S3 endpoint: the
    # servers `realloop services up` started in this workspace (exported values win).
    load_services_env(Path.cwd())


app.add_typer(cell.app, name="cell")
app.command()(commands.loop)
app.command()(commands.ingest)
app.command()(commands.datasets)
app.command()(commands.train)
app.command()(commands.lineage)
app.command("serve")(serve_cli.serve_command)
app.command("deploy-flows")(deployments.deploy_flows_command)
app.command("drift")(drift_cli.drift_command)
app.command("triage")(triage_cli.triage_command)
app.command("validate")(validate_cli.validate_command)
app.command("admit")(validate_cli.admit_command)
app.command("calibrate")(calibrate_cli.calibrate_command)
app.command("deploy")(deploy.deploy_command)
app.command("promote")(deploy.promote_command)
app.command("rollback")(deploy.rollback_command)
app.add_typer(keys_cli.app, name="keys")
app.command("demo")(demo.demo_command)
app.command("campaign")(campaign.campaign_command)
app.command("gc")(gc_cli.gc_command)
app.add_typer(services_cli.app, name="services")

if __name__ == "__main__":
    app()
