"""`realloop triage`: why the line's episodes failed, and which captures to review first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.console import emit, fails_cleanly, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


PolicyOpt = Annotated[
    Path | None,
    typer.Option(
        "--policy",
        help="the policy folder the cell ran: replay its failures of other parts with the "
        "standard part (needs --calibration)",
    ),
]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option("--calibration", help="sim-calibration.yaml of the cell's line, for the replays"),
]


@fails_cleanly
def triage_command(
    policy: PolicyOpt = None,
    calibration: CalibrationOpt = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Why episodes failed and which captures to review first (rules: docs/triage.md). With
    --policy and --calibration, each failure of another part is replayed with the standard
    part in the calibrated sim: the part is blamed where a standard part would have made it."""
    from pipelines.contract.params import load_params
    from pipelines.ingest import CAPTURES_DIR
    from pipelines.quality import triage_dataset

    params = load_params(params_path)
    counterfactual = _counterfactual(policy, calibration, params)
    workspace = Path.cwd()
    dataset = workspace / params.ingest.dataset
    report = triage_dataset(
        dataset,
        workspace / params.ingest.landing / CAPTURES_DIR,
        params.cell,
        params.triage,
        params.record.capture_window_steps,
        counterfactual,
    )
    payload = {"dataset": str(params.ingest.dataset)} | report.as_dict(
        params.triage.worst_per_class
    )
    emit(payload, as_json, lambda p: _print_triage(p, params.triage.queue_length))


def _counterfactual(policy: Path | None, calibration: Path | None, params):
    """The replay `--policy` and `--calibration` ask for, or None without them."""
    from flows.plugins import load_counterfactual

    if policy is None and calibration is None:
        return None
    if policy is None or calibration is None:
        raise ValueError(
            "realloop triage: --policy and --calibration go together (the policy the cell ran, "
            "and a sim-calibration.yaml of its line from `realloop calibrate`)"
        )
    if not (policy / "config.json").is_file():
        raise FileNotFoundError(f"{policy}: not a policy folder (no config.json); check the path")
    if not calibration.is_file():
        raise FileNotFoundError(f"{calibration}: no such file; run `realloop calibrate` first")
    return load_counterfactual(params, policy, calibration)


def _print_triage(report: dict, queue_length: int) -> None:
    counts = ", ".join(f"{cls} {n}" for cls, n in report["counts"].items())
    stdout.print(
        f"{report['dataset']}: {report['failed_episodes']} of {report['episodes']} episodes "
        f"failed: {counts}",
        soft_wrap=True,
        highlight=False,
    )
    parts = ", ".join(f"{kind} {n}" for kind, n in report["parts"].items())
    stdout.print(
        f"parts: {parts}; {len(report['novel_part_episodes'])} novel-part episodes "
        "(kept and weighted by data selection)"
        + (
            f"; {report['replayed']} failures replayed with the standard part"
            if report["replayed"]
            else ""
        ),
        soft_wrap=True,
        highlight=False,
    )
    for cls, rows in report["worst"].items():
        if not rows:
            continue
        stdout.print(f"worst {cls}:", highlight=False)
        for row in rows:
            stdout.print(
                f"  {row['episode_id']}  {row['rule']}: {_evidence(row['evidence'])}",
                soft_wrap=True,
                highlight=False,
            )
    queue = report["queue"]
    stdout.print(
        f"review queue: {len(queue)} captures"
        + (f", first {queue_length}" if len(queue) > queue_length else ""),
        highlight=False,
    )
    for row in queue[:queue_length]:
        step = "-" if row["step"] is None else row["step"]
        outcome = f"failed ({row['failure_cause']})" if row["episode_failed"] else "succeeded"
        stdout.print(
            f"  {row['rank']:>3} {row['priority']:<6} {row['episode_id']} step {step} "
            f"{row['reason']}: {row['class']} ({_evidence(row['evidence'])}), episode {outcome}",
            soft_wrap=True,
            highlight=False,
        )


def _evidence(evidence: list[dict]) -> str:
    return ", ".join(
        f"{e['signal']} {_number(e['value'])} {e['test']} {e['limit']}"
        + (f" ({e['detail']})" if e.get("detail") else "")
        for e in evidence
    )


def _number(value) -> str:
    return "?" if value is None else f"{value:.4g}"
