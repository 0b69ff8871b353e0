"""The loop's wait for trials when it runs from a deployment: suspended, holding no worker.

With a Prefect server and a deployment (`realloop deploy-flows`), a loop run that has
published its trial requests saves the cycle so far in
`<workspace>/.realloop/waiting/<flow run id>.json` and suspends itself
(`suspend_flow_run`): the worker's process exits and nothing runs until the trials are in.
Every ingest run (the `ingest` deployment's schedule) checks the saved requests against the
episodes table; once each is complete or past its deadline it emits realloop.trials.ready
naming the flow run (flows/events.py), and the automation that `deploy-flows` created
resumes it. Prefect reruns a resumed flow from its start: loop_flow finds its saved cycle and
goes straight to the wait (one more poll: ingest, validate, check), so no task before the
wait runs again.

Why a record rather than Prefect's persisted task results: resuming by cached results would
have every task of the cycle persist its result (the fine-tune's, the validation's, mapped
per cell) in a result store and key its cache on the run id; a stage that returned anything
JSON could not hold would break the resume, and the ingest subflow would run again with new
files landed. The record holds exactly what the rest of the cycle reads, in JSON (never
pickle), next to the cycle ledger it ends up in.

The suspension's own timeout is the latest request deadline plus RESUME_GRACE: past its
deadline a request still resumes the run (ingest says "timed out"), which then withdraws it
and ends the cell's cycle "trials incomplete" as the polling wait does. Only if no ingest runs
at all is the run failed by Prefect at the timeout, the request left on the channel; the
record is then ignored (stale) and removed by the next loop that suspends.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from flows.prefect_env import api_url
from pipelines.release import trials

WAITING_DIR = Path(".realloop/waiting")  # in the workspace
MIN_GRACE_S = 300  # the ingest after a deadline must get to say so, however slow it is


def can_suspend() -> bool:
    """True in a flow run that a server can resume: started from a deployment, not a subflow."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = context.flow_run if context else None
    return (
        api_url() is not None
        and run is not None
        and run.deployment_id is not None
        and run.parent_task_run_id is None  # Prefect refuses to suspend a subflow
    )


def grace_s(params) -> float:
    """How long past the last deadline a suspended run still waits for ingest to resume it."""
    return max(MIN_GRACE_S, 3 * params.ingest.schedule_interval_s)


def save(root: Path, flow_run_id: str, requests: dict[str, dict], cycle: dict) -> dict:
    """Write (atomically) what the resumed run needs; returns the record."""
    previous = load(root, flow_run_id) or {}
    record = {
        "flow_run_id": flow_run_id,
        "requests": requests,
        "cycle": cycle,
        "saved_at": previous.get("saved_at") or _iso(datetime.now(UTC)),
        "suspensions": previous.get("suspensions", 0),
    }
    _write(root, record)
    return record


def load(root: Path, flow_run_id: str | None) -> dict | None:
    if not flow_run_id:
        return None
    path = root / WAITING_DIR / f"{flow_run_id}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(f"{path}: unreadable waiting record ({exc}); delete it") from None


def discard(root: Path, flow_run_id: str) -> None:
    (root / WAITING_DIR / f"{flow_run_id}.json").unlink(missing_ok=True)


def records(root: Path, params=None, now: datetime | None = None) -> list[dict]:
    """The waiting records of loop runs that can still be resumed (not past the last
    deadline plus the grace); all of them without `params`."""
    folder = root / WAITING_DIR
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except ValueError:
            continue  # a record being replaced; the next ingest reads it
        if params is None or not _stale(record, params, now or datetime.now(UTC)):
            found.append(record)
    return found


def ready_runs(params, root: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Waiting loop runs whose requests are each complete or past the deadline (flow run id
    → request id → state), and the ids of every complete request, from one scan."""
    waiting = records(root, params)
    requests = {r["request_id"]: r for w in waiting for r in w["requests"].values()}
    if not requests:
        return {}, []
    found = trials.check_requests(root / params.ingest.dataset, requests)
    now = datetime.now(UTC)
    states = {rid: trials.poll_state(r, found[rid]["attempt"], now) for rid, r in requests.items()}
    ready = {}
    for record in waiting:
        mine = {r["request_id"]: states[r["request_id"]] for r in record["requests"].values()}
        if "waiting" not in mine.values():
            ready[record["flow_run_id"]] = mine
    return ready, sorted(rid for rid, state in states.items() if state == "complete")


def settled(params, root: Path, requests: dict[str, dict]) -> bool:
    """Whether no request is still waiting (each complete or past its deadline)."""
    found = trials.check_requests(root / params.ingest.dataset, requests)
    now = datetime.now(UTC)
    return all(
        trials.poll_state(r, found[key]["attempt"], now) != "waiting" for key, r in requests.items()
    )


def suspend(root: Path, record: dict, params) -> None:
    """Suspend this flow run until the automation resumes it; the process exits here."""
    from prefect.flow_runs import suspend_flow_run

    record["suspensions"] += 1
    _write(root, record)
    last = max(trials.parse_time(r["deadline"]) for r in record["requests"].values())
    timeout = (last - datetime.now(UTC)).total_seconds() + grace_s(params)
    # A key per suspension: a run resumed early (by hand) suspends again under a new one.
    suspend_flow_run(timeout=max(1, int(timeout)), key=f"await-trials-{record['suspensions']}")


def drop_stale(root: Path, params) -> list[str]:
    """Remove the records of runs that can no longer be resumed (Prefect failed them at
    their timeout); returns their flow run ids."""
    now, dropped = datetime.now(UTC), []
    for record in records(root):
        if _stale(record, params, now):
            discard(root, record["flow_run_id"])
            dropped.append(record["flow_run_id"])
    return dropped


def _stale(record: dict, params, now: datetime) -> bool:
    deadlines = [trials.parse_time(r["deadline"]) for r in record["requests"].values()]
    return not deadlines or now > max(deadlines) + timedelta(seconds=grace_s(params))


def _write(root: Path, record: dict) -> None:
    folder = root / WAITING_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record['flow_run_id']}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=2, default=str))
    os.replace(partial, path)


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def jsonable(value: Any) -> Any:
    """A value as the record will give it back (paths as strings): what the resumed run
    sees is what a fresh run of the same cycle would have seen, shape for shape."""
    return json.loads(json.dumps(value, default=str))
