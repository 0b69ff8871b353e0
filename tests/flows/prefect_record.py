"""What flow runs left in a Prefect API, read back through its client: artifacts and log
messages. In this process (the API it is configured for), or for a workspace whose runs were
made by another process: `python -m tests.flows.prefect_record <workspace>` prints it as JSON
(a process of its own, so that its ephemeral API is the workspace's)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from uuid import UUID

PAGE = 200


def read_record(flow_run_ids: list[str] | None = None) -> dict:
    """{"runs": id → flow name, "artifacts": [...], "logs": [messages at INFO or above]};
    only those of `flow_run_ids` when given (a flow run's task runs log under it too)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
        LogFilterLevel,
    )

    ids = None if flow_run_ids is None else [UUID(i) for i in flow_run_ids]
    with get_client(sync_client=True) as client:
        runs = _paged(
            client.read_flow_runs,
            flow_run_filter=None if ids is None else FlowRunFilter(id=FlowRunFilterId(any_=ids)),
        )
        names = {f.id: f.name for f in client.read_flows()}
        artifacts = _paged(
            client.read_artifacts,
            artifact_filter=ArtifactFilter(
                flow_run_id=None if ids is None else ArtifactFilterFlowRunId(any_=ids)
            ),
        )
        logs = _paged(
            client.read_logs,
            log_filter=LogFilter(
                level=LogFilterLevel(ge_=20),
                flow_run_id=None if ids is None else LogFilterFlowRunId(any_=ids),
            ),
        )
    return {
        "runs": {str(r.id): names.get(r.flow_id) for r in runs},
        "artifacts": [
            {
                "key": a.key,
                "type": a.type,
                "data": a.data,
                "description": a.description,
                "flow_run_id": str(a.flow_run_id),
                "task_run_id": None if a.task_run_id is None else str(a.task_run_id),
            }
            for a in artifacts
        ],
        "logs": [entry.message for entry in logs],
    }


def _paged(read, **filters) -> list:
    """Every row, not only the API's default limit (a loop leaves hundreds of logs)."""
    found: list = []
    while len(page := read(**filters, limit=PAGE, offset=len(found))) == PAGE:
        found += page
    return found + page


def wait_for_log(flow_run_id: str, text: str, timeout_s: float = 30.0) -> dict:
    """The run's record once a log message containing `text` reached the API (logs are
    sent in batches, in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_record([flow_run_id])
        if any(text in m for m in record["logs"]) or time.monotonic() > deadline:
            return record
        time.sleep(0.5)


if __name__ == "__main__":
    from flows.prefect_env import configure_prefect

    configure_prefect(Path(sys.argv[1]))
    print(json.dumps(read_record(), default=str))
