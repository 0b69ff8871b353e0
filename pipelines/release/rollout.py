"""Staged rollout: a model promoted on the canary cell reaches the rest of the fleet only after
the canary's health window passed, judged from the canary's own uploaded logs.

The window is the first production episodes (no trial request) that the canary ran with the
promoted bundle (`policy_version`), by start time, looked at every `wanted` episodes up to
`most`. At a look it passes when its success rate is not below the lower end of the
candidate's trial interval (the gate's record, the floor). Below the floor, it fails when a
one-sided exact binomial test says the model is below it (p < `alpha`), or at the last look;
otherwise it grows to the next look: 20 episodes cannot tell a model a little above its floor
from one well below it (docs/benchmarks.md, "The health window"). It fails at once at a safety
stop, or when the floor can no longer be reached by the last look.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from scipy.stats import binomtest

from pipelines.contract.schema import EPISODES_SCHEMA

PASSED, FAILED, OPEN = "passed", "failed", "open"
HEALTH_ALPHA = 0.05  # an early failure needs the window significantly below the floor
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
    wanted: int  # episodes between looks (edge.health_episodes)
    episodes: int  # of the window seen so far
    successes: int
    safety_stops: int
    floor: float | None  # the lowest success rate that passes: the trial interval's lower end
    reason: str  # in words a reviewer can check against the episodes table
    most: int | None = None  # the longest window (edge.health_max_episodes); None: `wanted`

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


def judge_window(
    episodes: pa.Table, wanted: int, floor: float, most: int | None = None
) -> HealthWindow:
    """The window over the first `most` of `episodes` (earliest first, as
    production_episodes returns them), decided at the first look that decides, as the box
    decides it episode by episode."""
    most = most or wanted
    looks = [*range(wanted, most, wanted), most] if wanted >= 1 else [0]
    for end in [min(look, episodes.num_rows) for look in looks]:
        window = episodes.slice(0, end)
        successes = int(pc.sum(window.column("success")).as_py() or 0)
        stops = int(pc.sum(window.column("safety_stops")).as_py() or 0)
        judged = judge_counts(end, successes, stops, wanted, floor, most)
        if judged.state != OPEN or end == episodes.num_rows:
            break
    return judged


def judge_counts(
    episodes: int,
    successes: int,
    safety_stops: int,
    wanted: int,
    floor: float | None,
    most: int | None = None,
    alpha: float = HEALTH_ALPHA,
) -> HealthWindow:
    """The health rule on a window's counts so far (the orchestrator's from the logs, the box's
    as its episodes finish), looked at every `wanted` episodes up to `most` (None: one look).
    Failed at the first safety stop, or once `floor` (None: no trial interval, safety stops
    only) can no longer be reached by the last look. At a look: passed at or above the floor;
    below it, failed at the last look or when significantly below (exact binomial, one-sided,
    p < `alpha`), else open until the next look."""
    most = most or wanted
    if wanted < 1 or most < wanted:
        raise ValueError(f"health window: looks of {wanted} up to {most} episodes")
    if floor is None:
        most = wanted  # safety stops only: one look
    low = 0.0 if floor is None else floor
    needed = math.ceil(low * episodes - 1e-9)  # at or above the floor now
    bar = "no trial interval" if floor is None else f"trial lower bound {floor:.3f}"
    look = min(max(math.ceil(episodes / wanted), 1) * wanted, most)  # the look it is in
    seen = (
        f"{successes}/{episodes} successes, {safety_stops} safety stops in {episodes} of "
        f"{look} episodes"
    )
    at_look = episodes >= most or (episodes > 0 and episodes % wanted == 0)
    last_needed = math.ceil(low * most - 1e-9)  # by the last look
    unreachable = successes + (most - episodes) < last_needed
    if safety_stops:
        state, why = FAILED, f"{safety_stops} safety stops (0 allowed)"
    elif at_look and successes >= needed:
        state, why = PASSED, f"success {successes / episodes:.3f} >= {bar}"
    elif episodes >= most:
        state, why = FAILED, f"success {successes / episodes:.3f} < {bar}"
    elif unreachable:
        state, why = FAILED, f"{last_needed} of {most} successes needed, no longer reachable"
    elif not at_look:
        state, why = OPEN, f"{last_needed} of {most} successes needed by the last look"
    else:
        p = binomtest(successes, episodes, low, alternative="less").pvalue
        below = p < alpha
        state = FAILED if below else OPEN
        why = f"success {successes / episodes:.3f} < {bar}, " + (
            f"significantly (p {p:.3f} < {alpha})"
            if below
            else f"not significantly (p {p:.3f}): watching to {min(episodes + wanted, most)}"
        )
    reason = f"health window {state}: {seen}; {why}"
    return HealthWindow(state, wanted, episodes, successes, safety_stops, floor, reason, most)


def check_health(
    dataset: Path,
    cell_id: str,
    policy_version: str,
    wanted: int,
    floor: float,
    most: int | None = None,
) -> HealthWindow:
    """The canary's window as the episodes table has it now."""
    episodes = production_episodes(dataset, cell_id, policy_version)
    return judge_window(episodes, wanted, floor, most)
