"""`realloop campaign`: the fleet over simulated days while each cell's line changes.

Reference cells run as processes (`realloop cell run`) in a workspace of their own, each on its
own line with its dated events (camera knocked, new part variant, drive wear, winter light).
Production shifts start at fixed times of the line's day (`campaign.shifts_per_day`) and the
cell clock runs at most `campaign.speed` times the wall (a day in 86,400 / speed wall seconds),
and no further than the campaign lets it: each line is held at noon of the day the campaign
works on (flows.campaign_days.hold_line), so a slow loop slows the line's days instead of
letting the line run ahead of the figures that judge it. After each day's shifts have landed, the
campaign ingests them and, per cell, compares the day's shift with the day before's (drift,
new edge cases); the loop (`loop_flow`, as a black box) runs for the cells that triggered, once
more the day after a cycle that answered a change promoted nothing, and for any cell whose
last cycle is `campaign.floor_days` old (the cron's floor). Then every
cell's production model (the active release on its box), the frozen sim policy, a policy
calibrated once on the first day's shift and the privileged expert are evaluated on the line as
it is that day, on held-out seeds (flows.campaign_eval). `campaign.json`, `campaign.png` and one
MLflow run (experiment `realloop-campaign`) report it, with the issue's targets computed.

The workspace (`--workspace`, default `.realloop/campaign`) must be new: the cells' line day 0
is the first time they run there.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml

if TYPE_CHECKING:
    from flows.campaign_days import DayLedger

from flows.campaign_eval import (
    CACHE_FILE,
    EVAL_NICENESS,
    EXPERT,
    DayFigures,
    EvalCache,
    EvalJob,
    cell_timeline,
    events_on_day,
    fill_day,
    snapshot_production,
)
from flows.console import CommandError, emit, fails_cleanly, progress_bar, stderr

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="the whole campaign document on stdout")]
CAMPAIGN_DIR = Path(".realloop/campaign")
ACTIVATION_TIMEOUT_S = 120.0  # a promoted model not active on its box by then: evaluated anyway
POLL_S = 3.0  # wall seconds between looks at the landing zone while a day's shifts land


@dataclass
class Campaign:
    """The running campaign: where it lives, its cells and what it has recorded so far."""

    root: Path
    params_path: Path  # the campaign's own params.yaml in `root`
    params: object  # pipelines.contract.params.Params
    cells: list[str]
    days: int
    seed: int
    timelines: dict[str, list[dict]] = field(default_factory=dict)
    records: dict[str, dict] = field(default_factory=dict)
    last_cycle: dict[str, int] = field(default_factory=dict)
    retry_on: dict[str, int] = field(default_factory=dict)  # cell → day its loop runs again
    calibrated: dict[str, str] = field(default_factory=dict)  # cell → calibrated-once folder
    calibration_errors: dict[str, str] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def settings(self):
        return self.params.campaign

    @property
    def day_wall_s(self) -> float:
        return 86_400.0 / self.settings.speed

    def box(self, cell: str) -> Path:
        return self.root / "boxes" / cell


@fails_cleanly
def campaign_command(
    cells: Annotated[
        int | None, typer.Option("--cells", min=1, help="the first N of campaign.cells")
    ] = None,
    days: Annotated[
        int | None, typer.Option("--days", min=1, help="simulated days (campaign.days)")
    ] = None,
    workspace: Annotated[
        Path | None, typer.Option(help="a new folder for the campaign (default .realloop/campaign)")
    ] = None,
    seed: Annotated[int, typer.Option(help="the cells' episode draws (held-out seeds apart)")] = 0,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Run the fleet for N simulated days as the lines change; report held-out success per
    cell and day (production, frozen sim, calibrated once, expert) in campaign.json/.png."""
    from pipelines.contract.params import load_params

    started = time.monotonic()
    params = load_params(params_path)
    chosen = list(params.campaign.cells[: cells or len(params.campaign.cells)])
    if cells and cells > len(params.campaign.cells):
        raise CommandError(
            f"--cells {cells}: campaign.cells in {params_path} lists {len(chosen)}; add more"
        )
    root = (workspace or CAMPAIGN_DIR).resolve()
    _refuse_used(root)
    campaign = _prepare(Path(params_path).resolve(), root, chosen, days or params.campaign.days)
    campaign.seed = seed
    with _inside(root):
        document = run_campaign(campaign, progress=not as_json)
    document["wall_s"] = round(time.monotonic() - started, 1)
    _write_json(Path(document["files"]["json"]), document)
    emit(document, as_json, _print)


def _print(document: dict) -> None:
    from flows.campaign_report import print_campaign

    print_campaign(document)


# --- the workspace ---------------------------------------------------------------------------


def _refuse_used(root: Path) -> None:
    if (root / "params.yaml").exists() or (root / "boxes").exists():
        raise CommandError(
            f"{root}: already holds a campaign (its cells' days began there); pass a new "
            "--workspace or remove that folder"
        )


def _prepare(params_path: Path, root: Path, cells: list[str], days: int) -> Campaign:
    """The workspace: the sim policy copied in (when this folder has one), the campaign's
    params.yaml (its fleet, trial size, one torch thread beside the cells)."""
    from pipelines.contract.params import load_params

    root.mkdir(parents=True, exist_ok=True)
    document = yaml.safe_load(params_path.read_text())
    settings = document["campaign"]
    document["fleet"]["cells"] = cells
    document["campaign"] |= {"cells": cells, "days": days}
    document["trials"] |= {
        "max_episodes": settings["trial_episodes"],
        "poll_s": settings["poll_s"],
        "timeout_s": settings["trial_timeout_s"],
    }
    document["train"]["threads"] = 1  # the cells run on the same cores (flows/demo.py says why)
    out = root / "params.yaml"
    out.write_text("# written by `realloop campaign` from params.yaml\n" + yaml.safe_dump(document))
    params = load_params(out)
    sim_policy = Path(params.pretrain.out)
    if (sim_policy / "config.json").is_file() and not (root / sim_policy).exists():
        shutil.copytree(sim_policy, root / sim_policy)
    return Campaign(root, out, params, cells, days, 0)


@contextmanager
def _inside(root: Path):
    """The campaign's workspace as the current folder: params paths are relative to it."""
    import os

    from flows.commands import _workspace

    here = Path.cwd()
    os.chdir(root)
    try:
        _workspace()
        yield
    finally:
        os.chdir(here)


# --- the campaign ----------------------------------------------------------------------------


def run_campaign(campaign: Campaign, progress: bool = True) -> dict:
    """Set up the fleet, run the days with the cells as processes, report."""
    from flows.demo import _keys_folder, _realloop, deploy_initial

    params = campaign.params
    if not (Path(params.pretrain.out) / "config.json").is_file():
        stderr.print("campaign: pretraining the sim policy (BC + DAgger in the randomized sim)")
        _realloop("cell", "pretrain", "--params", str(campaign.params_path), quiet=False)
    for cell in campaign.cells:
        deploy_initial(campaign.params_path, params.pretrain.out, cell)
        campaign.timelines[cell] = cell_timeline(cell)
        campaign.records[cell] = {"world": cell, "events": campaign.timelines[cell], "days": []}
    root_json = _keys_folder(params) / "root.json"
    cache = EvalCache(
        campaign.root / CACHE_FILE,
        campaign.params_path,
        campaign.settings.eval_episodes,
        campaign.settings.eval_seeds,
        campaign.settings.eval_workers,
        niceness=EVAL_NICENESS,
    )
    from flows.campaign_days import DayLedger

    with _running_cells(campaign, root_json), DayFigures(cache) as figures:
        ledger = DayLedger(campaign.root, params, _wait_for_epochs(campaign))
        calibration = None
        with progress_bar(progress) as update:
            for day in range(campaign.days):
                update("campaign days", day, campaign.days)
                _wait_for_day(campaign, ledger, day)
                _one_day(campaign, ledger, figures, day)
                if day == 0:
                    calibration = _start_calibrated_once(campaign, ledger)
                figures.collect()  # the days evaluated so far, for the document below
                # So far, for whoever watches a long campaign (the final document replaces it).
                _write_json(
                    campaign.root / "campaign.json",
                    {"complete": False, "days_done": day + 1, "cells": campaign.records},
                )
            figures.collect(wait=True)
            update("campaign days", campaign.days, campaign.days)
    if calibration is not None:
        calibration.join()
    _fill_calibrated_once(campaign, cache)
    return _document(campaign, cache)


@contextmanager
def _running_cells(campaign: Campaign, root_json: Path):
    from flows.console import stopped_like_ctrl_c
    from flows.demo import Fleet, stop_cells

    fleet = Fleet(str(campaign.root / campaign.params.ingest.landing), "", campaign.cells)
    with stopped_like_ctrl_c():  # a killed campaign stops its cells too
        try:
            for index, cell in enumerate(campaign.cells):
                fleet.processes[cell] = _start_cell(campaign, cell, root_json, index)
            campaign.processes = fleet.processes
            yield
        finally:
            stop_cells(fleet)


def _start_cell(campaign: Campaign, cell: str, root_json: Path, index: int) -> subprocess.Popen:
    from flows.campaign_days import HOLD_FILE, hold_line

    settings, params = campaign.settings, campaign.params
    box = campaign.box(cell)
    box.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "flows.cli", "cell", "run", "--cell-id", cell]
    command += ["--world", cell, "--channel", params.promote.channel]
    command += ["--landing", str(campaign.root / params.ingest.landing), "--box", str(box)]
    command += ["--episodes-per-shift", str(settings.episodes_per_shift)]
    command += ["--speed", str(settings.speed), "--seed", str(campaign.seed + 1000 + index)]
    command += ["--shifts-per-day", str(settings.shifts_per_day), "--no-ground-truth"]
    hold_line(box, 0)
    command += ["--hold-file", str(box / HOLD_FILE)]
    command += ["--root", str(root_json), "--params", str(campaign.params_path)]
    log = campaign.root / "logs" / f"{cell}.log"
    log.parent.mkdir(exist_ok=True)
    stderr.print(f"campaign: {cell} started (log: {log})")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("a"))


def _check_alive(campaign: Campaign) -> None:
    for cell, process in campaign.processes.items():
        if process.poll() is not None:
            raise CommandError(f"cell {cell} exited ({process.returncode}); see its log")


def _wait_for_epochs(campaign: Campaign, timeout_s: float = 120.0) -> dict[str, int]:
    """Each cell's line day 0, as its box recorded it when the cell came up."""
    from flows.campaign_days import read_epoch

    deadline = time.monotonic() + timeout_s
    while True:
        epochs = {cell: read_epoch(campaign.box(cell)) for cell in campaign.cells}
        if all(epoch is not None for epoch in epochs.values()):
            return epochs
        _check_alive(campaign)
        if time.monotonic() > deadline:
            raise CommandError(
                f"cells {sorted(c for c, e in epochs.items() if e is None)} "
                f"did not start their line in {timeout_s:.0f} s; see their logs"
            )
        time.sleep(1.0)


def _wait_for_day(campaign: Campaign, ledger: DayLedger, day: int) -> None:
    """Until every cell's production shifts of `day` are ingested (ingest when the landing
    zone changed). Trials take a share of a shift's episodes: a shift is whole by all of
    them, not by its production episodes."""
    from edge.channels import open_channel
    from flows.ingest import ingest_flow

    settings = campaign.settings
    landing = open_channel(str(campaign.root / campaign.params.ingest.landing))
    deadline = time.monotonic() + campaign.day_wall_s + settings.day_timeout_s
    seen: list[str] = []
    while True:
        ledger.refresh()
        waiting = [
            c
            for c in campaign.cells
            if not ledger.day_done(c, day, settings.episodes_per_shift, settings.shifts_per_day)
        ]
        if not waiting:
            return
        _check_alive(campaign)
        if time.monotonic() > deadline:
            raise CommandError(f"day {day}: no whole shift from {waiting} in time; see their logs")
        keys = landing.list("")
        if keys != seen:
            seen = keys
            ingest_flow(str(campaign.params_path), str(campaign.root))
        else:
            time.sleep(POLL_S)


def _one_day(campaign: Campaign, ledger: DayLedger, figures: DayFigures, day: int) -> None:
    """Drift and triggers, the loop where due, then the day's held-out figures per cell (in
    the background: DayFigures)."""
    from flows.campaign_days import hold_line

    rows = {cell: _day_row(campaign, ledger, cell, day) for cell in campaign.cells}
    before = {cell: snapshot_production(campaign.box(cell), _store(campaign)) for cell in rows}
    _loop_where_due(campaign, rows, day)
    for cell in campaign.cells:  # the next day's shifts record while today's figures are made
        hold_line(campaign.box(cell), day + 1)
    jobs: dict[tuple[str, str], EvalJob] = {}  # (cell, what) → its evaluation
    for cell, row in rows.items():
        folder, active = snapshot_production(campaign.box(cell), _store(campaign))
        row["production_model"] = {"policy": str(folder), "model_version": active["model_version"]}
        policies = _policies(campaign, cell, str(folder))
        if row["promoted"]:
            policies["replaced"] = str(before[cell][0])
        events = tuple(events_on_day(campaign.timelines[cell], day))
        row["policies"] = {name: None for name in policies}  # None: not there yet, or pending
        jobs |= {
            (cell, name): EvalJob(policy, cell, day, events)
            for name, policy in policies.items()
            if policy is not None
        }
        campaign.records[cell]["days"].append(row)
    # Every cell's figures of the day at once, `campaign.eval_workers` at a time.
    figures.submit(list(jobs.values()), lambda found: fill_day(rows, list(jobs), found, before))


def _loop_where_due(campaign: Campaign, rows: dict[str, dict], day: int) -> None:
    """The loop for the cells whose row has a trigger; each promoted model active on its box
    before the line moves on (the next day's shift must run it). A cycle that answered a
    change and promoted nothing is due again tomorrow (flows.campaign_days.CHANGE_TRIGGERS)."""
    from flows.campaign_days import answers_a_change

    due = [cell for cell, row in rows.items() if row["trigger"]]
    if due:
        for summary_row in _run_loop(campaign, due):
            rows[summary_row["cell"]]["loop"] = {"ran": True, **summary_row}
            campaign.last_cycle[summary_row["cell"]] = day
    for cell, row in rows.items():
        row.setdefault("loop", {"ran": False})
        promoted = row["loop"].get("promoted_version")
        row["promoted"] = promoted is not None
        if promoted is not None:
            _wait_for_activation(campaign.box(cell), promoted)
        elif row["loop"]["ran"] and answers_a_change(row["trigger"]):
            campaign.retry_on[cell] = day + 1  # once: a retry is no change (loop_triggers)


def _store(campaign: Campaign) -> Path:
    return campaign.root / "models" / "production"


def _day_row(campaign: Campaign, ledger: DayLedger, cell: str, day: int) -> dict:
    """What the day's shift says: events applied, drift, and why the loop is due (or not)."""
    from flows.campaign_days import day_drift, line_day_reached, loop_triggers, part_mix_rise

    timeline = campaign.timelines[cell]
    applied = events_on_day(timeline, day)
    drift = day_drift(ledger, cell, day)
    captures = campaign.root / campaign.params.ingest.landing / "captures"
    parts = part_mix_rise(ledger, cell, day, captures)
    last, retry = campaign.last_cycle.get(cell), campaign.retry_on.get(cell) == day
    reasons = loop_triggers(drift, parts, day, last, retry, campaign.settings.floor_days)
    return {
        "day": day,
        "events_applied": applied,
        "new_events": applied[len(events_on_day(timeline, day - 1)) :] if day else applied,
        "shift_episodes": ledger.count(cell, day),  # 0: the cell missed the day's start
        "line_success": ledger.success(cell, day),
        "drift_detected": None if drift is None else drift["detected"],
        "drift": drift,
        "part_mix": parts,
        # Recorded, not triggers (params.yaml): the box's screens.
        "ood_episodes": _captured_episodes(ledger, cell, day, "ood"),
        "novel_part_episodes": _captured_episodes(ledger, cell, day, "novel_part"),
        "trigger": reasons,
        # Where the cell's line is as the campaign takes the day up: held (hold_line), it
        # stays within the day, so the loop's trials meet the line of the day they judge.
        "line_day_at_processing": line_day_reached(campaign.box(cell), ledger.epochs[cell]),
    }


def _captured_episodes(ledger: DayLedger, cell: str, day: int, reason: str) -> int:
    """Episodes of the day's shift with a `reason` capture: `ood` (the box's out-of-distribution
    screen refused a step) or `novel_part` (it handed over an episode for its part). Operator
    takeovers are not counted: a weak policy has them on every episode, every day."""
    if not ledger.count(cell, day):
        return 0
    reasons = ledger.tables(cell, day)[0]["edge_case_reasons"].to_pylist()
    return sum(1 for listed in reasons if listed and reason in listed)


def _run_loop(campaign: Campaign, due: list[str]) -> list[dict]:
    """One loop cycle for the due cells (all at once when all are due); their rows."""
    from flows.demo import _cycle_rows
    from flows.loop import loop_flow

    targets = [None] if len(due) == len(campaign.cells) else due
    rows = []
    for cell in targets:
        summary = loop_flow(
            params_path=str(campaign.params_path), workspace=str(campaign.root), cell=cell
        )
        if not isinstance(summary, dict):  # a Failed state (a full disk): its one line
            raise CommandError(f"the loop failed: {summary.message}")
        rows += [{"cycle": summary["cycle"], **row} for row in _cycle_rows(summary)["cells"]]
    return rows


def _wait_for_activation(box: Path, version) -> None:
    from edge.agent import status
    from edge.errors import EdgeError

    deadline = time.monotonic() + ACTIVATION_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if str(status(box).get("model_version")) == str(version):
                return
        except EdgeError:
            pass
        time.sleep(1.0)
    stderr.print(f"campaign: {box.name} did not activate version {version} in time")


def _policies(campaign: Campaign, cell: str, production: str) -> dict[str, str | None]:
    """What is evaluated on a cell each day (None: not there yet)."""
    return {
        "production": production,
        "sim": str(Path(campaign.params.pretrain.out).resolve()),
        "calibrated_once": campaign.calibrated.get(cell),
        "expert": EXPERT,
    }


# --- the policy calibrated once --------------------------------------------------------------


def _start_calibrated_once(campaign: Campaign, ledger: DayLedger) -> threading.Thread:
    """Per cell: the policy the loop's first cycle pretrained in the sim it calibrated from
    the first day's shift, copied and frozen (the same data and settings as below would give
    the same policy); or, where the loop built none, calibrate the sim from the first day's
    shift here and, in the background one cell after another, pretrain in it (`realloop cell
    pretrain --calibration`, a process of its own). Never again after."""
    calibrations = {}
    for cell in campaign.cells:
        if _adopt_loop_calibration(campaign, cell):
            continue
        try:
            calibrations[cell] = _calibrate(campaign, cell, ledger.tables(cell, 0))
        except (ValueError, OSError) as exc:  # what one shift cannot support: said, not fatal
            campaign.calibration_errors[cell] = str(exc).splitlines()[0]
    thread = threading.Thread(
        target=_pretrain_all, args=(campaign, calibrations), name="calibrated-once", daemon=True
    )
    thread.start()
    return thread


def _adopt_loop_calibration(campaign: Campaign, cell: str) -> bool:
    """The loop's first calibrated policy for `cell` as its calibrated-once policy, if the
    first cycle made one."""
    from pipelines.calibrate.cache import current_calibration
    from pipelines.training.calibrated import cell_folder

    first = current_calibration(cell_folder(campaign.root, cell))
    if first is None or not first.pretrained:
        return False
    out = campaign.root / "models" / "calibrated-once" / cell
    shutil.copytree(first.policy, out)
    (campaign.root / "calibrations").mkdir(exist_ok=True)
    shutil.copy2(first.path, campaign.root / "calibrations" / f"{cell}.yaml")
    campaign.calibrated[cell] = str(out)
    return True


def _pretrain_all(campaign: Campaign, calibrations: dict[str, Path]) -> None:
    from flows.demo import _realloop

    for cell, calibration in calibrations.items():
        out = campaign.root / "models" / "calibrated-once" / cell
        try:
            _realloop(
                "cell",
                "pretrain",
                "--calibration",
                str(calibration),
                "--out",
                str(out),
                "--params",
                str(campaign.params_path),
                "--json",
            )
            campaign.calibrated[cell] = str(out)
        except CommandError as exc:
            campaign.calibration_errors[cell] = str(exc)


def _calibrate(campaign: Campaign, cell: str, tables) -> Path:
    """sim-calibration.yaml from one cell's first-day shift (pipelines.calibrate)."""
    from flows.plugins import load_simulator
    from pipelines.calibrate import calibrate, write_calibration

    params = campaign.params
    simulator, sim_world = load_simulator(params)
    calibration, _ = calibrate(*tables, simulator, sim_world, params.cell, params.calibrate)
    provenance = {"cell": cell, "day": 0, "episodes": tables[0].num_rows}
    out = campaign.root / "calibrations" / f"{cell}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_calibration(calibration, out, provenance)


def _fill_calibrated_once(campaign: Campaign, cache: EvalCache) -> None:
    """The days before the calibrated-once policy was ready: evaluated now (same line state,
    same seeds: the figure is what it would have been that day)."""
    missing = [
        (row, EvalJob(folder, cell, row["day"], tuple(row["events_applied"])))
        for cell, record in campaign.records.items()
        if (folder := campaign.calibrated.get(cell))
        for row in record["days"]
        if row["policies"].get("calibrated_once") is None
    ]
    figures = cache.evaluate_many([job for _, job in missing])
    for (row, _), figure in zip(missing, figures, strict=True):
        row["policies"]["calibrated_once"] = figure


# --- the document ----------------------------------------------------------------------------


def _document(campaign: Campaign, cache: EvalCache) -> dict:
    from flows.campaign_report import compute_targets, log_to_mlflow, plot_campaign
    from flows.cycle import prescreen_record

    cells = {}
    for cell, record in campaign.records.items():
        days = record["days"]
        cells[cell] = {
            **record,
            "loop_runs": sum(1 for d in days if d["loop"]["ran"]),
            "promotions": sum(1 for d in days if d["promoted"]),
            "final_policy": days[-1]["production_model"]["policy"] if days else None,
            "calibrated_once_policy": campaign.calibrated.get(cell),
            "calibration_error": campaign.calibration_errors.get(cell),
        }
    json_path, png_path = campaign.root / "campaign.json", campaign.root / "campaign.png"
    document = {
        "complete": True,
        "settings": dataclasses.asdict(campaign.settings) | {"seed": campaign.seed},
        "workspace": str(campaign.root),
        "cells": cells,
        "targets": compute_targets(cells, campaign.params.gate.margin),
        # Over every cycle of the campaign: did the trialled candidate's pre-screen score
        # rank the trials' success rates (Spearman)?
        "prescreen_correlation": prescreen_record(campaign.root, {}),
        "eval_cache": {"hits": cache.hits, "misses": cache.misses, "file": str(cache.path)},
        "files": {"json": str(json_path), "png": str(png_path)},
    }
    plot_campaign(cells, png_path)
    _write_json(json_path, document)
    document["mlflow_run_id"] = log_to_mlflow(campaign.root, document, [json_path, png_path])
    return document


def _write_json(path: Path, document: dict) -> None:
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(json.dumps(document, indent=2, default=str) + "\n")
    temp.replace(path)
