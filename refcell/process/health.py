"""The box's health check after each activation: does the new model hold up in production?

A safety stop in the window fails the check at once. Every `edge.health_episodes` production
episodes the box looks at the success rate against the lower end of the model's attested
trial interval (what the gate saw on this cell): at or above it the check passes; below it,
the check fails when the rate is significantly below (exact binomial, p < 0.05) or at the
last look (`edge.health_max_episodes`), and otherwise watches the next episodes
(pipelines.release.rollout.judge_counts). A failure rolls the box back
(refcell.process.edgebox). A model without a trial interval (the first one a cell got,
`deploy --initial`) is judged on safety stops alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.agent import attested_predicate
from pipelines.release.rollout import FAILED, PASSED, judge_counts


@dataclass
class HealthWindow:
    """The box's count of a newly activated model's first production episodes, judged by the
    same rule as the orchestrator's canary window (pipelines.release.rollout.judge_counts)."""

    bundle_id: str
    episodes_wanted: int  # between looks
    lower_bound: float | None  # the attested trial interval's lower end, if there is one
    episodes_most: int | None = None  # the longest window (None: one look)
    episodes: int = 0
    successes: int = 0
    safety_stops: int = 0
    verdict: str | None = None  # None while open; "passed" or the reason it failed

    def record(self, success: bool, safety_stop: str | None) -> str | None:
        """Count a production episode; the failure reason when this episode fails the check."""
        if self.verdict is not None:
            return None
        self.episodes += 1
        self.successes += success
        self.safety_stops += safety_stop is not None
        judged = judge_counts(
            self.episodes,
            self.successes,
            self.safety_stops,
            self.episodes_wanted,
            self.lower_bound,
            self.episodes_most,
        )
        if judged.state == PASSED:
            self.verdict = "passed"
        elif judged.state == FAILED:
            stop = f" (safety stop: {safety_stop})" if safety_stop else ""
            self.verdict = f"{judged.reason}{stop}, after activating {self.bundle_id}"
            return self.verdict
        return None

    def as_record(self) -> dict[str, Any]:
        return {
            "bundle_id": self.bundle_id,
            "episodes": self.episodes,
            "episodes_wanted": self.episodes_wanted,
            "episodes_most": self.episodes_most,
            "successes": self.successes,
            "safety_stops": self.safety_stops,
            "lower_bound": self.lower_bound,
            "verdict": self.verdict,
        }


def attested_lower_bound(release_folder: str | Path) -> float | None:
    """The lower end of the candidate's trial interval the gate attested for this release, or
    None (an override, the first model): from the gate attestation the box verified at install
    (predicate `arms.candidate.interval`)."""
    predicate = attested_predicate(release_folder) or {}
    try:
        low = predicate["arms"]["candidate"]["interval"][0]
    except (KeyError, IndexError, TypeError):
        return None
    return float(low) if isinstance(low, int | float) else None
