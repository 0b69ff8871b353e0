"""The gate's sequential test: is the candidate's success rate no worse than the incumbent's
by more than a margin, judged at a few planned looks while the trial episodes come in?

- the statistic is the Miettinen–Nurminen score test of p_candidate - p_incumbent > -margin
  (statsmodels), so both arms' sampling error counts, with the variance taken under the null;
- the looks are planned before any result: after ceil(cap * k / looks) interleaved pairs;
- efficacy (promote) when the statistic reaches a group-sequential boundary spent by the
  Lan–DeMets O'Brien–Fleming function, which keeps the error rate at alpha over all looks;
- futility (stop, no promotion) when the conditional power under the current trend to cross
  the last boundary is below `futility_power` (stochastic curtailment, non-binding: stopping
  without promoting can only lower the error rate, so the efficacy boundaries ignore it);
- the last look without efficacy: "cap", no promotion.

Every function takes arrays of gates, so bench/gate simulates thousands with the same code the
gate runs on one attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

EFFICACY, FUTILITY, CAP, CONTINUE = "efficacy", "futility", "cap", "continue"


@dataclass(frozen=True)
class Design:
    """What the test is fixed to before the first trial episode."""

    alpha: float  # one-sided: how often a candidate worse by more than the margin may pass
    margin: float  # absolute success rate the candidate may lose to the incumbent
    looks: int  # planned looks, evenly spaced up to the cap
    futility_power: float  # stop for futility below this conditional power
    max_pairs: int  # the cap: episodes per arm

    @property
    def planned_looks(self) -> int:
        """The looks, at most one per pair (a tiny cap has fewer)."""
        return min(self.looks, self.max_pairs)

    def look_sizes(self) -> np.ndarray:
        """Pairs (episodes per arm) at each look; the last is the cap."""
        k = np.arange(1, self.planned_looks + 1)
        return np.ceil(self.max_pairs * k / self.planned_looks).astype(int)

    def bounds(self) -> np.ndarray:
        """The efficacy boundary of the statistic at each look, spent at the planned fractions
        k / looks of the cap (so one computation serves every cap)."""
        fractions = tuple(k / self.planned_looks for k in range(1, self.planned_looks + 1))
        return np.array(efficacy_bounds(self.alpha, fractions))


@lru_cache(maxsize=64)
def efficacy_bounds(alpha: float, fractions: tuple[float, ...]) -> tuple[float, ...]:
    """Group-sequential boundaries c_k: under the null, the chance of a first crossing at look k
    is what the O'Brien–Fleming-type spending function alpha(t) = 2 - 2 Phi(z_{1-alpha/2} / sqrt t)
    adds between looks (Lan & DeMets 1983). The statistics at the looks are jointly normal with
    corr(Z_j, Z_k) = sqrt(t_j / t_k) (independent increments); the probabilities are scipy's
    multivariate normal integrals, fixed seed so that a gate is reproducible."""
    from scipy.optimize import brentq
    from scipy.stats import multivariate_normal, norm

    t = np.asarray(fractions)
    spent = 2 - 2 * norm.cdf(norm.ppf(1 - alpha / 2) / np.sqrt(t))
    cov = np.sqrt(np.minimum.outer(t, t) / np.maximum.outer(t, t))

    def no_crossing(upper: list[float]) -> float:
        """P(Z_j < upper_j for every look j so far)."""
        k = len(upper)
        if k == 1:
            return float(norm.cdf(upper[0]))
        rng = np.random.default_rng(0)
        x = np.array(upper)
        return float(multivariate_normal.cdf(x, cov=cov[:k, :k], abseps=1e-5, releps=0, rng=rng))

    bounds = [float(norm.isf(spent[0]))]
    for k in range(1, len(t)):
        before, added = no_crossing(bounds), spent[k] - spent[k - 1]

        def crossing(c: float, before: float = before, added: float = added) -> float:
            """P(first crossing at look k with boundary c) minus what look k may spend."""
            return before - no_crossing([*bounds, c]) - added

        bounds.append(float(brentq(crossing, -1.0, 12.0, xtol=1e-4)))
    return tuple(bounds)


def score_statistic(
    candidate_successes: np.ndarray, incumbent_successes: np.ndarray, n: np.ndarray, margin: float
) -> np.ndarray:
    """Miettinen–Nurminen score statistic for p_candidate - p_incumbent > -margin (0: superiority),
    n episodes per arm; large when the candidate is convincingly no worse."""
    import warnings

    from statsmodels.stats.proportion import score_test_proportions_2indep

    with warnings.catch_warnings():  # 0/0 at an arm with no episodes yet: NaN, handled below
        warnings.simplefilter("ignore", RuntimeWarning)
        z = score_test_proportions_2indep(
            np.asarray(candidate_successes, dtype=float),
            np.asarray(n, dtype=float),
            np.asarray(incumbent_successes, dtype=float),
            np.asarray(n, dtype=float),
            value=-margin,
            compare="diff",
            alternative="larger",
            return_results=False,
        )[0]
    return np.nan_to_num(np.asarray(z, dtype=float), nan=0.0)


@dataclass(frozen=True)
class Looks:
    """The sequential test run over gates: for each, the look it stopped at and why."""

    outcome: np.ndarray  # efficacy, futility, cap or continue (not enough episodes yet)
    look: np.ndarray  # index of the deciding look (the last one seen while continuing)
    pairs: np.ndarray  # episodes per arm used
    statistic: np.ndarray  # the non-inferiority statistic at that look
    bound: np.ndarray  # the efficacy boundary at that look


def run_looks(design: Design, candidate_cum: np.ndarray, incumbent_cum: np.ndarray) -> Looks:
    """The test over gates: `*_cum[g, k]` is gate g's successes in its first look_sizes()[k]
    episodes of that arm; fewer columns than looks when not all looks are reached yet."""
    sizes, bounds = design.look_sizes(), design.bounds()
    seen = candidate_cum.shape[1]
    n = sizes[:seen]
    z = score_statistic(candidate_cum, incumbent_cum, n[None, :], design.margin)
    last = len(sizes) - 1
    t = n / design.max_pairs
    efficacy = z >= bounds[:seen]
    futile = conditional_power(z, t, bounds[last]) < design.futility_power
    futile[:, np.arange(seen) == last] = True  # the cap: no efficacy is no promotion
    stop = efficacy | futile
    decided = stop.any(axis=1)
    look = np.where(decided, stop.argmax(axis=1), seen - 1)
    rows = np.arange(len(look))
    outcome = np.where(
        ~decided,
        CONTINUE,
        np.where(efficacy[rows, look], EFFICACY, np.where(look == last, CAP, FUTILITY)),
    )
    return Looks(outcome, look, n[look], z[rows, look], bounds[look])


def conditional_power(z: np.ndarray, t: np.ndarray, final_bound: float) -> np.ndarray:
    """The chance the statistic ends above the last boundary if the effect seen so far is the
    true one (Lan, Simon & Halperin's stochastic curtailment, on the B-value z * sqrt(t))."""
    from scipy.stats import norm

    with np.errstate(divide="ignore", invalid="ignore"):
        power = norm.sf((final_bound - z / np.sqrt(t)) / np.sqrt(1 - t))
    return np.where(t >= 1, (z >= final_bound).astype(float), power)
