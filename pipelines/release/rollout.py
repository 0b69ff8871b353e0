"""Staged rollout: a model promoted on the canary cell reaches the rest of the fleet only after
the canary's health window passed, judged from the canary's own uploaded logs.

The window is the first `wanted` production episodes (no trial request) that the canary ran
with the promoted bundle (`policy_version`), by start time. It passes when it is whole, holds
no safety stop, and its success rate is not below the lower end of the candidate's trial
interval (the gate's record). It fails as soon as a safety stop shows up or the floor can no
longer be reached; until then it stays open.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from pipelines.contract.schema import EPISODES_SCHEMA

PASSED, FAILED, OPEN = "passed", "failed", "open"
# What the window needs of each episode: one narrow scan of the episodes files per poll.
_SCAN_COLUMNS = (
    "episode_id",
    "cell_id",
    "policy_version",
    "start_time",
    "success",
    "safety_stops",
    "trial_request_id",
)


@dataclass(frozen=True)
class HealthWindow:
    """What the canary's first production episodes with the new version showed."""

    state: str  # PASSED, FAILED or OPEN
    wanted: int  # episodes in a whole window (edge.health_episodes)
    episodes: int  # of the window seen so far
    successes: int
    safety_stops: int
    floor: float | None  # the lowest success rate that passes: the trial interval's lower end
    reason: str  # in words a reviewer can check against the episodes table

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.episodes if self.episodes else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"success_rate": self.success_rate}


def production_episodes(dataset: Path, cell_id: str, policy_version: str) -> pa.Table:
    """The cell's ingested production episodes run by `policy_version`, earliest first, each
    episode once (a re-uploaded log carries the same episodes again)."""
    schema = pa.schema([EPISODES_SCHEMA.field(name) for name in _SCAN_COLUMNS])
    files = sorted(str(p) for p in (Path(dataset) / "episodes").glob("*.parquet"))
    if not files:
        return schema.empty_table()
    chosen = (
        ds.dataset(files, schema=schema, format="parquet")
        .to_table(
            filter=(pc.field("cell_id") == cell_id)
            & (pc.field("policy_version") == policy_version)
            & pc.field("trial_request_id").is_null()
        )
        .sort_by([("start_time", "ascending"), ("episode_id", "ascending")])
    )
    ids = chosen.column("episode_id").to_pylist()
    first = [ids.index(episode) for episode in dict.fromkeys(ids)]
    return chosen.take(pa.array(first, pa.int64()))


def trial_floor(gate_record: dict[str, Any]) -> float:
    """The lower end of the candidate's trial interval, from the gate's record."""
    try:
        return float(gate_record["candidate"]["interval"][0])
    except (KeyError, IndexError, TypeError):
        raise ValueError(
            "gate record: no candidate trial interval ('candidate.interval'); "
            "a health window needs the candidate's trial statistics"
        ) from None


def judge_window(episodes: pa.Table, wanted: int, floor: float) -> HealthWindow:
    """The window over the first `wanted` of `episodes` (earliest first, as
    production_episodes returns them)."""
    window = episodes.slice(0, max(wanted, 0))
    successes = int(pc.sum(window.column("success")).as_py() or 0)
    stops = int(pc.sum(window.column("safety_stops")).as_py() or 0)
    return judge_counts(window.num_rows, successes, stops, wanted, floor)


def judge_counts(
    episodes: int, successes: int, safety_stops: int, wanted: int, floor: float | None
) -> HealthWindow:
    """The health rule on a window's counts so far (the orchestrator's from the logs, the box's
    as its episodes finish): failed at the first safety stop or once `floor` (None: no trial
    interval, safety stops only) can no longer be reached; passed when whole and at or above it."""
    if wanted < 1:
        raise ValueError(f"health window: {wanted} episodes; it needs at least one")
    needed = 0 if floor is None else math.ceil(floor * wanted - 1e-9)  # a whole window's
    bar = "no trial interval" if floor is None else f"trial lower bound {floor:.3f}"
    seen = (
        f"{successes}/{episodes} successes, {safety_stops} safety stops in {episodes} of "
        f"{wanted} episodes"
    )
    if safety_stops:
        state, why = FAILED, f"{safety_stops} safety stops (0 allowed)"
    elif episodes >= wanted:
        ok = successes >= needed
        state = PASSED if ok else FAILED
        why = f"success {successes / episodes:.3f} {'>=' if ok else '<'} {bar}"
    elif successes + (wanted - episodes) < needed:
        state, why = FAILED, f"{needed} of {wanted} successes needed, no longer reachable"
    else:
        state, why = OPEN, f"{needed} of {wanted} successes needed"
    reason = f"health window {state}: {seen}; {why}"
    return HealthWindow(state, wanted, episodes, successes, safety_stops, floor, reason)


def check_health(
    dataset: Path, cell_id: str, policy_version: str, wanted: int, floor: float
) -> HealthWindow:
    """The canary's window as the episodes table has it now."""
    return judge_window(production_episodes(dataset, cell_id, policy_version), wanted, floor)
