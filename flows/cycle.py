"""What one loop cycle needs around its stages: which cells it serves, where each cell stands
(its production model and the bundle its channel names), and the cycle summary that people
and scripts read. Nothing here runs a cell: cells are met through the channel and the
landing zone only."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from pipelines.contract.params import Params

CELLS_DIR = Path("models/cells")  # per cell: base/ (what its fine-tune starts from)
NO_PRODUCTION = "no production model: run realloop deploy --initial"

# What a cell's cycle ended with (`outcome` in the summary).
PROMOTED, NOT_PROMOTED, INCOMPLETE = "promoted", "not promoted", "trials incomplete"
SKIPPED, FAILED = "skipped", "failed"
# Staged rollout (flows/rollout.py): a follower got the canary's model, or did not; the canary
# kept it, or its health window failed and it was rolled back.
ROLLED_OUT, NOT_ROLLED_OUT, ROLLED_BACK = "rolled out", "not rolled out", "rolled back"


def fleet_cells(params: Params, cell: str | None = None) -> list[str]:
    """The cells a cycle serves: the one asked for, or every cell of `fleet.cells`."""
    if cell is not None:
        from edge.bundle import check_name
        from edge.errors import EdgeError

        try:
            return [check_name(cell, "cell id")]
        except EdgeError as exc:
            raise ValueError(str(exc)) from None
    return list(params.fleet.cells)


def production_alias(params: Params, cell_id: str | None = None) -> str:
    """`<cell_id>-production` (default: cell.cell_id, the cell the single-cell commands use)."""
    from pipelines.release import production_alias as alias_for

    return alias_for(cell_id or params.cell.cell_id, params.promote)


def base_folder(workspace: Path, cell_id: str) -> Path:
    """Where a cell's fine-tune starts from: its production model, pinned here so that
    `dvc repro finetune` reproduces the loop's fine-tuning from the same weights."""
    return workspace / CELLS_DIR / cell_id / "base"


def plan_cell(params: Params, workspace: Path, cell_id: str, batches: list[str]) -> dict:
    """Where a cell stands: its production model (registry alias `<cell>-production`), pinned
    as its fine-tune base, the incumbent bundle its signed release names, and its validated
    batches among `batches`. `skip` says why a cell cannot run a cycle (then nothing else is
    set)."""
    from pipelines.release import channel_location
    from pipelines.release.trials import incumbent_arm
    from pipelines.training import download_policy, load_policy, production_version
    from pipelines.training.retrain import cell_batches

    model = params.train.registered_model
    production = production_version(model, production_alias(params, cell_id))
    if production is None:
        return {"cell": cell_id, "skip": NO_PRODUCTION}
    channel = channel_location(params.promote.channel, workspace)
    try:
        incumbent = incumbent_arm(channel, cell_id)
    except ValueError as exc:  # the registry has a model, the channel does not
        return {"cell": cell_id, "skip": str(exc)}
    mine = cell_batches(workspace / params.ingest.dataset, batches, cell_id)
    if not mine:
        return {
            "cell": cell_id,
            "skip": f"no validated logs from {cell_id} yet: nothing to train on",
        }
    base = download_policy(model, production.version, base_folder(workspace, cell_id))
    return {
        "cell": cell_id,
        "skip": None,
        "batches": mine,
        "base": str(base),
        "model_version": production.version,
        "policy_version": load_policy(base).name,
        "bundle_id": incumbent["bundle_id"],
        "incumbent": incumbent,
    }


def landed_since(reports: list[dict]) -> dict:
    """Ingest counts over every ingest run of the cycle (the first and each poll)."""
    return {
        "episodes_ingested": sum(r["episodes_ingested"] for r in reports),
        "files_ingested": sum(r["files_ingested"] for r in reports),
        "files_quarantined": sum(r["files_quarantined"] for r in reports),
        "quarantined": [q for r in reports for q in r["quarantined"]],
    }


def edge_channel_status(params: Params, cell_id: str, workspace: Path | None = None) -> dict | None:
    """What the channel's signed release tells the cell's edge box to run (None before any)."""
    from edge.errors import EdgeError
    from edge.release import current_release
    from pipelines.release import channel_location

    try:
        release = current_release(channel_location(params.promote.channel, workspace), cell_id)
    except EdgeError:
        return None
    if release is None:
        return None
    return {
        "bundle_id": release["bundle_id"],
        "model_name": release.get("model_name"),
        "model_version": release.get("model_version"),
        "dataset_version": release.get("dataset_version"),
        "created_at": release.get("published_at"),
        "decision": (release.get("decision") or {}).get("kind"),
        "signed": True,
    }


def cell_result(cell_id: str, dataset_version: str, steps: dict, error: str | None = None) -> dict:
    """One cell's line of the cycle summary from what its branch produced (`steps`: plan,
    trained, request, waited, gate, approval, promotion, rollout, edge; each as far as the
    branch got; a rollout follower has only rollout and edge)."""
    plan, trained = steps.get("plan") or {}, steps.get("trained")
    waited, gate, promotion = steps.get("waited"), steps.get("gate"), steps.get("promotion")
    rollout = steps.get("rollout") or {}
    outcome, reason = _outcome(plan, waited, gate, promotion, error, steps.get("approval"))
    outcome, reason = rollout.get("outcome", outcome), rollout.get("reason", reason)
    attempt = (waited or {}).get("attempt")
    return {
        "cell": cell_id,
        "outcome": outcome,
        "reason": reason,
        "dataset_version": dataset_version,
        "dataset_version_with_trials": (waited or {}).get("dataset_version"),
        "incumbent": {k: plan.get(k) for k in ("model_version", "policy_version", "bundle_id")},
        "training": trained,
        "trial_request": steps.get("request"),
        "attempt": None if attempt is None else attempt.as_dict(),
        "waited_s": (waited or {}).get("waited_s"),
        "trials": None if gate is None else {a: gate[a] for a in ("candidate", "incumbent")},
        "gate": None if gate is None else {"passed": gate["passed"], "reasons": gate["reasons"]},
        "approval": steps.get("approval"),
        "promotion": promotion or rollout.get("promotion"),
        "promoted_version": (
            trained["model_version"] if outcome == PROMOTED else rollout.get("model_version")
        ),
        "edge": steps.get("edge"),
        # The candidates built, their pre-screen figures and which went to trials
        # (flows/candidates.py); None for a cell that stopped before (or a rollout follower).
        "prescreen": steps.get("prescreen"),
    }


def _outcome(plan, waited, gate, promotion, error, approval=None) -> tuple[str, str | None]:
    if error is not None:
        return FAILED, error
    if plan.get("skip"):
        return SKIPPED, plan["skip"]
    if waited is not None and waited["state"] != "complete":
        return INCOMPLETE, waited["reason"]
    if approval is not None and not approval["approved"]:
        return NOT_PROMOTED, (
            f"not signed off ({approval['by']}, {approval['at']}): {approval['reason']}"
        )
    if promotion is not None and promotion["promoted"]:
        return PROMOTED, promotion["reasons"][-1].removeprefix("promoted: ")
    failed = [r for r in (gate or {}).get("reasons", []) if r.startswith("FAIL")]
    return NOT_PROMOTED, "; ".join(failed) or "the gate did not pass"


def summarize_cycle(
    params: Params,
    cycle: int,
    started: datetime,
    finished: datetime,
    ingests: list[dict],
    validation: dict,
    cells: list[dict],
    timings_s: dict,
) -> dict:
    return {
        "cycle": cycle,
        "started_at": started.isoformat(),
        "finished_at": finished.isoformat(),
        "dataset_version": ingests[0]["dataset_version"],
        "dataset_version_after_trials": ingests[-1]["dataset_version"],
        "ingest": landed_since([i["ingest"] for i in ingests]) | {"runs": len(ingests)},
        "validation": {k: v for k, v in validation.items() if k != "passed_batches"},
        # Each later version (the trial episodes'), validated with its Data Docs too.
        "validations_after_trials": [i["validation"] for i in ingests[1:] if "validation" in i],
        "channel": params.promote.channel,
        "cells": cells,
        "timings_s": {k: round(v, 2) for k, v in timings_s.items()},
    }


def print_cycle(summary: dict, print_line) -> None:
    """The human summary: the data, then one row per cell."""
    from rich.table import Table

    print_line(f"[bold]cycle {summary['cycle']}[/]: {len(summary['cells'])} cell(s)")
    for line in summary_lines(summary):
        print_line(line)
    table = Table(title="per cell")
    for column in CELL_COLUMNS:
        table.add_column(column)
    for row in cell_rows(summary):
        table.add_row(*row.values())
    print_line(table)
    for note in cell_notes(summary):
        print_line(f"  {note}")
    if (dvc := summary.get("dvc") or {}).get("commit"):  # pipelines/release/cycle_record.py
        print_line(
            f"dvc: {', '.join(dvc['stages']) or 'trials.json'} recorded in commit "
            f"{dvc['commit'][:10]} (tag cycle-{summary['cycle']}): `dvc exp show --all-tags`"
        )
    elif dvc.get("error"):
        print_line(f"dvc: the cycle is not recorded: {dvc['error']}")


# The per-cell table: the terminal (print_cycle) and the cycle-summary artifact
# (flows.artifacts) both lay it out from these three.
CELL_COLUMNS = ("cell", "dataset", "candidate", "incumbent", "gate", "result")


def summary_lines(summary: dict) -> list[str]:
    """What the cycle did with the data: ingest, quarantine, validation (and the rollout)."""
    ingest, validation = summary["ingest"], summary["validation"]
    rollout = summary.get("rollout")  # flows/rollout.py, with fleet.canary
    return [
        f"dataset {summary['dataset_version']}: {ingest['episodes_ingested']} episodes "
        f"ingested from {ingest['files_ingested']} logs in {ingest['runs']} ingest runs, "
        f"{ingest['files_quarantined']} quarantined",
        *(f"  quarantined {row['source']}: {row['reason']}" for row in ingest["quarantined"]),
        f"validation: {validation['passed']} of {validation['batches']} batches passed; "
        f"excluded from training: {len(validation['excluded_from_training'])}",
        *([] if rollout is None else [rollout_line(rollout)]),
        *prescreen_lines(summary.get("prescreen_correlation")),
    ]


def prescreen_lines(found: dict | None) -> list[str]:
    """The pre-screen's predictive value so far, in one line (none before it is recorded)."""
    if not found:
        return []
    if found["rho"] is None:
        return [f"pre-screen vs trials: no rank correlation yet ({found['reason']})"]
    return [
        f"pre-screen vs trials: Spearman rho {found['rho']:.2f} (p {found['p_value']:.2g}) "
        f"over {found['n']} trialled candidates"
    ]


def rollout_line(rollout: dict) -> str:
    """The staged rollout in one line: from which canary, its window, how it ended."""
    window = rollout["window"]
    if window is None:
        return f"rollout from canary {rollout['canary']}: {rollout['state']}"
    return (
        f"rollout of version {rollout['model_version']} from canary {rollout['canary']}: "
        f"{rollout['state']} ({window['reason']})"
    )


def cell_rows(summary: dict) -> list[dict[str, str]]:
    """One row per cell, CELL_COLUMNS → text."""
    rows = []
    for cell in summary["cells"]:
        trials = cell["trials"] or {}
        values = (
            cell["cell"],
            (cell["dataset_version"] or "-")[:12],
            format_trials(trials.get("candidate")),
            format_trials(trials.get("incumbent")),
            "-" if cell["gate"] is None else ("PASSED" if cell["gate"]["passed"] else "FAILED"),
            _result_cell(cell),
        )
        rows.append(dict(zip(CELL_COLUMNS, values, strict=True)))
    return rows


def cell_notes(summary: dict) -> list[str]:
    """Each cell's candidates and gate reasons, then why it ended as it did."""
    notes = []
    for cell in summary["cells"]:
        notes += candidate_notes(cell)
        notes += [f"{cell['cell']} gate: {r}" for r in (cell["gate"] or {}).get("reasons", [])]
        if cell["reason"]:
            notes.append(f"{cell['cell']} {cell['outcome']}: {cell['reason']}")
    return notes


def candidate_notes(cell: dict) -> list[str]:
    """One line per candidate of a cell: its pre-screen figures, or why it was not built."""
    notes = []
    for c in (cell.get("prescreen") or {}).get("candidates", []):
        if c.get("error"):
            notes.append(f"{cell['cell']} candidate {c['name']}: not built ({c['error']})")
            continue
        figures = ", ".join(
            f"{name} {c[key]:.3f}"
            for name, key in (
                ("score", "score"),
                ("sim", "sim_success"),
                ("agree", "action_agreement"),
            )
            if c.get(key) is not None
        )
        trialled = "; trialled" if c.get("selected") else ""
        notes.append(
            f"{cell['cell']} candidate {c['name']} (version {c['model_version']}): rank "
            f"{c['rank']}, {figures or 'unscored'}{trialled}"
        )
    return notes


def prescreen_record(root: Path, summary: dict) -> dict:
    """How well the pre-screen predicted the trials: Spearman's rank correlation over every
    cycle in the ledger and this one (pipelines.release.prescreen.prescreen_correlation)."""
    import json

    from flows.ledger import CYCLES
    from pipelines.release.prescreen import prescreen_correlation

    ledger = root / CYCLES
    earlier = (
        [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.is_file() else []
    )
    found = prescreen_correlation([*earlier, summary])
    return {k: v for k, v in found.items() if k != "pairs"}


def format_trials(stats: dict | None) -> str:
    """successes/n, rate and its Wilson interval: how a trial arm is shown everywhere."""
    if stats is None:
        return "-"
    low, high = stats["interval"]
    return f"{stats['successes']}/{stats['n']} {stats['success_rate']:.0%} ({low:.0%}–{high:.0%})"


def _result_cell(cell: dict) -> str:
    if cell["outcome"] in (PROMOTED, ROLLED_OUT):
        return f"{cell['outcome']} version {cell['promoted_version']}"
    return cell["outcome"]
