"""What a flow run leaves for people: Prefect artifacts and one log sentence per stage.

Artifacts (keys are stable, so the Prefect UI's Artifacts page shows each one's history;
docs/tracking.md lists them):
    ingest-report      markdown, per `ingest` run: new files per cell, skipped, quarantined
    data-docs          link, per validate (in `retrain-loop`): the Data Docs index it wrote
    <cell>-mlflow-run  link (markdown when MLflow is not an http server), per fine-tune
    trials-wait        table, per `await-trials` run: each cell's request and how it ended
    <cell>-gate        markdown, per gate: the verdict, each arm's trial statistics, reasons
    cycle-summary      markdown, per `retrain-loop` run: the table the terminal shows
    cycle-cells        table, per `retrain-loop` run: the same rows with links and numbers

Everything is built from the values the stages already return (and the cycle table from
flows.cycle, the one place that lays it out); pipelines/ never sees Prefect. Outside a run
(bench calls the flows' functions directly) nothing is published and the sentences go to
the `realloop` logger.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from flows import cycle

KEY_JUNK = re.compile(r"[^a-z0-9-]+")
MAX_LISTED = 20  # quarantined files named in the ingest report; the rest are counted


def key(*parts: str) -> str:
    """An artifact key from parts (a cell id among them): Prefect allows only lowercase
    letters, digits and dashes."""
    return KEY_JUNK.sub("-", "-".join(parts).lower()).strip("-")


def log(sentence: str) -> None:
    """One sentence to the run's log (the Prefect UI), or to `realloop` outside a run."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        logger = get_run_logger()
    except MissingContextError:
        logger = logging.getLogger("realloop")
    logger.info(sentence)


def _in_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def markdown(artifact_key: str, text: str, description: str) -> None:
    if _in_run():
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(text, key=artifact_key, description=description)


def table(artifact_key: str, rows: list[dict], description: str) -> None:
    if _in_run():
        from prefect.artifacts import create_table_artifact

        create_table_artifact(rows, key=artifact_key, description=description)


def link(artifact_key: str, target: dict, description: str) -> None:
    """`target` from mlflow_run_link / data_docs_link: a URL, or text when there is none."""
    if not _in_run():
        return
    if target["url"]:
        from prefect.artifacts import create_link_artifact

        create_link_artifact(
            target["url"], link_text=target["text"], key=artifact_key, description=description
        )
    else:
        markdown(artifact_key, target["text"], description)


# --- links --------------------------------------------------------------------------------


def mlflow_run_link(workspace: Path, run_id: str) -> dict:
    """The run's page when MLFLOW_TRACKING_URI is an http server; otherwise the run id and
    the tracking URI as text (a file store has no page to open)."""
    from pipelines.training.tracking import mlflow_client, tracking_uri

    uri = tracking_uri(workspace)
    if not uri.startswith(("http://", "https://")):
        return {"url": None, "text": f"MLflow run {run_id} in {uri}"}
    experiment = mlflow_client(workspace).get_run(run_id).info.experiment_id
    url = f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
    return {"url": url, "text": f"MLflow run {run_id}"}


def data_docs_link(validation: dict) -> dict:
    where = validation.get("data_docs")
    if not where:
        return {"url": None, "text": "no Data Docs written"}
    url = where if "://" in where else Path(where).resolve().as_uri()
    return {"url": url, "text": f"Data Docs {where}"}


def _md_link(target: dict) -> str:
    return f"[{target['text']}]({target['url']})" if target["url"] else f"`{target['text']}`"


# --- ingest -------------------------------------------------------------------------------


def new_files_by_cell(dataset: Path, ingested: list[dict]) -> dict[str, int]:
    """cell id → files ingested this run, from each new batch's cell_id column."""
    import pyarrow.parquet as pq

    counts: dict[str, int] = {}
    for row in ingested:
        path = dataset / "episodes" / f"{row['sha256']}.parquet"
        cells = pq.read_table(path, columns=["cell_id"]).column("cell_id").unique().to_pylist()
        for cell_id in cells:
            counts[cell_id] = counts.get(cell_id, 0) + 1
    return dict(sorted(counts.items()))


def ingest_sentence(report: dict, by_cell: dict[str, int], version: dict) -> str:
    cells = ", ".join(f"{c}: {n}" for c, n in by_cell.items())
    new = report["files_ingested"]
    what = (
        f"ingested {new} new file(s) ({report['episodes_ingested']} episodes) from "
        f"{len(by_cell)} cell(s) ({cells})"
        if new
        else "nothing new"
    )
    state = "new version" if version["new"] else "unchanged"
    dataset = f"dataset {version['version'][:12]} ({state})"
    return (
        f"{what}, {report['files_skipped']} already seen, "
        f"{report['files_quarantined']} quarantined; {dataset}"
    )


def ingest_report(result: dict, by_cell: dict[str, int]) -> None:
    """The `ingest-report` artifact from the flow's return value."""
    report, version = result["ingest"], result["dataset"]
    quarantined = report["quarantined"]
    lines = [
        f"### ingest from `{result['source']}`",
        "",
        ingest_sentence(report, by_cell, version),
    ]
    if by_cell:
        lines += ["", "| cell | new files |", "|---|---|"]
        lines += [f"| {c} | {n} |" for c, n in by_cell.items()]
    if quarantined:
        lines += ["", "quarantined:"]
        lines += [f"- `{q['source']}`: {q['reason']}" for q in quarantined[:MAX_LISTED]]
        if len(quarantined) > MAX_LISTED:
            lines.append(f"- and {len(quarantined) - MAX_LISTED} more")
    markdown("ingest-report", "\n".join(lines), f"dataset {version['version']}")


# --- the loop's stages --------------------------------------------------------------------


def validate_sentence(report: dict) -> str:
    return (
        f"validated {report['batches']} batches ({report['validated']} checked now, "
        f"{report['cached']} from stored results): {report['passed']} passed, "
        f"{len(report['failed'])} failed, {len(report['excluded_from_training'])} excluded "
        f"from training; Data Docs at {report.get('data_docs') or '-'}"
    )


def plan_sentence(plan: dict) -> str:
    if plan.get("skip"):
        return f"{plan['cell']}: skipped: {plan['skip']}"
    return (
        f"{plan['cell']}: production model version {plan['model_version']} "
        f"(policy {plan['policy_version']}, bundle {plan['bundle_id']}); "
        f"{len(plan['batches'])} validated batch(es) to train on"
    )


def trained_sentence(cell_id: str, trained: dict, seconds: float) -> str:
    return (
        f"{cell_id}: fine-tuned on {trained['episodes_used']} episodes "
        f"({trained['examples']} examples) in {seconds:.1f} s, "
        f"val_loss {trained['final_val_loss']:.4f}; registered version "
        f"{trained['model_version']} (MLflow run {trained['mlflow_run_id']})"
    )


def request_sentence(cell_id: str, request: dict) -> str:
    return (
        f"{cell_id}: requested {request['episodes_per_arm']} trial episodes per arm "
        f"(request {request['request_id']}, deadline {request['deadline']})"
    )


def waited_sentence(cell_id: str, outcome: dict, counts: dict[str, int]) -> str:
    got = ", ".join(f"{arm} {n} episodes" for arm, n in counts.items())
    if outcome["state"] == "complete":
        attempt = outcome["attempt"].attempt
        return f"{cell_id}: trials complete ({attempt}): {got}, after {outcome['waited_s']} s"
    return f"{cell_id}: trials incomplete: {outcome['reason']}"


def trials_wait(rows: list[dict]) -> None:
    table("trials-wait", rows, "each cell's trial request and how the wait ended")


def waited_row(cell_id: str, request: dict, outcome: dict, counts: dict[str, int]) -> dict:
    attempt = outcome["attempt"]
    return {
        "cell": cell_id,
        "request": request["request_id"],
        "state": outcome["state"],
        "attempt": attempt.attempt if attempt is not None else "-",
        **{f"{arm} episodes": f"{n}/{request['episodes_per_arm']}" for arm, n in counts.items()},
        "waited_s": outcome["waited_s"],
    }


def gate_sentence(cell_id: str, record: dict) -> str:
    verdict = "PASS" if record["passed"] else "FAIL"
    arms = ", ".join(f"{a} {cycle.format_trials(record[a])}" for a in ("candidate", "incumbent"))
    failed = [r.removeprefix("FAIL: ") for r in record["reasons"] if r.startswith("FAIL")]
    return f"{cell_id}: gate {verdict}: {arms}" + (f"; {'; '.join(failed)}" if failed else "")


def gate_report(cell_id: str, record: dict) -> None:
    """The `<cell>-gate` artifact: the verdict, each arm's statistics, every reason."""
    rows = []
    for arm in ("candidate", "incumbent"):
        stats = record[arm]
        p95 = stats["p95_cycle_time_s"]
        rows.append(
            f"| {arm} | `{stats['policy']}` | {cycle.format_trials(stats)} | "
            f"{stats['safety_stops']} | {'-' if p95 is None else f'{p95:.2f} s'} |"
        )
    text = "\n".join(
        [
            f"### {cell_id}: gate {'PASSED' if record['passed'] else 'FAILED'}",
            "",
            f"request `{record.get('trial_request_id')}`, attempt `{record.get('trial_attempt')}`",
            "",
            *_sequential_lines(record),
            "| arm | bundle | successes (Wilson interval) | safety stops | p95 cycle time |",
            "|---|---|---|---|---|",
            *rows,
            "",
            *(f"- {reason}" for reason in record["reasons"]),
        ]
    )
    markdown(key(cell_id, "gate"), text, f"{cell_id}: the gate on its hardware trials")


def _sequential_lines(record: dict) -> list[str]:
    """How the sequential gate stopped (docs/gate.md); nothing for a record from before it."""
    if "stopped" not in record:
        return []
    superiority = "shown" if record["superiority"]["shown"] else "not shown"
    return [
        f"sequential test: stopped for {record['stopped']} after {record['episodes_used']} of "
        f"{record['max_episodes']} episodes per arm (margin {record['margin']}, alpha "
        f"{record['alpha']}); superiority {superiority}",
        "",
    ]


def promotion_sentence(cell_id: str, result: dict, trained: dict) -> str:
    if not result["promoted"]:
        return f"{cell_id}: not promoted: {'; '.join(result['reasons'])}"
    bundle = (result.get("bundle") or {}).get("bundle_id")
    return (
        f"{cell_id}: promoted version {trained['model_version']} as bundle {bundle} "
        f"on {result['channel']}; alias {result['alias']}"
    )


# --- the cycle ----------------------------------------------------------------------------


def cycle_sentence(summary: dict) -> str:
    outcomes: dict[str, list[str]] = {}
    for cell in summary["cells"]:
        outcomes.setdefault(cell["outcome"], []).append(cell["cell"])
    told = "; ".join(f"{o}: {', '.join(cells)}" for o, cells in outcomes.items())
    return f"cycle {summary['cycle']}: {len(summary['cells'])} cell(s): {told or 'none'}"


def cycle_report(summary: dict, workspace: Path) -> None:
    """The cycle's artifacts: `cycle-summary` (markdown) and `cycle-cells` (table), from the
    rows the terminal prints (flows.cycle)."""
    runs = {
        cell["cell"]: mlflow_run_link(workspace, cell["training"]["mlflow_run_id"])
        for cell in summary["cells"]
        if cell["training"]
    }
    text = cycle_markdown(summary, runs)
    markdown("cycle-summary", text, f"retrain-loop cycle {summary['cycle']}")
    table("cycle-cells", [_cell_record(c, runs) for c in summary["cells"]], "one row per cell")


def cycle_markdown(summary: dict, runs: dict[str, dict]) -> str:
    """`cycle-summary`: the data, the per-cell table (with each fine-tune's MLflow run from
    `runs`), then the gate's reasons and why each cell ended as it did."""
    docs = data_docs_link(summary["validation"])
    rows = cycle.cell_rows(summary)
    columns = [*rows[0], "MLflow run"] if rows else []
    lines = [
        f"### cycle {summary['cycle']}: {len(summary['cells'])} cell(s)",
        "",
        *(f"- {line.strip()}" for line in cycle.summary_lines(summary)),
        f"- {_md_link(docs)}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        run = runs.get(row["cell"])
        values = [*row.values(), _md_link(run) if run else "-"]
        lines.append("| " + " | ".join(v.replace("|", "\\|") for v in values) + " |")
    lines += ["", *(f"- {note}" for note in cycle.cell_notes(summary))]
    return "\n".join(lines)


def _cell_record(cell: dict, runs: dict[str, dict]) -> dict:
    """A cell's row of `cycle-cells`: numbers, not formatted text, where there are some."""
    trials, gate = cell["trials"] or {}, cell["gate"]
    record = {
        "cell": cell["cell"],
        "outcome": cell["outcome"],
        "gate": "-" if gate is None else ("PASSED" if gate["passed"] else "FAILED"),
        "promoted_version": cell["promoted_version"] or "-",
        "reason": cell["reason"] or "",
    }
    for arm in ("candidate", "incumbent"):
        stats = trials.get(arm)
        record[f"{arm}_successes"] = "-" if stats is None else f"{stats['successes']}/{stats['n']}"
        record[f"{arm}_interval"] = (
            "-" if stats is None else "–".join(f"{v:.3f}" for v in stats["interval"])
        )
    run = runs.get(cell["cell"])
    record["mlflow_run"] = "-" if run is None else (run["url"] or run["text"])
    return record
