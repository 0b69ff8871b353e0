"""What an ingest run tells Prefect's automations (the events are described in
flows/events.py): that it ran, which cells passed the edge-case threshold for a retrain, and
which suspended loop runs can be resumed because their trial requests are settled."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from flows import events
from flows.prefect_env import api_url


def notify(params, root: Path, result: Mapping[str, Any]) -> dict:
    """Emit what an ingest run tells the automations; returns the ingest event's payload
    ({} when nothing listens). Never raises: the dataset version stands whatever happens."""
    try:
        return _after_ingest(params, root, result) if events.listening() else {}
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else repr(exc)
        get_run_logger().warning("ingest events not sent: %s", reason)
        return {}


def _after_ingest(params, root: Path, result: Mapping[str, Any]) -> dict:
    from prefect.context import FlowRunContext

    from flows import waiting

    context = FlowRunContext.get()
    # An ingest inside a loop run: that cycle trains on these episodes, it starts no other.
    in_loop = bool(context and context.flow_run and context.flow_run.parent_task_run_id)
    dataset = root / params.ingest.dataset
    new = new_edge_cases(dataset, [row["sha256"] for row in result["ingest"]["ingested"]])
    # Only a server runs automations; the registry lookup is not worth it for anyone else.
    judged = new and api_url() is not None and not in_loop
    since = {c: edge_cases_since_production(params, root, c) for c in new} if judged else {}
    ready, complete = waiting.ready_runs(params, root)
    payload = events.ingest_payload(result, new, since, complete)
    events.emit(events.INGEST_COMPLETED, f"realloop.dataset.{result['dataset_version']}", payload)
    if not in_loop and not waiting.records(root, params):  # no second cycle while one waits
        for cell in events.over_threshold(new, since, params.drift.min_new_edge_cases):
            events.emit(
                events.EDGE_CASES_THRESHOLD,
                f"realloop.cell.{cell}",
                {
                    "cell": cell,
                    "edge_cases_since_production": since[cell],
                    "min_new_edge_cases": params.drift.min_new_edge_cases,
                    "dataset_version": result["dataset_version"],
                },
            )
    for flow_run_id, states in ready.items():
        events.emit(**events.trials_ready_event(flow_run_id, states))
    return payload


def new_edge_cases(dataset: Path, batches: list[str]) -> dict[str, int]:
    """cell id → edge-case episodes in these batches (two columns of each, no steps)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    counts: dict[str, int] = {}
    for sha in batches:
        path = dataset / "episodes" / f"{sha}.parquet"
        if not path.is_file():
            continue
        table = pq.read_table(path, columns=["cell_id", "edge_case"])
        edge = table.filter(pc.field("edge_case"))
        for cell in edge.column("cell_id").to_pylist():
            counts[cell] = counts.get(cell, 0) + 1
    return dict(sorted(counts.items()))


def edge_cases_since_production(params, root: Path, cell_id: str) -> int | None:
    """The cell's edge-case episodes in batches its production model was not trained on
    (the drift check's baseline); None when that is not known (no production model yet, no
    registry reachable): the threshold event is then left to `realloop drift`."""
    from flows.drift_cli import production_record
    from pipelines.quality.drift.report import resolve_baseline

    dataset = root / params.ingest.dataset
    try:
        production = production_record(params, root, cell_id)
        if production is None:
            return None
        known = resolve_baseline(root, dataset, production).known
    except Exception as exc:  # the registry down must not fail ingest
        get_run_logger().warning("edge cases since production of %s unknown: %s", cell_id, exc)
        return None
    held = sorted(p.stem for p in (dataset / "episodes").glob("*.parquet"))
    return new_edge_cases(dataset, [b for b in held if b not in known]).get(cell_id, 0)
