"""The retraining loop: one cycle for one cell, or for every cell of `fleet.cells`.

    ingest what the cells uploaded (all cells, once) → validate
      → per cell: plan (its production model, the bundle its channel names)
                  → candidates (loop.candidates: the production model fine-tuned, the policy
                    pretrained in the sim calibrated from the cell's shifts, that one
                    fine-tuned) → the pre-screen picks one (flows/candidates.py)
                  → upload it → request trials (at once: the cell trials it while the
                    loop builds the next cell's candidates)
      → await the trials of every cell at once (subflow `await-trials`; a run of the
        work-pool deployment first suspends until ingest sees them in, flows/waiting.py)
      → per cell: gate on the request's complete attempt → (a person's sign-off, with
                  promote.require_approval: flows/approval.py) → promote (channel and alias)
      → with fleet.canary: the canary's health window, then the other cells (flows/rollout.py)

The loop never runs a cell: it reaches cells only through the edge channel (candidates and
trial requests out) and hears from them only through the landing zone (docs/operations.md).
Each per-cell stage is one task per cell still in the cycle (mapped, except the candidates:
one cell at a time); a cell whose task fails ends "failed" with its one-line reason, and the
other cells carry on. Tasks are thin:
each calls one stage function from pipelines/ and returns plain values for the summary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Failed

from flows import approval, artifacts, candidates, cycle, ledger, loop_lock, rollout, waiting
from flows.console import progress_bar
from flows.ingest import ingest_flow
from pipelines.contract.params import Params, load_params
from pipelines.ingest.disk import DiskFullError
from pipelines.release import trials

# Channel writes (S3 or a mount) may fail transiently; each of these tasks is idempotent.
CHANNEL_IO = {"retries": 2, "retry_delay_seconds": 5, "cache_policy": NO_CACHE}
THIN = {"cache_policy": NO_CACHE}  # stage results are never reused across runs


@task(name="validate", **THIN)
def validate(params: Params, workspace: Path, sources: list[str]) -> dict:
    """The suites over each batch without a stored result, admissions honoured; results and
    Data Docs written for the dataset version `<dataset>.dvc` records (`data_docs`)."""
    from pipelines.ingest import CAPTURES_DIR
    from pipelines.quality import validate_dataset

    dataset = workspace / params.ingest.dataset
    report = validate_dataset(
        dataset,
        params.cell,
        params.validate,
        batches=sources,
        captures=workspace / params.ingest.landing / CAPTURES_DIR,
    )
    result = report.as_dict()
    artifacts.log(artifacts.validate_sentence(result))
    docs = artifacts.data_docs_link(result)
    artifacts.link("data-docs", docs, f"Data Docs of dataset {result['dataset_version']}")
    return result | {"passed_batches": report.passed_batches}


@task(name="plan-cell", task_run_name="plan {cell_id}", **THIN)
def plan_cell(params: Params, workspace: Path, cell_id: str, batches: list[str]) -> dict:
    plan = cycle.plan_cell(params, workspace, cell_id, batches)
    artifacts.log(artifacts.plan_sentence(plan))
    return plan


@task(name="upload-candidate", task_run_name="upload candidate {cell_id}", **CHANNEL_IO)
def upload_candidate(params: Params, workspace: Path, cell_id: str, trained: dict) -> dict:
    """The candidate's bundle on the cell's channel path, for trials; the cell's signed release
    does not move."""
    folder = Path(trained["policy_folder"])
    channel = _channel(params, workspace)
    uploaded = trials.upload_candidate(channel, cell_id, folder, trained, workspace=workspace)
    artifacts.log(f"{cell_id}: candidate bundle {uploaded['bundle_id']} uploaded to {channel}")
    return uploaded


@task(name="request-trials", task_run_name="request trials {cell_id}", **CHANNEL_IO)
def request_trials(params: Params, workspace: Path, cell_id: str, request: dict) -> dict:
    published = trials.publish_trial_request(
        _channel(params, workspace), request, _signing(params, workspace)
    )
    artifacts.log(artifacts.request_sentence(cell_id, request))
    return published


@task(name="check-trials", **THIN)
def check_trials(params: Params, workspace: Path, requests: dict[str, dict]) -> dict:
    return trials.check_requests(workspace / params.ingest.dataset, requests)


@task(name="withdraw-trials", task_run_name="withdraw trials {cell_id}", **CHANNEL_IO)
def withdraw_trials(
    params: Params, workspace: Path, cell_id: str, request: dict, reason: str
) -> bool:
    withdrawn = trials.withdraw_trial_request(
        _channel(params, workspace), request, reason, _signing(params, workspace)
    )
    # The reason (the deadline, the best attempt) was logged when the wait ended.
    artifacts.log(f"{cell_id}: trial request {request['request_id']} withdrawn from the channel")
    return withdrawn


# Retried once: recording the verdict is idempotent, and the registry's SQLite file may be
# busy with another cell's write.
@task(name="gate", task_run_name="gate {cell_id}", retries=1, retry_delay_seconds=2, **THIN)
def gate(
    params: Params,
    workspace: Path,
    cell_id: str,
    trained: dict,
    request: dict,
    attempt: trials.Attempt,
) -> dict:
    """Judge the complete attempt's episodes, arm against arm; keep the record with the
    candidate's model version, and sign it as the gate's attestation (the record's
    `attestation`: the only thing promote believes)."""
    from pipelines.release import attest_gate, keys_location
    from pipelines.training import record_gate

    dataset = workspace / params.ingest.dataset
    record = trials.judge_attempt(dataset, request, attempt, params.gate)
    model, version = params.train.registered_model, trained["model_version"]
    record_gate(model, version, record, trained["mlflow_run_id"])
    keys = keys_location(params.promote.keys, workspace)
    record["attestation"] = attest_gate(record, Path(trained["policy_folder"]), keys).decode()
    reason = (
        f"judged on attempt {attempt.attempt}: gate {'passed' if record['passed'] else 'failed'}"
    )
    trials.close_trial_request(
        _channel(params, workspace), request, reason, _signing(params, workspace)
    )
    artifacts.log(artifacts.gate_sentence(cell_id, record))
    artifacts.gate_report(cell_id, record)
    return record


@task(name="promote", task_run_name="promote {cell_id}", **CHANNEL_IO)
def promote(
    params: Params,
    workspace: Path,
    cell_id: str,
    trained: dict,
    gate_record: dict,
    decision: dict | None = None,
) -> dict:
    """On a passing gate attestation: the gated version (the trialled weights, checked against
    the registry) as a signed release for the cell, then its alias; otherwise nothing.
    `decision`: a person's sign-off on top of the gate (kind "approval", by, at, reason)."""
    from pipelines.release import promote as promote_model

    attestation = gate_record.get("attestation")
    result = promote_model(
        attestation.encode() if attestation else None,
        cell_id,
        params.promote,
        params.train.registered_model,
        trained["model_version"],
        trained["mlflow_run_id"],
        Path(trained["policy_folder"]),
        trained["dataset_version"],
        decision=decision,
        workspace=workspace,
    ).as_dict()
    artifacts.log(artifacts.promotion_sentence(cell_id, result, trained))
    return result


@flow(name="retrain-loop")
def loop_flow(
    params_path: str = "params.yaml",
    workspace: str = ".",
    cell: str | None = None,
    source: str | None = None,
    progress: bool = False,
    suspend_for_trials: bool = False,
) -> dict:
    """One cycle for `cell`, or for every cell of fleet.cells; returns the cycle summary.
    `source` is what ingest reads (default: the landing folder); `progress` draws bars on
    stderr (the command line's, not under --json). `suspend_for_trials` (the work-pool
    deployment's): a run from a deployment suspends while trials run (flows/waiting.py)
    instead of polling in-process."""
    root, params = Path(workspace).resolve(), load_params(params_path)
    # One loop per cell at a time: a second one refuses here, before it ingests anything.
    cells = cycle.fleet_cells(params, cell)
    with loop_lock.cells_locked(root, cells, flow_run.get_id(), params):
        try:
            return _cycle(root, params, params_path, cell, source, progress, suspend_for_trials)
        except DiskFullError as exc:
            # A Failed state, not a raise, as the ingest flow does: Prefect would log a raised
            # error's traceback. The caller still gets the error, for its one line.
            return Failed(message=str(exc), data=exc)


def _cycle(root, params, params_path, cell, source, progress, suspend_for_trials) -> dict:
    saved = waiting.load(root, flow_run.get_id())  # this run, resumed after suspending
    if saved:
        fleet, number, ingested, validation = _Fleet.restore(saved["cycle"])
    else:
        fleet = _Fleet(rollout.cycle_cells(params, cell))  # with a canary: it alone
        number = ledger.cycles_done(root)  # this cycle's: its MLflow runs and summary say it
        ingested = ingest_flow(params_path, str(root), source=source, progress=progress)
        fleet.lap("ingest")
        validation = validate(params, root, _all_batches(root, params))
        fleet.lap("validate")
        _start_cells(
            fleet, params, root, ingested["dataset_version"], validation["passed_batches"], number
        )
    requests = {c: fleet.steps[c]["request"] for c in fleet.going()}
    if requests and suspend_for_trials and waiting.can_suspend():
        _suspend_for_trials(params, root, requests, (fleet, number, ingested, validation))
    waited = (
        await_trials(params_path, str(root), requests, source, progress, poll_now=bool(saved))
        if requests
        else {}
    )
    if saved:
        waiting.discard(root, saved["flow_run_id"])
    for cell_id, outcome in waited.get("outcomes", {}).items():
        fleet.steps[cell_id]["waited"] = outcome
    fleet.lap("await trials")
    _finish_cells(fleet, params, root)

    def poll() -> list[dict]:  # the rollout's wait ingests and validates as the trials' does
        return _validate_new(params, root, _poll_ingest(params_path, str(root), source))

    rolled = rollout.stage(params, root, cell, fleet.steps, poll, promote, progress)
    if rolled is not None:
        fleet.cells += [c for c in rolled["cells"] if c not in fleet.cells]  # the followers
        fleet.lap("rollout")
    summary = cycle.summarize_cycle(
        params,
        number,
        fleet.started,
        datetime.now(UTC),
        [ingested, *waited.get("ingests", [])],
        validation,
        [
            cycle.cell_result(c, ingested["dataset_version"], fleet.steps[c], fleet.errors.get(c))
            for c in fleet.cells
        ],
        fleet.timings,
    )
    summary["rollout"] = rolled
    summary["prescreen_correlation"] = cycle.prescreen_record(root, summary)
    ledger.record(params, root, summary)
    artifacts.log(artifacts.cycle_sentence(summary))
    artifacts.cycle_report(summary, root)
    return summary


def _start_cells(
    fleet: _Fleet,
    params: Params,
    root: Path,
    dataset_version: str,
    batches: list[str],
    number: int | None = None,
) -> None:
    """Per cell: plan → candidates and the pre-screen (flows/candidates.py) → upload the best
    → publish its trial request. A cell's trials are requested as soon as its candidate is
    chosen: the cell runs them on its robot while the loop builds the next cell's candidates
    on the CPU, instead of every cell waiting for the last one's build."""
    common = (unmapped(params), unmapped(root))
    cells = fleet.going()
    fleet.settle("plan", cells, plan_cell.map(*common, cells, unmapped(batches)))
    fleet.lap("plan")

    def send_to_trials(cell_id: str) -> None:
        _request_cell_trials(fleet, params, root, cell_id)

    # One cell at a time, but for the calibrated pretrains (processes of their own, started for
    # every cell first): MLflow registers a dataset version's input once per experiment with a
    # check-then-insert that concurrent runs of the same version break ("UNIQUE constraint
    # failed: datasets...", seen with two cells).
    candidates.build(fleet, params, root, dataset_version, number, then=send_to_trials)
    fleet.lap("candidates")


def _request_cell_trials(fleet: _Fleet, params: Params, root: Path, cell_id: str) -> None:
    """Upload the cell's chosen candidate and publish its trial request (the request id is
    made here, once: a retried publish rewrites the same request)."""
    steps = fleet.steps[cell_id]
    fleet.settle(
        "candidate", [cell_id], [upload_candidate.submit(params, root, cell_id, steps["trained"])]
    )
    if cell_id in fleet.errors:
        return
    document = trials.new_trial_request(
        cell_id,
        steps["candidate"],
        steps["plan"]["incumbent"],
        params.trials,
        gate=params.gate,  # the sequential design, fixed in the request
    )
    fleet.settle("request", [cell_id], [request_trials.submit(params, root, cell_id, document)])


def _finish_cells(fleet: _Fleet, params: Params, root: Path) -> None:
    """Per cell whose trials completed: gate → (sign-off, with promote.require_approval) →
    promote. Then what each channel names."""
    common = (unmapped(params), unmapped(root))
    cells = [c for c in fleet.going() if fleet.steps[c]["waited"]["state"] == "complete"]
    steps = [fleet.steps[c] for c in cells]
    fleet.settle(
        "gate",
        cells,
        gate.map(
            *common,
            cells,
            [s["trained"] for s in steps],
            [s["request"] for s in steps],
            [s["waited"]["attempt"] for s in steps],
        ),
    )
    fleet.lap("gate")
    # In the flow body: Prefect pauses a flow run, not a task. A rejected cell stops here.
    cells = [c for c in cells if c not in fleet.errors]
    cells = approval.sign_off_cells(params, fleet.steps, cells)
    if params.promote.require_approval:
        fleet.lap("sign-off")  # the wait for people, apart from the stages' own time
    steps = [fleet.steps[c] for c in cells]
    decisions = [s.get("approval") for s in steps]
    trained, gated = [s["trained"] for s in steps], [s["gate"] for s in steps]
    fleet.settle("promotion", cells, promote.map(*common, cells, trained, gated, decisions))
    fleet.lap("promote")
    for cell_id in fleet.cells:
        fleet.steps[cell_id]["edge"] = cycle.edge_channel_status(params, cell_id, root)


@flow(name="await-trials")
def await_trials(
    params_path: str,
    workspace: str,
    requests: dict[str, dict],
    source: str | None = None,
    progress: bool = False,
    poll_now: bool = False,
) -> dict:
    """Wait until every request is complete or past its deadline; withdraw those past it.
    `poll_now`: the first poll at once (a resumed run, whose trials are in).

    Every `trials.poll_s`: ingest what landed (all cells, one run), then check each open
    request against the episodes table. No task runs between polls, so the wait holds no
    worker. A request not complete at its deadline (`trials.timeout_s` after it was made) is
    withdrawn from the channel and its cell's cycle ends "trials incomplete"."""
    root, params = Path(workspace), load_params(params_path)
    pending, outcomes, ingests, rows = dict(requests), {}, [], []
    next_poll = time.monotonic() + (0 if poll_now else params.trials.poll_s)
    with progress_bar(progress) as update:
        while pending:
            _sleep_until(next_poll, pending)
            next_poll = time.monotonic() + params.trials.poll_s
            ingests += _validate_new(params, root, _poll_ingest(params_path, workspace, source))
            found = check_trials(params, root, pending)
            now = datetime.now(UTC)
            for cell_id, request in list(pending.items()):
                attempt, counts = found[cell_id]["attempt"], found[cell_id]["progress"]
                update(f"trials {cell_id}", min(counts.values()), request["episodes_per_arm"])
                state = trials.poll_state(request, attempt, now)
                if state == "waiting":
                    continue
                outcomes[cell_id] = _waited(request, state, attempt, counts, now, ingests)
                artifacts.log(artifacts.waited_sentence(cell_id, outcomes[cell_id], counts))
                rows.append(artifacts.waited_row(cell_id, request, outcomes[cell_id], counts))
                if state == "timed out":
                    reason = outcomes[cell_id]["reason"]
                    withdraw_trials(params, root, cell_id, request, reason)
                else:  # decided: the cell stops running trials now, not at the cap
                    close_decided_trials(params, root, cell_id, request, attempt)
                del pending[cell_id]
    artifacts.trials_wait(rows)
    return {"outcomes": outcomes, "ingests": ingests}


@task(name="close-decided-trials", task_run_name="close trials {cell_id}", **CHANNEL_IO)
def close_decided_trials(
    params: Params, workspace: Path, cell_id: str, request: dict, attempt: trials.Attempt
) -> bool:
    """Close a request the sequential test has decided, so the cell runs no more of it (the
    gate judges the episodes used; closing again after the gate is a no-op)."""
    used = min(attempt.counts().values())
    reason = f"decided on attempt {attempt.attempt} after {used} episodes per arm"
    closed = trials.close_trial_request(
        _channel(params, workspace), request, reason, _signing(params, workspace)
    )
    artifacts.log(f"{cell_id}: trial request {request['request_id']} {reason}; closed")
    return closed


def _suspend_for_trials(
    params: Params, root: Path, requests: dict[str, dict], state: tuple
) -> None:
    """From a deployment against a server: unless every request is settled already, save
    the cycle and suspend until ingest's realloop.trials.ready resumes this run
    (flows/waiting.py); the resumed run comes back here and then polls once."""
    if waiting.settled(params, root, requests):
        return
    waiting.drop_stale(root, params)
    fleet, number, ingested, validation = state
    run_id = str(flow_run.get_id())
    cycle_so_far = waiting.jsonable(
        {
            "fleet": fleet.snapshot(),
            "number": number,
            "ingested": ingested,
            "validation": validation,
        }
    )
    record = waiting.save(root, run_id, requests, cycle_so_far)
    get_run_logger().info(
        "suspending until the trials of %s are in (ingest resumes this run)", ", ".join(requests)
    )
    waiting.suspend(root, record, params)


def _poll_ingest(params_path: str, workspace: str, source: str | None) -> list[dict]:
    """One ingest run; a failed one (an unreachable landing zone) is reported and the wait
    goes on: the next poll tries again, and the deadline still holds."""
    state = ingest_flow(params_path, workspace, source=source, return_state=True)
    if state.is_completed():
        return [state.result()]
    reason = str(state.result(raise_on_failure=False)).splitlines()[0]
    get_run_logger().warning("ingest while waiting for trials failed: %s; retrying", reason)
    return []


def _validate_new(params: Params, root: Path, polled: list[dict]) -> list[dict]:
    """Each dataset version an ingest made while waiting (the trial episodes') is validated
    too, so that every version the loop makes has its results and Data Docs."""
    for ingested in polled:
        if ingested["dataset"].get("new"):
            report = validate(params, root, _all_batches(root, params))
            keys = ("dataset_version", "batches", "passed", "excluded_from_training", "data_docs")
            ingested["validation"] = {key: report[key] for key in keys}
    return polled


def _sleep_until(next_poll: float, pending: dict[str, dict]) -> None:
    """Until the next poll, or sooner when a deadline comes first (then the last look)."""
    now = datetime.now(UTC)
    to_deadline = min(
        (trials.parse_time(r["deadline"]) - now).total_seconds() for r in pending.values()
    )
    time.sleep(max(0.0, min(next_poll - time.monotonic(), to_deadline)))


def _waited(request, state, attempt, counts, now, ingests) -> dict:
    waited_s = (now - trials.parse_time(request["created_at"])).total_seconds()
    if state == "complete":
        reason = None
    else:
        wanted = request["episodes_per_arm"]
        got = ", ".join(f"{n}/{wanted} {arm}" for arm, n in counts.items())
        reason = (
            f"request {request['request_id']} not complete by its deadline "
            f"{request['deadline']} (best attempt: {got}); withdrawn, nothing promoted"
        )
    return {
        "state": state,
        "reason": reason,
        "attempt": attempt,
        "waited_s": round(waited_s, 1),
        "dataset_version": ingests[-1]["dataset_version"] if ingests else None,
    }


@dataclass
class _Fleet:
    """The cells of one cycle: what each cell's branch produced, which failed and why, and
    the wall time of each stage (all cells together)."""

    cells: list[str]
    steps: dict[str, dict] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    _start: float = field(default_factory=time.monotonic)
    _mark: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.steps = {c: {} for c in self.cells}

    def going(self) -> list[str]:
        """Cells still in the cycle: not failed, not skipped."""
        return [
            c
            for c in self.cells
            if c not in self.errors and not (self.steps[c].get("plan") or {}).get("skip")
        ]

    def settle(self, step: str, cells: list[str], futures) -> None:
        """Wait for one stage's tasks; keep each cell's result, or its one-line error."""
        for cell_id, future in zip(cells, futures, strict=True):
            future.wait()
            state = future.state
            if state.is_completed():
                self.steps[cell_id][step] = future.result()
            else:
                error = state.result(raise_on_failure=False)
                self.errors[cell_id] = f"{step}: {str(error).splitlines()[0] if error else state}"

    def snapshot(self) -> dict:
        """What restore needs, in JSON: the monotonic marks as seconds elapsed."""
        now = time.monotonic()
        return {
            "cells": self.cells,
            "steps": self.steps,
            "errors": self.errors,
            "timings": self.timings,
            "started": self.started.isoformat(),
            "since_start_s": now - self._start,
            "since_mark_s": now - self._mark,
            "saved_at": datetime.now(UTC).isoformat(),
        }

    @classmethod
    def restore(cls, saved: dict) -> tuple[_Fleet, int, dict, dict]:
        """A suspended cycle's fleet, number, ingest and validation; the time it spent
        suspended counts in its stage (the wait for trials) and in its total."""
        snap = saved["fleet"]
        away = (datetime.now(UTC) - datetime.fromisoformat(snap["saved_at"])).total_seconds()
        fleet = cls(list(snap["cells"]), errors=dict(snap["errors"]), timings=dict(snap["timings"]))
        fleet.steps = snap["steps"]
        fleet.started = datetime.fromisoformat(snap["started"])
        fleet._start = time.monotonic() - snap["since_start_s"] - away
        fleet._mark = time.monotonic() - snap["since_mark_s"] - away
        return fleet, saved["number"], saved["ingested"], saved["validation"]

    def lap(self, stage: str) -> None:
        now = time.monotonic()
        self.timings[stage] = now - self._mark
        self.timings["total"] = now - self._start
        self._mark = now


def _all_batches(root: Path, params: Params) -> list[str]:
    return sorted(p.stem for p in (root / params.ingest.dataset / "episodes").glob("*.parquet"))


def _channel(params: Params, workspace: Path) -> str:
    from pipelines.release import channel_location

    return channel_location(params.promote.channel, workspace)


def _signing(params: Params, workspace: Path) -> trials.Signing:
    """Trial requests are signed by the cell's key, like its releases."""
    return trials.trial_signing(params.promote, workspace)
