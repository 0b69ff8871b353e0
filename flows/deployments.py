"""`realloop deploy-flows`: the ingest and retrain-loop deployments on a work pool, started by
their schedules and by events, and the automation that resumes a loop when its trials are in.

    ingest        flows.ingest.ingest_flow  every ingest.schedule_interval_s seconds
    retrain-loop  flows.loop.loop_flow      cron serve.loop_cron (the floor), and at once on
                                            realloop.drift.detected or
                                            realloop.edge-cases.threshold (flows/events.py);
                                            one cycle at a time (concurrency limit 1)
    keys-refresh  flows.keys_refresh.keys_refresh_flow  every promote.timestamp_expiry_s / 3: a
                  new signed timestamp, so boxes keep trusting a channel with no new release
    automation    "realloop: resume a loop when its trials are in": on realloop.trials.ready,
                  ResumeFlowRun of the flow run the event names

The deployments are the ones `realloop serve` runs (flows/serve.py builds both), registered
by module path, so a process worker of the pool runs them from the installed package, in this
workspace (job variable working_dir); the loop's run suspends while trials run
(parameter suspend_for_trials). Deploying again updates all three in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flows import events
from flows.console import CommandError, emit, fails_cleanly, stdout
from flows.prefect_env import api_url
from flows.recovery import recovery_automations
from flows.serve import (
    INGEST_DEPLOYMENT,
    LOOP_DEPLOYMENT,
    REFRESH_DEPLOYMENT,
    build_deployments,
    schedules,
)
from flows.services import WORK_POOL  # `realloop services up` creates it, with its workers

RESUME_AUTOMATION = "realloop: resume a loop when its trials are in"
NO_SERVER = (
    "deploy-flows needs a Prefect server: run `realloop services up`, or start one with "
    "`prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api"
)

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


def loop_triggers(params) -> list:
    """What starts a retrain besides the cron: the drift check, and edge cases piling up."""
    from prefect.events import DeploymentEventTrigger

    return [
        DeploymentEventTrigger(
            name="retrain-loop: drift detected",
            description="`realloop drift` says retrain",
            expect={events.DRIFT_DETECTED},
            match={"prefect.resource.id": "realloop.cell.*"},
        ),
        DeploymentEventTrigger(
            name="retrain-loop: new edge cases",
            description=(
                f"a cell has drift.min_new_edge_cases ({params.drift.min_new_edge_cases}) "
                "new edge-case episodes since its production model's training data"
            ),
            expect={events.EDGE_CASES_THRESHOLD},
            match={"prefect.resource.id": "realloop.cell.*"},
        ),
    ]


def resume_automation():
    """Resume the flow run a realloop.trials.ready event names (its first prefect.flow-run
    resource, which is how ResumeFlowRun picks its target)."""
    from prefect.automations import Automation
    from prefect.events.actions import ResumeFlowRun
    from prefect.events.schemas.automations import EventTrigger, Posture

    return Automation(
        name=RESUME_AUTOMATION,
        description="ingest found every trial request of a suspended loop complete or expired",
        trigger=EventTrigger(
            expect={events.TRIALS_READY},
            match={"prefect.resource.id": "realloop.trials.*"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[ResumeFlowRun()],
    )


def deploy_flows(
    params_path: Path, ingest_source: str | None = None, pool: str = WORK_POOL
) -> dict[str, Any]:
    """Register both deployments on `pool` and the resume automation; returns what was
    registered, as the Prefect API reads it back."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.exceptions import ObjectNotFound

    from pipelines.contract.params import load_params

    if api_url() is None:
        raise CommandError(NO_SERVER)
    params = load_params(params_path)  # a bad params file fails here, in one line
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise CommandError(
                f"work pool {pool!r} not found on {api_url()}: run `realloop services up`, "
                f"or `prefect work-pool create {pool} --type process` and start a worker"
            ) from None
    on_pool = {"job_variables": {"working_dir": str(Path.cwd())}}
    # One ingest at a time: a tick that finds the last one still running is dropped (the
    # next one ingests what landed). One cycle at a time: a started one queues, because a
    # resumed loop run must get its turn, never be cancelled.
    skip = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
    extra = {
        INGEST_DEPLOYMENT: on_pool | {"concurrency_limit": skip},
        REFRESH_DEPLOYMENT: on_pool | {"concurrency_limit": skip},  # the next tick re-signs
        LOOP_DEPLOYMENT: on_pool
        | {
            "triggers": loop_triggers(params),
            "parameters": {"suspend_for_trials": True},
            "concurrency_limit": ConcurrencyLimitConfig(limit=1),
        },
    }
    ids = [
        d.apply(work_pool_name=pool) for d in build_deployments(params_path, ingest_source, extra)
    ]
    automation = _upsert(resume_automation())
    # A run whose worker died is crashed and run again (flows/recovery.py).
    recovery = [_upsert(a) for a in recovery_automations([str(i) for i in ids])]
    with get_client(sync_client=True) as client:
        deployed = [_describe(client, client.read_deployment(i)) for i in ids]
    return {
        "server": api_url(),
        "work_pool": pool,
        "workspace": str(Path.cwd()),
        "schedules": schedules(params),
        "deployments": deployed,
        "automations": [_automation_dict(a) for a in (automation, *recovery)],
    }


def _upsert(automation):
    """Create the automation, or update the one of that name (deploying again)."""
    from prefect.automations import Automation

    try:
        existing = Automation.read(name=automation.name)
    except ValueError:  # not found
        return automation.create()
    automation.id = existing.id
    automation.update()
    return automation


def _describe(client, deployment) -> dict[str, Any]:
    owned = client.read_resource_related_automations(f"prefect.deployment.{deployment.id}")
    flow = client.read_flow(deployment.flow_id)
    return {
        "name": f"{flow.name}/{deployment.name}",
        "id": str(deployment.id),
        "entrypoint": deployment.entrypoint,
        "work_pool": deployment.work_pool_name,
        "job_variables": deployment.job_variables,
        "parameters": deployment.parameters,
        "concurrency": _concurrency(deployment),
        "schedules": [_schedule(s.schedule) for s in deployment.schedules],
        "triggers": [_automation_dict(a) for a in owned],
    }


def _concurrency(deployment) -> dict[str, Any] | None:
    limit = deployment.global_concurrency_limit
    if limit is None:
        return None
    options = deployment.concurrency_options
    strategy = options.collision_strategy.value if options else "ENQUEUE"
    return {"limit": limit.limit, "collision_strategy": strategy}


def _schedule(schedule) -> dict[str, Any]:
    if getattr(schedule, "cron", None):
        return {"cron": schedule.cron, "timezone": schedule.timezone}
    if getattr(schedule, "interval", None):
        return {"interval_s": schedule.interval.total_seconds()}
    return {"schedule": str(schedule)}


def _automation_dict(automation) -> dict[str, Any]:
    trigger = automation.trigger
    return {
        "name": automation.name,
        "enabled": automation.enabled,
        "expect": sorted(getattr(trigger, "expect", []) or []),
        "match": trigger.match.model_dump() if hasattr(trigger, "match") else {},
        "actions": [action.type for action in automation.actions],
    }


@fails_cleanly
def deploy_flows_command(
    params_path: ParamsOpt = Path("params.yaml"),
    ingest_source: Annotated[
        str | None,
        typer.Option(help="what the ingest deployment reads: a folder or s3://bucket/prefix"),
    ] = None,
    pool: Annotated[str, typer.Option(help="the Prefect work pool")] = WORK_POOL,
    as_json: JsonOpt = False,
) -> None:
    """Register ingest and retrain-loop on the work pool, with their schedules and event
    triggers, and the automation that resumes a loop when its trials are in. Needs a server
    at PREFECT_API_URL; process workers of the pool run the flows in this workspace."""
    from flows.prefect_env import configure_prefect

    if api_url() is None:
        raise CommandError(NO_SERVER)
    configure_prefect(Path.cwd())
    emit(deploy_flows(params_path, ingest_source, pool), as_json, _print)


def _print(result: dict) -> None:
    stdout.print(f"on work pool {result['work_pool']!r} of {result['server']}:", highlight=False)
    for deployment in result["deployments"]:
        when = "; ".join(
            f"cron {s['cron']} ({s['timezone']})" if "cron" in s else f"every {s['interval_s']:g} s"
            for s in deployment["schedules"]
        )
        stdout.print(f"  {deployment['name']}: {when}", highlight=False)
        for trigger in deployment["triggers"]:
            stdout.print(f"    on {', '.join(trigger['expect'])}", highlight=False)
    for automation in result["automations"]:
        stdout.print(f"  automation {automation['name']!r}", highlight=False)
    stdout.print(
        f"workers: `prefect worker start --pool {result['work_pool']}` in {result['workspace']}",
        highlight=False,
        soft_wrap=True,
    )
