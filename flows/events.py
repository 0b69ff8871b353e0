"""The Prefect events realloop emits, which deployments and automations react to.

    realloop.ingest.completed      every ingest run that reached a dataset version
        resource  realloop.dataset.<version>
        payload   new_files, episodes, new_edge_cases (this run), edge_cases_since_production
                  (per cell, when a server listens), complete_requests (trial request ids
                  whose episodes are now complete)
    realloop.edge-cases.threshold  an ingest brought new edge-case episodes and a cell has at
                                   least drift.min_new_edge_cases since its production
                                   model's training data: the retrain-loop deployment starts
        resource  realloop.cell.<cell id>
    realloop.drift.detected        `realloop drift` says retrain: the retrain-loop deployment
                                   starts
        resource  realloop.cell.<cell id>
    realloop.trials.ready          every trial request a suspended loop waits for is complete
                                   or past its deadline: the automation created by
                                   `realloop deploy-flows` resumes that flow run
        resource  realloop.trials.<flow run id>
        related   prefect.flow-run.<flow run id> (role awaiting-trials): the first flow run
                  of the event, which is the one Prefect's ResumeFlowRun action resumes

Emitting never fails a run and never starts a server: without PREFECT_API_URL an event is
sent only from inside a flow run (the ephemeral API is up then and keeps it); a command run
outside a flow, such as `realloop drift`, sends one only to a server at PREFECT_API_URL that
answers its health check (else one warning line, and nothing sent). Events carry counts and
ids, never data (Prefect caps an event at 1.5 MB).
"""

from __future__ import annotations

import functools
import logging
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from flows.prefect_env import api_url

INGEST_COMPLETED = "realloop.ingest.completed"
EDGE_CASES_THRESHOLD = "realloop.edge-cases.threshold"
DRIFT_DETECTED = "realloop.drift.detected"
TRIALS_READY = "realloop.trials.ready"
AWAITING_ROLE = "awaiting-trials"

log = logging.getLogger(__name__)


def listening() -> bool:
    """Whether an event would reach a server: the ephemeral API or the server of the flow
    run this code runs in, or else a server at PREFECT_API_URL that answers now (Prefect's
    events client would otherwise retry for seconds and print its failure at exit)."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is not None:
        return True
    url = api_url()
    return url is not None and _answers(url)


@functools.cache
def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=2) as response:
            return response.status == 200
    except (OSError, ValueError):
        log.warning("Prefect server %s not reachable: events not sent", url)
        return False


def emit(
    event: str,
    resource_id: str,
    payload: Mapping[str, Any] | None = None,
    related: Iterable[Mapping[str, str]] = (),
) -> bool:
    """Send one event; True if it was handed to Prefect's events worker. A failure is
    logged as a warning: an event is a hint to automations, never the record of truth."""
    if not listening():
        return False
    try:
        from prefect.events import emit_event

        sent = emit_event(
            event,
            resource={"prefect.resource.id": resource_id},
            related=[dict(r) for r in related] or None,
            payload=dict(payload or {}),
        )
    except Exception as exc:  # a hint lost is not a run failed
        log.warning("could not emit %s: %s", event, str(exc).splitlines()[0] if str(exc) else exc)
        return False
    return sent is not None


# --- what the events say ---------------------------------------------------------------------


def ingest_payload(
    result: Mapping[str, Any],
    new_edge_cases: Mapping[str, int],
    since_production: Mapping[str, int | None],
    complete_requests: list[str],
) -> dict[str, Any]:
    """realloop.ingest.completed's payload, from ingest_flow's result."""
    report = result["ingest"]
    return {
        "dataset_version": result["dataset_version"],
        "new_version": bool(result["dataset"].get("new")),
        "source": result["source"],
        "new_files": report["files_ingested"],
        "episodes": report["episodes_ingested"],
        "quarantined": report.get("files_quarantined", 0),
        "new_edge_cases": dict(new_edge_cases),
        "edge_cases_since_production": dict(since_production),
        "complete_requests": list(complete_requests),
    }


def over_threshold(
    new_edge_cases: Mapping[str, int], since_production: Mapping[str, int | None], minimum: int
) -> list[str]:
    """Cells whose edge cases since production reached `minimum` with this ingest: only cells
    this run brought new ones for, so the event fires once per crossing batch, not on every
    ingest after it. A threshold of 0 turns the condition off, as in the drift check."""
    if minimum <= 0:
        return []
    return sorted(
        cell
        for cell, new in new_edge_cases.items()
        if new > 0 and (since_production.get(cell) or 0) >= minimum
    )


def trials_ready_event(flow_run_id: str, states: Mapping[str, str]) -> dict[str, Any]:
    """realloop.trials.ready for one waiting loop run: `states` is request id → complete or
    timed out. The flow run is the event's first related resource, so ResumeFlowRun (which
    resumes the first `prefect.flow-run.*` resource of the triggering event) picks it."""
    return {
        "event": TRIALS_READY,
        "resource_id": f"realloop.trials.{flow_run_id}",
        "payload": {"flow_run_id": flow_run_id, "requests": dict(states)},
        "related": [
            {
                "prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                "prefect.resource.role": AWAITING_ROLE,
            }
        ],
    }
