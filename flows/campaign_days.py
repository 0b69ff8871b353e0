"""The campaign's days, read from storage: which production episodes each cell recorded on
which day of its line, and whether a day's shift drifted from the day before.

A cell's line day 0 begins when its box first ran (the box's `line-epoch.json`, written by the
cell); an episode belongs to the day its shift started on (the shift id in its episode id is the
shift's start), so a shift that runs past midnight stays one day's. Trial episodes are left out:
they are the loop's, and a day's figures are its production. A cell kept busy past a scheduled
start skips that day (refcell.process: missed starts are taken once, late): the day has no
shift, and a later day's shift says so. Drift compares a day's shift with the
day before's, so a step change in the line (a knocked camera, a new part) shows on the first
shift after it, and a loop that retrained on the old line does not keep re-triggering on it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import Params

DAY_NS = 86_400 * 1_000_000_000
EPOCH_FILE = "line-epoch.json"  # in a cell's box: when its line's day 0 began (refcell writes it)
CLOCK_FILE = "cell-clock.json"  # in a cell's box: the cell time its latest episode reached
HOLD_FILE = "line-hold.json"  # in a cell's box: how far the campaign lets the line run (below)
# The campaign holds each line at noon of the day it works on: that day's shift (from midnight)
# has run, the loop's trials meet that day's line, and the next shift waits for the figures.
HOLD_AT_DAY = 0.5

Tables = tuple[pa.Table, pa.Table]  # (episodes, steps)


def read_epoch(box: Path) -> int | None:
    """A cell's line day 0 (ns since the epoch), or None before its first shift."""
    try:
        return int(json.loads((Path(box) / EPOCH_FILE).read_text())["epoch_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def line_day_reached(box: Path, epoch_ns: int) -> float | None:
    """The line day a cell's latest episode reached, to 0.01 (None before its first)."""
    try:
        cell_ns = int(json.loads((Path(box) / CLOCK_FILE).read_text())["cell_time_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return round((cell_ns - epoch_ns) / DAY_NS, 2)


def hold_line(box: Path, day: int) -> None:
    """Let the cell's line run to noon of `day` and no further (`realloop cell run
    --hold-file`): a slow loop then slows the line's days instead of letting it run ahead,
    so its trials meet the line of the day it works on, and the cells record no shifts that
    nobody reads. Written atomically: the cell reads it while it idles."""
    path = Path(box) / HOLD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(json.dumps({"through_day": day + HOLD_AT_DAY}) + "\n")
    temp.replace(path)


def shift_starts_ns(episode_ids: list[str]) -> np.ndarray:
    """The start of each episode's shift: `<cell>-<shift_id>-<slot>`, the shift id its start
    in UTC seconds (docs/data-contract.md)."""
    from datetime import UTC, datetime

    stamps = [episode_id.rsplit("-", 2)[-2] for episode_id in episode_ids]
    return np.array(
        [
            int(datetime.strptime(s, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()) * 10**9
            for s in stamps
        ],
        dtype=np.int64,
    )


def episode_days(start_ns: np.ndarray, epoch_ns: int) -> np.ndarray:
    return (np.asarray(start_ns, dtype=np.int64) - epoch_ns) // DAY_NS


@dataclass
class DayLedger:
    """Production episodes by (cell, day), read batch by batch as ingest adds them."""

    workspace: Path
    params: Params
    epochs: dict[str, int]
    known: set[str] = field(default_factory=set)
    shifts: dict[tuple[str, int], list[Tables]] = field(default_factory=dict)
    # Every episode, trials included, per (cell, day, shift start): a shift is whole when it
    # holds a shift's worth, whatever share of it the loop's trials took.
    recorded: Counter = field(default_factory=Counter)
    production_shifts: set[tuple[str, int, int]] = field(default_factory=set)

    def refresh(self) -> int:
        """Read the batches the dataset gained since the last look; how many."""
        from pipelines.ingest import current_version, read_dataset, version_sources

        dataset = self.workspace / self.params.ingest.dataset
        if not dataset.with_name(dataset.name + ".dvc").is_file():
            return 0  # nothing ingested yet
        version = current_version(self.workspace, dataset)
        new = sorted(set(version_sources(self.workspace, version)) - self.known)
        if new:
            self._add(*read_dataset(dataset, new))
            self.known |= set(new)
        return len(new)

    def _add(self, episodes: pa.Table, steps: pa.Table) -> None:
        self._count_recorded(episodes)
        production = episodes.filter(pc.is_null(episodes["trial_request_id"]))
        starts = shift_starts_ns(production["episode_id"].to_pylist())
        cells = np.asarray(production["cell_id"].to_pylist())
        for cell, epoch in self.epochs.items():
            days = episode_days(starts, epoch)
            for day in np.unique(days[cells == cell]):
                rows = production.filter(pa.array((cells == cell) & (days == day)))
                day_steps = steps.filter(pc.is_in(steps["episode_id"], rows["episode_id"]))
                self.shifts.setdefault((cell, int(day)), []).append((rows, day_steps))

    def _count_recorded(self, episodes: pa.Table) -> None:
        starts = shift_starts_ns(episodes["episode_id"].to_pylist()).tolist()
        cells = episodes["cell_id"].to_pylist()
        production = pc.is_null(episodes["trial_request_id"]).to_pylist()
        for cell, start, is_production in zip(cells, starts, production, strict=True):
            if cell not in self.epochs:
                continue
            key = (cell, int((start - self.epochs[cell]) // DAY_NS), start)
            self.recorded[key] += 1
            if is_production:
                self.production_shifts.add(key)

    def day_done(self, cell: str, day: int, episodes_per_shift: int, shifts_per_day: int) -> bool:
        """Every production shift of the cell's `day` has landed: as many whole shifts (trial
        episodes count, they took production's place) as the day schedules, or the cell has
        moved on to a later day (shifts run one after another; a day it was kept busy past
        has none)."""
        if any(d > day for d in self.days_with_shifts(cell)):
            return True
        whole = [
            key
            for key in self.production_shifts
            if key[:2] == (cell, day) and self.recorded[key] >= episodes_per_shift
        ]
        return len(whole) >= shifts_per_day

    def days_with_shifts(self, cell: str) -> list[int]:
        return sorted(day for name, day in self.shifts if name == cell)

    def count(self, cell: str, day: int) -> int:
        return sum(rows.num_rows for rows, _ in self.shifts.get((cell, day), []))

    def tables(self, cell: str, day: int) -> Tables:
        parts = self.shifts[(cell, day)]
        return (
            pa.concat_tables([rows for rows, _ in parts]),
            pa.concat_tables([steps for _, steps in parts]),
        )

    def success(self, cell: str, day: int) -> float | None:
        """The day's production success rate on the line (what the operator saw)."""
        if not self.count(cell, day):
            return None
        return float(np.mean(self.tables(cell, day)[0]["success"].to_numpy(zero_copy_only=False)))


def day_drift(ledger: DayLedger, cell: str, day: int) -> dict | None:
    """The day's shift against the latest shift before it (pipelines.quality's drift measures
    and trigger: drifted features, or new edge-case episodes); None without both."""
    from pipelines.quality.drift import detect_drift

    before = [d for d in ledger.days_with_shifts(cell) if d < day]
    if not before or not ledger.count(cell, day):
        return None
    params = ledger.params
    result = detect_drift(
        ledger.tables(cell, before[-1]), ledger.tables(cell, day), params.cell, params.drift
    )
    drifted = len(result.drifted_features) >= params.drift.min_drifted_features
    return {
        "detected": drifted,
        "trigger": result.trigger,
        "drifted_features": result.drifted_features,
        "new_edge_cases": result.new_edge_cases,
        "edge_case_reasons": result.new_edge_case_reasons,
        "reasons": result.reasons,
        "against_day": before[-1],
    }


# The triggers that say the line changed. A cycle that answered one and promoted nothing runs
# again the next day, once, on a day more of the changed line: the first cycle after a change
# holds the change's only shift out for the pre-screen and fine-tunes on the line before it.
# `realloop drift` retries by itself (its baseline is production's training data, so a change
# nothing answered keeps triggering); the campaign's day-to-day drift must be told.
CHANGE_TRIGGERS = ("drift:", "new parts:")


def loop_triggers(
    drift: dict | None,
    parts: dict | None,
    day: int,
    last_cycle: int | None,
    retry: bool,
    floor_days: int,
) -> list[str]:
    """Why the loop runs for a cell on `day` ([]: it does not): the day's drift and part mix
    (day_drift, part_mix_rise), else a retry of yesterday's unanswered change, else the floor."""
    reasons = []
    if drift is not None and drift["detected"]:
        reasons.append(f"drift: {', '.join(drift['drifted_features'])}")
    if parts is not None and parts["detected"]:
        reasons.append(f"new parts: {parts['now']} non-standard, {parts['before']} the day before")
    if not reasons and retry:
        reasons.append(f"retry: day {day - 1}'s cycle answered a change and promoted nothing")
    if not reasons and (last_cycle is None or day - last_cycle >= floor_days):
        reasons.append(
            "floor: no cycle yet" if last_cycle is None else f"floor: last cycle day {last_cycle}"
        )
    return reasons


def answers_a_change(triggers: list[str]) -> bool:
    """The loop ran because the line changed (not the floor, not a retry)."""
    return any(reason.startswith(CHANGE_TRIGGERS) for reason in triggers)


def part_mix_rise(ledger: DayLedger, cell: str, day: int, captures_dir: Path | None) -> dict | None:
    """A new part variant on the line: the share of the day's episodes whose part is not the
    cell's standard one (pipelines.quality.triage.selection, from the captures' snapshots and
    the logged extent) against the latest shift before it, by a one-sided Fisher exact test.
    None without both shifts. `detected` below `campaign.part_mix_p_value`."""
    from scipy.stats import fisher_exact

    from pipelines.quality.triage.selection import novel_part_ids

    before = [d for d in ledger.days_with_shifts(cell) if d < day]
    if not before or not ledger.count(cell, day):
        return None
    counts = []
    for shift_day in (before[-1], day):
        episodes, steps = ledger.tables(cell, shift_day)
        novel = novel_part_ids(episodes, steps, captures_dir, ledger.params.triage)
        counts.append((len(novel), episodes.num_rows))
    (was, was_of), (now, now_of) = counts
    table = [[now, now_of - now], [was, was_of - was]]
    p_value = float(fisher_exact(table, alternative="greater").pvalue)
    return {
        "against_day": before[-1],
        "before": f"{was}/{was_of}",
        "now": f"{now}/{now_of}",
        "p_value": p_value,
        "detected": p_value < ledger.params.campaign.part_mix_p_value,
    }
