"""The retraining loop, one cycle, top to bottom like the diagram in the design notes:

collect a shift with the production policy → ingest (subflow) → validate → fine-tune →
hardware trials of candidate and incumbent (ingested too: trials are data) → gate → promote.

Tasks are thin: each calls one stage function from pipelines/ (or the reference cell, which
stands in for the physical line) and returns plain JSON-able dicts for the summary.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prefect import flow, task

from flows import cycle
from flows.ingest import ingest_flow
from pipelines.contract.params import Params, load_params

CYCLES = Path(".realloop/cycles.jsonl")  # one summary per finished cycle, in the workspace


@task(name="collect")
def collect(
    params_path: Path,
    policy: Path,
    landing: Path,
    seed: int,
    start: datetime,
    episodes: int,
    progress: bool = False,
) -> dict:
    """Record a shift on the line with the production policy, operator on."""
    from flows.cell import run_record

    params = load_params(params_path)
    return run_record(
        str(policy),
        episodes,
        landing,
        seed,
        params.collect.interventions,
        start.isoformat(),
        params_path,
        progress=progress,
    )


@task(name="validate")
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
    return report.as_dict() | {"passed_batches": report.passed_batches}


@task(name="fine-tune")
def fine_tune(
    params: Params, workspace: Path, base: Path, dataset_version: str, batches: list[str]
) -> dict:
    from pipelines.training import fine_tune_and_register

    return fine_tune_and_register(params, workspace, base, dataset_version, batches)


@task(name="hardware-trials")
def hardware_trials(
    params_path: Path,
    policy: Path,
    landing: Path,
    seed: int,
    start: datetime,
    progress: bool = False,
) -> dict:
    """N line episodes without the operator, logged like any shift so they are ingested."""
    from flows.cell import run_record

    params = load_params(params_path)
    return run_record(
        str(policy),
        params.trials.episodes,
        landing,
        seed,
        False,
        start.isoformat(),
        params_path,
        progress=progress,
    )


@task(name="gate")
def gate(params: Params, workspace: Path, trained: dict, trials: dict[str, list[str]]) -> dict:
    """Judge the candidate on its trial logs; store the record with the model version."""
    from pipelines.ingest import read_dataset
    from pipelines.release import decide, trial_stats
    from pipelines.training import record_gate

    dataset = workspace / params.ingest.dataset
    stats = {
        role: trial_stats(read_dataset(dataset, sources)[0], params.gate.confidence)
        for role, sources in trials.items()
    }
    decision = decide(stats["candidate"], stats["incumbent"], params.gate.cycle_time_budget_s)
    record = decision.as_record() | {"trial_sources": trials}
    record_gate(
        params.train.registered_model,
        trained["model_version"],
        record,
        trained["mlflow_run_id"],
    )
    return record


@task(name="promote")
def promote(params: Params, workspace: Path, trained: dict, gate_record: dict) -> dict:
    from pipelines.release import promote as promote_model

    result = promote_model(
        gate_record,
        params.cell,
        params.promote,
        params.train.registered_model,
        trained["model_version"],
        trained["mlflow_run_id"],
        workspace / params.train.out,
        trained["dataset_version"],
    )
    return result.as_dict()


@flow(name="retrain-loop")
def loop_flow(
    params_path: str = "params.yaml", workspace: str = ".", progress: bool = False
) -> dict:
    """One cycle of the continual-retraining loop; returns the loop summary. `progress` draws
    bars on stderr (the command line's, not under --json)."""
    root = Path(workspace).resolve()
    params = load_params(params_path)
    index = _cycles_done(root)
    landing = root / params.ingest.landing
    start = datetime.now(UTC).replace(microsecond=0)

    incumbent = cycle.current_policy(params, Path(params_path), root)
    shift = collect(
        Path(params_path),
        incumbent["folder"],
        landing,
        params.collect.seed + index,
        start,
        params.collect.episodes,
        progress,
    )
    ingested = ingest_flow(params_path, str(root), progress=progress)
    validation = validate(params, root, _all_batches(root, params))
    base = cycle.pin_base_policy(incumbent["folder"], root)
    trained = fine_tune(
        params, root, base, ingested["dataset_version"], validation["passed_batches"]
    )
    trial_logs = {}
    for offset, (role, folder) in enumerate(
        (("candidate", root / params.train.out), ("incumbent", incumbent["folder"])), start=1
    ):
        recorded = hardware_trials(
            Path(params_path),
            folder,
            landing,
            params.trials.seed + index,
            start + timedelta(hours=offset),
            progress,
        )
        trial_logs[role] = recorded["files"]
    after_trials = ingest_flow(params_path, str(root), progress=progress)
    trial_sources = cycle.sources_of(after_trials["ingest"], trial_logs)
    decision = gate(params, root, trained, trial_sources)
    trained["gate"] = decision
    promotion = promote(params, root, trained, decision)
    summary = cycle.summarize_cycle(
        params, index, incumbent, shift, ingested, after_trials, validation, trained, promotion
    )
    _record_cycle(root, summary)
    return summary


def _cycles_done(root: Path) -> int:
    ledger = root / CYCLES
    return len(ledger.read_text().splitlines()) if ledger.is_file() else 0


def _record_cycle(root: Path, summary: dict) -> None:
    ledger = root / CYCLES
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as handle:
        handle.write(json.dumps(summary, default=str) + "\n")


def _all_batches(root: Path, params: Params) -> list[str]:
    return sorted(p.stem for p in (root / params.ingest.dataset / "episodes").glob("*.parquet"))
