"""The promotion gate: a candidate reaches the cell only on hardware-trial evidence.

Three conditions, all required (no gate, no promotion):
- its success rate is convincingly no worse than the incumbent's by more than `gate.margin`:
  the sequential non-inferiority test (pipelines/release/sequential.py) on the interleaved
  trial episodes, both arms' sampling error counted, stopped for efficacy at error rate
  `gate.alpha`; superiority (no margin) is reported beside it, never required;
- zero safety stops in its trials (the first one ends the trials);
- its p95 cycle time is within the cell's budget (the takt), or, on a line the incumbent
  already runs over its takt, it places at least as many of its trial parts within the takt
  as the incumbent does: it does not slow the line. The p95 is over successful episodes,
  so a candidate that places the hard parts the incumbent gives up on has the slower tail
  (campaign, cell-09: 24/24 at p95 5.65 s against 5/24, failed on a 5.50 s budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute

from pipelines.contract.params import GateParams
from pipelines.release.sequential import CONTINUE, EFFICACY, Design, run_looks, score_statistic

SAFETY = "safety"  # a stop of the sequential test: the candidate had a safety stop


@dataclass(frozen=True)
class TrialStats:
    """What N hardware-trial episodes of one policy showed."""

    policy: str
    n: int
    successes: int
    safety_stops: int
    p95_cycle_time_s: float | None  # None: no episode to time
    confidence: float = 0.90  # of the descriptive Wilson interval (two-sided 1 - 2 alpha)

    @classmethod
    def from_episodes(
        cls,
        policy: str,
        success: list[bool],
        safety_stops: int,
        cycle_times_s: list[float],
        confidence: float = 0.90,
    ) -> TrialStats:
        if not success:
            raise ValueError(f"{policy}: no trial episodes to judge")
        p95 = float(np.percentile(cycle_times_s, 95)) if cycle_times_s else None
        return cls(policy, len(success), int(sum(success)), safety_stops, p95, confidence)

    @property
    def success_rate(self) -> float:
        return self.successes / self.n

    @property
    def interval(self) -> tuple[float, float]:
        """Wilson interval of this arm alone: a description; the test is two-arm."""
        from scipy.stats import binomtest  # scipy takes 0.6 s to import; only the gate needs it

        ci = binomtest(self.successes, self.n).proportion_ci(self.confidence, method="wilson")
        return float(ci.low), float(ci.high)

    def as_record(self) -> dict:
        low, high = self.interval
        return {**asdict(self), "success_rate": self.success_rate, "interval": [low, high]}


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reasons: list[str]
    candidate: dict
    incumbent: dict
    cycle_time_budget_s: float
    stopped: str  # efficacy, futility, cap or safety
    episodes_used: int  # per arm
    max_episodes: int  # the cap the request named
    margin: float
    alpha: float
    statistic: float  # non-inferiority score statistic at the deciding look
    bound: float | None  # its efficacy boundary there (None: stopped by a safety stop)
    superiority: dict  # statistic, bound, shown: reported, never required
    # Per arm, the trial parts placed within cycle_time_budget_s (of episodes_used).
    placed_within_budget: dict | None = None

    def as_record(self) -> dict:
        return asdict(self)


def design(gate: GateParams, max_episodes: int) -> Design:
    return Design(gate.alpha, gate.margin, gate.looks, gate.futility_power, max_episodes)


def sequential_stop(
    plan: Design,
    candidate_success: Sequence[bool],
    incumbent_success: Sequence[bool],
    candidate_stops: Sequence[int],
) -> tuple[str, int]:
    """(why the trials stop, episodes per arm used), or (continue, pairs so far), on the
    episodes of each arm in the order they ran. The answer depends only on the episodes, never
    on when someone looked: a look counts once both arms reach its planned size, and a
    candidate safety stop ends the trials at its pair unless a look decided before it."""
    pairs = min(len(candidate_success), len(incumbent_success))
    sizes = plan.look_sizes()
    reached = sizes[sizes <= pairs]
    first_stop = next((i + 1 for i, s in enumerate(candidate_stops[:pairs]) if s), None)
    if len(reached):
        cumulative = [
            np.cumsum(np.asarray(x[:pairs], dtype=int))
            for x in (candidate_success, incumbent_success)
        ]
        looks = run_looks(plan, *(c[reached - 1][None, :] for c in cumulative))
        outcome, used = str(looks.outcome[0]), int(looks.pairs[0])
        if outcome != CONTINUE and (first_stop is None or used < first_stop):
            return outcome, used
    if first_stop is not None:
        return SAFETY, first_stop
    return CONTINUE, pairs


def decide(
    candidate: pa.Table, incumbent: pa.Table, gate: GateParams, max_episodes: int
) -> GateDecision:
    """Apply every condition and say why, pass or fail, in words a reviewer can check. Each
    table is one arm's trial episodes in the order they ran; the sequential test picks how
    many of them count. Raises while the test has not decided yet."""
    plan = design(gate, max_episodes)
    success = [t.column("success").to_pylist() for t in (candidate, incumbent)]
    stops = candidate.column("safety_stops").to_pylist()
    stopped, used = sequential_stop(plan, *success, stops)
    if stopped == CONTINUE:
        raise ValueError(
            f"the sequential test has not decided on {used} episodes per arm "
            f"(looks at {plan.look_sizes().tolist()}); wait for more trial episodes"
        )
    judged = [t.slice(0, used) for t in (candidate, incumbent)]
    arms = [trial_stats(t, 1 - 2 * gate.alpha) for t in judged]
    statistic, bound, superiority = _statistics(plan, arms[0], arms[1], stopped, used)
    budget = gate.cycle_time_budget_s
    placed = {
        "candidate": placed_within(judged[0], budget),
        "incumbent": placed_within(judged[1], budget),
    }
    checks = [
        _non_inferiority_check(stopped, statistic, bound, used, gate),
        (arms[0].safety_stops == 0, f"{arms[0].safety_stops} safety stops (0 allowed)"),
        _cycle_time_check(arms[0].p95_cycle_time_s, budget, placed, used),
    ]
    return GateDecision(
        passed=all(ok for ok, _ in checks),
        reasons=[("pass: " if ok else "FAIL: ") + why for ok, why in checks],
        candidate=arms[0].as_record(),
        incumbent=arms[1].as_record(),
        cycle_time_budget_s=gate.cycle_time_budget_s,
        stopped=stopped,
        episodes_used=used,
        max_episodes=max_episodes,
        margin=gate.margin,
        alpha=gate.alpha,
        statistic=statistic,
        bound=bound,
        superiority=superiority,
        placed_within_budget=placed,
    )


def _statistics(plan: Design, candidate, incumbent, stopped: str, used: int):
    """The non-inferiority and superiority statistics at the deciding look, with the
    boundary there (superiority against the same boundary: tested only after non-inferiority,
    so it spends no extra error)."""
    sizes = plan.look_sizes().tolist()
    bound = float(plan.bounds()[sizes.index(used)]) if used in sizes else None
    counts = (candidate.successes, incumbent.successes, used)
    ni = float(score_statistic(*counts, plan.margin))
    sup = float(score_statistic(*counts, 0.0))
    shown = stopped == EFFICACY and bound is not None and sup >= bound
    return ni, bound, {"statistic": sup, "bound": bound, "shown": shown}


def _non_inferiority_check(stopped, statistic, bound, used, gate) -> tuple[bool, str]:
    where = f"after {used} episodes per arm"
    if stopped == SAFETY:
        return False, f"trials stopped by a candidate safety stop {where}: not judged"
    verdict = "no worse" if stopped == EFFICACY else f"not shown no worse ({stopped})"
    sign = ">=" if stopped == EFFICACY else "<"
    return stopped == EFFICACY, (
        f"{verdict} than the incumbent by more than {gate.margin:.3f} {where}: "
        f"score {statistic:.2f} {sign} boundary {bound:.2f} (alpha {gate.alpha})"
    )


def _cycle_time_check(
    p95: float | None, budget: float, placed: dict[str, int], used: int
) -> tuple[bool, str]:
    """Within the takt, or no slower a line than the incumbent's (module docstring)."""
    if p95 is None:
        return False, "no successful trial episode, so no cycle time to hold against the budget"
    if p95 <= budget:
        return True, f"p95 cycle time {p95:.2f} s <= budget {budget:.2f} s"
    ours, theirs = placed["candidate"], placed["incumbent"]
    why = (
        f"p95 cycle time {p95:.2f} s > budget {budget:.2f} s; parts placed within it: "
        f"{ours}/{used} against the incumbent's {theirs}/{used}"
    )
    if ours >= theirs:
        return True, f"{why}, so the line is no slower"
    return False, why


def placed_within(episodes: pa.Table, budget: float) -> int:
    """Trial episodes whose part was placed within `budget` seconds."""
    success = episodes.column("success").to_pylist()
    times = episodes.column("cycle_time_s").to_pylist()
    return sum(1 for ok, took in zip(success, times, strict=True) if ok and took <= budget)


def trial_stats(episodes: pa.Table, confidence: float = 0.90) -> TrialStats:
    """Trial statistics from ingested trial episodes: the gate judges what the logs say.

    The cycle-time percentile is over successful episodes: a failure runs to the timeout, and
    the budget is about how fast the cell completes its work, not how long it takes to give up.
    """
    versions = set(episodes.column("policy_version").to_pylist())
    if len(versions) != 1:
        raise ValueError(f"trial episodes must come from one policy, got {sorted(versions)}")
    success = episodes.column("success").to_pylist()
    cycle_times = [
        t for t, ok in zip(episodes.column("cycle_time_s").to_pylist(), success, strict=True) if ok
    ]
    stops = int(pa.compute.sum(episodes.column("safety_stops")).as_py() or 0)
    return TrialStats.from_episodes(versions.pop(), success, stops, cycle_times, confidence)
