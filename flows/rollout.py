"""Staged rollout over the fleet (`fleet.canary`): the model a fleet cycle promotes goes to the
canary cell first, and to the other cells of `fleet.cells` only after the canary's health
window passed (pipelines/release/rollout.py):

    canary promoted → every `trials.poll_s`: ingest what landed, judge the canary's window
      → passed: the same version promoted to each other cell (decision kind "rollout")
      → failed: the rollout stops, the canary rolled back (decision kind "rollback")
      → no whole window by `fleet.health_timeout_s`: the rollout stops, the canary keeps it

A fleet cycle with a canary trains and trials on the canary only (`cycle_cells`); a cycle for
one named cell (`realloop loop --cell`) is a cell's own and rolls nothing out. The loop hands
in its ingest poll and its promote task, so the wait ingests and validates as the trial wait
does, and a follower is promoted exactly as the canary was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from prefect import task, unmapped
from prefect.cache_policies import NO_CACHE

from flows import artifacts, cycle
from flows.console import progress_bar
from pipelines.contract.params import Params
from pipelines.release import rollout as health

THIN = {"cache_policy": NO_CACHE}
BY = "realloop"  # the loop decides a rollout or a rollback on the window's figures
TIMED_OUT = "timed out"


def cycle_cells(params: Params, cell: str | None) -> list[str]:
    """The cells a cycle trains and trials: with a canary, a fleet cycle serves it alone."""
    if cell is None and params.fleet.canary is not None:
        return [params.fleet.canary]
    return cycle.fleet_cells(params, cell)


def followers(params: Params, cell: str | None) -> list[str]:
    """The cells that get the canary's model after its window passed (none without one)."""
    if cell is not None or params.fleet.canary is None:
        return []
    return [c for c in params.fleet.cells if c != params.fleet.canary]


def stage(
    params: Params,
    root: Path,
    cell: str | None,
    steps: dict[str, dict],
    poll: Callable[[], list],
    promote,
    progress: bool = False,
) -> dict | None:
    """The rollout stage of a cycle (`cell`: the one asked for, None for the fleet): None when
    the cycle rolls nothing out; otherwise its record, each cell's step added to `steps` under
    "rollout" (a follower gets a branch of its own)."""
    targets = followers(params, cell)
    if not targets:
        return None
    canary = params.fleet.canary
    mine = steps[canary]
    if not (mine.get("promotion") or {}).get("promoted"):
        why = f"rollout not started: canary {canary} was not promoted this cycle"
        record = {"canary": canary, "state": "not started", "window": None}
        record["cells"] = {c: _step(cycle.NOT_ROLLED_OUT, why) for c in targets}
    else:
        record = roll_out(params, root, mine, targets, poll, promote, progress=progress)
    for cell_id, step in record["cells"].items():
        steps.setdefault(cell_id, {})["rollout"] = step
        if cell_id in targets:
            steps[cell_id]["edge"] = cycle.edge_channel_status(params, cell_id, root)
    steps[canary]["edge"] = cycle.edge_channel_status(params, canary, root)
    return record


def roll_out(
    params: Params,
    root: Path,
    steps: dict,
    targets: list[str],
    poll: Callable[[], object],
    promote,
    roll_back=None,
    progress: bool = False,
) -> dict:
    """After the canary's promotion (`steps`: its branch of the cycle, plan to promotion):
    wait for its health window, then promote the version to `targets` with the loop's
    `promote` task, or roll the canary back. The rollout's record; `cells` holds each
    cell's step for the summary (outcome, reason, model version, promotion)."""
    canary, trained, gate_record = steps["plan"]["cell"], steps["trained"], steps["gate"]
    bundle_id = steps["promotion"]["bundle"]["bundle_id"]
    window = await_health(
        params, root, canary, bundle_id, health.trial_floor(gate_record), poll, progress
    )
    record = {
        "canary": canary,
        "model_version": trained["model_version"],
        "bundle_id": bundle_id,
        "window": window,
        "cells": {},
    }
    reason = f"canary {canary}: {window['reason']}"
    if window["state"] == health.PASSED:
        decision = new_decision("rollout", reason)
        futures = promote.map(
            unmapped(params),
            unmapped(root),
            targets,
            unmapped(trained),
            unmapped(gate_record),
            decision=unmapped(decision),
        )
        record["cells"] = _rolled_out(targets, futures, trained["model_version"], reason)
    else:
        stopped = f"rollout stopped: {reason}"
        record["cells"] = {c: _step(cycle.NOT_ROLLED_OUT, stopped) for c in targets}
    if window["state"] == health.FAILED:
        decision = new_decision("rollback", reason)
        to = steps["plan"]["model_version"]
        state = (roll_back or roll_back_cell)(params, root, canary, to, decision, return_state=True)
        record["rollback"] = _settled(state) | {"to_version": to, "decision": decision}
        record["cells"][canary] = _step(cycle.ROLLED_BACK, _rollback_reason(record, reason))
    record["state"] = _state(window, record)
    artifacts.log(f"rollout of version {trained['model_version']}: {record['state']}; {reason}")
    artifacts.table("rollout", rollout_rows(record), f"rollout from canary {canary}")
    return record


def await_health(
    params: Params,
    root: Path,
    canary: str,
    bundle_id: str,
    floor: float,
    poll: Callable[[], object],
    progress: bool = False,
) -> dict:
    """Every `trials.poll_s`: `poll` (ingest what landed), then judge the canary's window;
    until it passed or failed, or `fleet.health_timeout_s` passed (then "timed out")."""
    wanted, most = params.edge.health_episodes, params.edge.health_max_episodes
    deadline = time.monotonic() + params.fleet.health_timeout_s
    artifacts.log(
        f"{canary}: waiting for {wanted}-{most} production episodes of bundle {bundle_id} "
        f"(health window; success floor {floor:.3f}, no safety stop)"
    )
    with progress_bar(progress) as update:
        while True:
            time.sleep(max(0.0, min(params.trials.poll_s, deadline - time.monotonic())))
            poll()
            window = check_health(params, root, canary, bundle_id, floor)
            update(f"health {canary}", window["episodes"], most)
            if window["state"] != health.OPEN:
                return window
            if time.monotonic() >= deadline:
                late = f"not whole by the deadline ({params.fleet.health_timeout_s:.0f} s)"
                return window | {"state": TIMED_OUT, "reason": f"{window['reason']}; {late}"}


@task(name="check-health", task_run_name="check health {canary}", **THIN)
def check_health(params: Params, workspace: Path, canary: str, bundle_id: str, floor: float):
    dataset = workspace / params.ingest.dataset
    edge = params.edge
    return health.check_health(
        dataset, canary, bundle_id, edge.health_episodes, floor, edge.health_max_episodes
    ).as_dict()


@task(
    name="roll-back",
    task_run_name="roll back {cell_id}",
    retries=2,
    retry_delay_seconds=5,
    **THIN,
)
def roll_back_cell(
    params: Params, workspace: Path, cell_id: str, to_version: str, decision: dict
) -> dict:
    """The cell's channel path back to registered `to_version`, as a signed release whose
    decision is the rollback (the one decision a box takes a lower version from); the same
    path as `realloop rollback`."""
    from flows.deploy import decided_release

    return decided_release(workspace, params, cell_id, str(to_version), decision)


def new_decision(kind: str, reason: str) -> dict:
    at = datetime.now(UTC).isoformat(timespec="seconds")
    return {"kind": kind, "by": BY, "at": at, "reason": reason}


def rollout_rows(record: dict) -> list[dict]:
    """The `rollout` artifact: the canary's window, then each cell's result."""
    window = record["window"]
    rows = [
        {
            "cell": record["canary"],
            "role": "canary",
            "episodes": f"{window['episodes']}/{window['wanted']}",
            "successes": window["successes"],
            "safety_stops": window["safety_stops"],
            "floor": round(window["floor"], 3),
            "result": window["state"],
        }
    ]
    for cell_id, step in record["cells"].items():
        if cell_id != record["canary"]:
            rows.append({"cell": cell_id, "role": "follower", "result": step["outcome"]})
    rows[0]["result"] = record["cells"].get(record["canary"], {}).get("outcome", window["state"])
    return rows


def _rolled_out(targets: list[str], futures, version: str, reason: str) -> dict[str, dict]:
    cells = {}
    for cell_id, future in zip(targets, futures, strict=True):
        future.wait()
        state = _settled(future.state)
        if state.get("error"):
            cells[cell_id] = _step(cycle.FAILED, f"rollout: {state['error']}")
        else:
            promotion = state["result"]
            cells[cell_id] = _step(cycle.ROLLED_OUT, reason, version, promotion)
    return cells


def _step(outcome: str, reason: str, version: str | None = None, promotion=None) -> dict:
    return {"outcome": outcome, "reason": reason, "model_version": version, "promotion": promotion}


def _settled(state) -> dict:
    """A task's result, or its one-line error."""
    if state.is_completed():
        return {"result": state.result(), "error": None}
    error = state.result(raise_on_failure=False)
    return {"result": None, "error": str(error).splitlines()[0] if error else str(state)}


def _rollback_reason(record: dict, reason: str) -> str:
    rollback = record["rollback"]
    if rollback["error"]:
        return f"{reason}; rollback to version {rollback['to_version']} failed: {rollback['error']}"
    return f"{reason}; rolled back to version {rollback['to_version']}"


def _state(window: dict, record: dict) -> str:
    if window["state"] == health.PASSED:
        failed = [c for c, s in record["cells"].items() if s["outcome"] == cycle.FAILED]
        return f"rolled out, failed on {', '.join(failed)}" if failed else "rolled out"
    if window["state"] == health.FAILED:
        failed = record["rollback"]["error"]
        return "stopped, canary rollback failed" if failed else "stopped, canary rolled back"
    return "stopped, canary keeps the version (health window not whole)"
