"""The promotion gate: a candidate reaches the cell only on hardware-trial evidence.

Three conditions, all required (no gate, no promotion):
- its success rate is convincingly no worse than the incumbent's: the lower bound of the
  candidate's Wilson score interval is at least the incumbent's observed success rate;
- zero safety stops in its trials;
- its p95 cycle time is within the cell's budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute


@dataclass(frozen=True)
class TrialStats:
    """What N hardware-trial episodes of one policy showed."""

    policy: str
    n: int
    successes: int
    safety_stops: int
    p95_cycle_time_s: float | None  # None: no episode to time
    confidence: float = 0.95

    @classmethod
    def from_episodes(
        cls,
        policy: str,
        success: list[bool],
        safety_stops: int,
        cycle_times_s: list[float],
        confidence: float = 0.95,
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

    def as_record(self) -> dict:
        return asdict(self)


def decide(
    candidate: TrialStats, incumbent: TrialStats, cycle_time_budget_s: float
) -> GateDecision:
    """Apply every condition and say why, pass or fail, in words a reviewer can check."""
    low, _ = candidate.interval
    checks = [
        (
            low >= incumbent.success_rate,
            f"success lower bound {low:.3f} (Wilson {candidate.confidence:.0%}) "
            f"{'>=' if low >= incumbent.success_rate else '<'} incumbent success "
            f"{incumbent.success_rate:.3f}",
        ),
        (candidate.safety_stops == 0, f"{candidate.safety_stops} safety stops (0 allowed)"),
        _cycle_time_check(candidate.p95_cycle_time_s, cycle_time_budget_s),
    ]
    passed = all(ok for ok, _ in checks)
    reasons = [("pass: " if ok else "FAIL: ") + why for ok, why in checks]
    return GateDecision(
        passed, reasons, candidate.as_record(), incumbent.as_record(), cycle_time_budget_s
    )


def _cycle_time_check(p95: float | None, budget: float) -> tuple[bool, str]:
    if p95 is None:
        return False, "no successful trial episode, so no cycle time to hold against the budget"
    within = p95 <= budget
    return within, f"p95 cycle time {p95:.2f} s {'<=' if within else '>'} budget {budget:.2f} s"


def trial_stats(episodes: pa.Table, confidence: float = 0.95) -> TrialStats:
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
