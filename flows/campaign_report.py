"""What the campaign reports: the issue's targets computed from the daily held-out figures,
`campaign.png` (one panel per cell), the table per cell, and one MLflow run.

Every target is computed, never asserted: each has its `value` (the figure it rests on), `met`
(true/false; null where the campaign holds no case of it) and, where it helps, `cases`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

POLICIES = ("production", "sim", "calibrated_once", "expert")
LABELS = {
    "production": "production (the box's model)",
    "sim": "frozen sim policy",
    "calibrated_once": "calibrated once (first day)",
    "expert": "privileged expert",
}
EXPERIMENT = "realloop-campaign"
FIRST_CYCLE_FLOOR = 0.90  # after the first cycle from the sim policy
EXPERT_GAP = 0.03  # within this of the expert after at most 3 cycles
RECOVERY_GAP = 0.05  # within this of the expert within 2 cycles after an event


def success(day: dict, policy: str) -> float | None:
    figure = (day.get("policies") or {}).get(policy)
    return None if figure is None else figure["success"]


def expert_gap(day: dict) -> float | None:
    production, expert = success(day, "production"), success(day, "expert")
    return None if production is None or expert is None else difference(expert, production)


def difference(a: float, b: float) -> float:
    """a - b for figures given to 4 decimals (k of 300 episodes), to 4 decimals: in binary
    0.97 - 0.92 is 0.05000000000000004, which a limit of 0.05 would wrongly reject."""
    return round(a - b, 4)


def cycle_days(cell: dict) -> list[dict]:
    return [day for day in cell["days"] if (day.get("loop") or {}).get("ran")]


def compute_targets(cells: dict[str, dict], margin: float) -> dict[str, dict]:
    """The issue's targets over the campaign document's cells (see the module docstring)."""
    return {
        "first_cycle_at_least_90": _first_cycle(cells),
        "within_3_points_of_expert_after_3_cycles": _near_expert(cells),
        "drift_detected_on_first_shift_after_event": _drift_after_events(cells),
        "recovery_within_2_cycles": _recovery(cells),
        "no_promotion_worse_than_replaced": _promotions(cells, margin),
        "baselines_fall_behind_after_events": _baselines(cells),
    }


def _verdict(value, met, **extra) -> dict:
    return {"value": value, "met": met, **extra}


def _first_cycle(cells: dict) -> dict:
    figures = {}
    for name, cell in cells.items():
        cycles = cycle_days(cell)
        figures[name] = success(cycles[0], "production") if cycles else None
    known = [v for v in figures.values() if v is not None]
    if len(known) < len(figures):
        return _verdict(min(known, default=None), False, cases=figures)
    return _verdict(min(known), min(known) >= FIRST_CYCLE_FLOOR, cases=figures)


def _near_expert(cells: dict) -> dict:
    """Per cell, the smallest gap to the expert on the days of its first three cycles."""
    gaps = {}
    for name, cell in cells.items():
        known = [g for g in map(expert_gap, cycle_days(cell)[:3]) if g is not None]
        gaps[name] = round(min(known), 4) if known else None
    if any(g is None for g in gaps.values()):
        return _verdict(None, False, cases=gaps)
    worst = max(gaps.values())
    return _verdict(worst, worst <= EXPERT_GAP, cases=gaps)


def _events_in(cell: dict) -> list[tuple[float, str, int]]:
    """(event day, name, the first campaign day on or after it) for events inside the run."""
    last = cell["days"][-1]["day"] if cell["days"] else -1
    return [
        (event["day"], event["name"], math.ceil(event["day"]))
        for event in cell["events"]
        if math.ceil(event["day"]) <= last
    ]


def _day(cell: dict, number: int) -> dict | None:
    return next((day for day in cell["days"] if day["day"] == number), None)


def _drift_after_events(cells: dict) -> dict:
    """Per event: did the first shift after it show the change? Either signal counts, and
    `by` says which: the drift measures, or the part mix (a new part variant is a shift in
    the distribution of parts, which the per-step features of a fine-tuned policy barely see)."""
    cases = []
    for name, cell in cells.items():
        for _, event, first in _events_in(cell):
            day = _day(cell, first) or {}
            by = [
                signal
                for signal, seen in (
                    ("drift", day.get("drift_detected")),
                    ("part mix", (day.get("part_mix") or {}).get("detected")),
                )
                if seen
            ]
            cases.append(
                {"cell": name, "event": event, "day": first, "detected": bool(by), "by": by}
            )
    return _share(cases, "detected")


def _recovery(cells: dict) -> dict:
    """After each event: within the first two cycles on or after its day, a day when the
    production model is within RECOVERY_GAP of the expert."""
    cases = []
    for name, cell in cells.items():
        for _, event, first in _events_in(cell):
            cycles = [day for day in cycle_days(cell) if day["day"] >= first][:2]
            gaps = [g for g in map(expert_gap, cycles) if g is not None]
            cases.append(
                {
                    "cell": name,
                    "event": event,
                    "day": first,
                    "cycles": len(cycles),
                    "best_gap": round(min(gaps), 4) if gaps else None,
                    "recovered": bool(gaps) and min(gaps) <= RECOVERY_GAP,
                }
            )
    return _share(cases, "recovered")


def _share(cases: list[dict], key: str) -> dict:
    if not cases:
        return _verdict(None, None, cases=cases)
    share = sum(case[key] for case in cases) / len(cases)
    return _verdict(round(share, 4), share == 1.0, cases=cases)


def _promotions(cells: dict, margin: float) -> dict:
    cases = [
        {"cell": name, "day": day["day"], **day["promotion"]}
        for name, cell in cells.items()
        for day in cell["days"]
        if day.get("promotion")
    ]
    if not cases:
        return _verdict(None, None, cases=cases)
    worst = min(difference(case["after"], case["before"]) for case in cases)
    return _verdict(worst, worst >= -margin, cases=cases)


def _baselines(cells: dict) -> dict:
    """Each baseline's mean before the first event and after it, and production's lead over
    it after; met when both baselines lose ground after the events and production leads."""
    per_policy = {}
    for policy in ("sim", "calibrated_once"):
        before, after, lead = [], [], []
        for cell in cells.values():
            first = min((ceil for _, _, ceil in _events_in(cell)), default=None)
            if first is None:
                continue
            for day in cell["days"]:
                value = success(day, policy)
                if value is None:
                    continue
                (before if day["day"] < first else after).append(value)
                if day["day"] >= first and success(day, "production") is not None:
                    lead.append(success(day, "production") - value)
        per_policy[policy] = {
            "before_events": _mean(before),
            "after_events": _mean(after),
            "production_lead_after": _mean(lead),
        }
    known = [p for p in per_policy.values() if None not in p.values()]
    if len(known) < len(per_policy):
        return _verdict(None, None, cases=per_policy)
    met = all(
        p["after_events"] < p["before_events"] and p["production_lead_after"] > 0 for p in known
    )
    return _verdict(min(p["production_lead_after"] for p in known), met, cases=per_policy)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


# --- the figure, the table, MLflow -----------------------------------------------------------


def plot_campaign(cells: dict[str, dict], out: Path) -> Path:
    """One panel per cell: held-out success over days per policy (bars: the seeds' range),
    event days as labelled vertical lines, promotions as stars on the production line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(cells), 1, figsize=(10, 3.6 * len(cells)), squeeze=False)
    for ax, (name, cell) in zip(axes[:, 0], cells.items(), strict=True):
        for policy in (*POLICIES[1:], POLICIES[0]):  # production last: on top where they meet
            rows = [
                (d["day"], d["policies"][policy])
                for d in cell["days"]
                if (d.get("policies") or {}).get(policy)
            ]
            if not rows:
                continue
            days = [day for day, _ in rows]
            mean = [f["success"] for _, f in rows]
            spread = [
                [f["success"] - f["min"] for _, f in rows],
                [f["max"] - f["success"] for _, f in rows],
            ]
            width = 2.4 if policy == "production" else 1.2
            ax.errorbar(
                days, mean, yerr=spread, marker="o", ms=3, capsize=2, lw=width, label=LABELS[policy]
            )
        for day, event, _ in _events_in(cell):
            ax.axvline(day, color="grey", ls="--", lw=0.8)
            ax.text(day, 0.02, f" {event}", rotation=90, fontsize=7, va="bottom", color="grey")
        promoted = [(d["day"], success(d, "production")) for d in cell["days"] if d.get("promoted")]
        if promoted:
            ax.plot(*zip(*promoted, strict=True), "k*", ms=11, label="promotion")
        ax.set_title(f"{name}: held-out success by day")
        ax.set_xlabel("line day")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("success")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def print_campaign(document: dict) -> None:
    from rich.table import Table

    from flows.console import stdout
    from flows.cycle import prescreen_lines

    for name, cell in document["cells"].items():
        table = Table(title=f"{name}: held-out success by day (mean over seeds)")
        for column in ("day", "events", "drift", "loop", *POLICIES):
            table.add_column(column)
        for day in cell["days"]:
            loop = day.get("loop") or {}
            table.add_row(
                str(day["day"]),
                "; ".join(day.get("new_events") or []) or "",
                {None: "-", True: "yes", False: "no"}[day.get("drift_detected")],
                (loop.get("outcome") or "ran") if loop.get("ran") else "",
                *[_percent(success(day, policy)) for policy in POLICIES],
            )
        stdout.print(table)
        stdout.print(f"final policy: {cell['final_policy']}", soft_wrap=True, highlight=False)
    for target, verdict in document["targets"].items():
        met = {True: "met", False: "NOT met", None: "no case"}[verdict["met"]]
        stdout.print(f"target {target}: {met} (value {verdict['value']})", highlight=False)
    for line in prescreen_lines(document.get("prescreen_correlation")):
        stdout.print(line, highlight=False)
    stdout.print(f"campaign.json: {document['files']['json']}", soft_wrap=True, highlight=False)
    stdout.print(f"campaign.png: {document['files']['png']}", soft_wrap=True, highlight=False)
    stdout.print(f"wall time: {document['wall_s'] / 60:.1f} min", highlight=False)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def log_to_mlflow(workspace: Path, document: dict, files: list[Path]) -> str:
    """One run in the `realloop-campaign` experiment: the settings as params, each cell's
    daily figures as metrics (step = day), the targets, and the JSON and PNG as artifacts."""
    import time

    from mlflow.entities import Metric, Param

    from pipelines.training.tracking import ensure_experiment, mlflow_client

    client = mlflow_client(workspace)
    settings = document["settings"]
    run = client.create_run(
        ensure_experiment(client, workspace, EXPERIMENT),
        run_name=f"campaign {len(document['cells'])} cells x {settings['days']} days",
        tags={"mlflow.note.content": "realloop campaign: the fleet over simulated days"},
    )
    run_id, status, now = run.info.run_id, "FAILED", int(time.time() * 1000)
    try:
        metrics = [
            Metric(f"{name}.{policy}", success(day, policy), now, day["day"])
            for name, cell in document["cells"].items()
            for day in cell["days"]
            for policy in POLICIES
            if success(day, policy) is not None
        ]
        metrics += [
            Metric(f"target.{target}", float(v["value"]), now, 0)
            for target, v in document["targets"].items()
            if isinstance(v["value"], int | float)
        ]
        rho = (document.get("prescreen_correlation") or {}).get("rho")
        if rho is not None:
            metrics.append(Metric("prescreen_spearman_rho", rho, now, 0))
        params = [Param(key, json.dumps(value)) for key, value in settings.items()]
        client.log_batch(run_id, params=params)
        for start in range(0, len(metrics), 900):  # MLflow takes at most 1,000 per batch
            client.log_batch(run_id, metrics=metrics[start : start + 900])
        for path in files:
            client.log_artifact(run_id, str(path))
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status)
    return run_id
