"""Drift measures: PSI and KS for a continuous feature, Jensen-Shannon for a categorical one,
and NOVEL for a feature whose values come in a few known clusters (the parts' sizes).

A continuous feature drifts when PSI reaches `drift.psi`, or when the KS distance reaches
`drift.ks_statistic` with a p-value below `drift.p_value`; a categorical one when the
Jensen-Shannon distance reaches `drift.js_distance` and a chi-square test of the two count
vectors has p below `drift.p_value`; a clustered one when the share of current values unlike
any baseline value exceeds the baseline's own share by `drift.novel_share` with a one-sided
Fisher exact p below `drift.p_value` (a new part variant: a new cluster, whatever its share
of the mixture, which a KS distance dilutes). Significance alone is not enough (with a million steps
everything is significant), and size alone is not enough (60 episodes are noisy).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from pipelines.contract.params import DriftParams

PSI, KS, JS, NOVEL = "psi", "ks", "js", "novel"
PSI_FLOOR = 1e-4  # share given to an empty PSI bin, so that log(a/e) stays finite
# A value resembles the baseline when at least this share of it (and 2 values) lies within
# drift.novel_tolerance_m: a known variant of 2% of parts still counts, one stray value not.
MIN_MATCH_SHARE = 0.02


@dataclass(frozen=True)
class Measure:
    name: str  # psi | ks | js | novel
    statistic: float
    threshold: float
    drifted: bool
    p_value: float | None = None  # KS, chi-square for JS, Fisher exact for NOVEL


def population_stability_index(baseline: np.ndarray, current: np.ndarray, bins: int) -> float:
    """PSI = sum((a - e) * ln(a / e)) over the baseline's quantile bins.

    Bin edges are the baseline's interior quantiles at 1/bins, 2/bins, ... (repeated edges
    merged, so ties do not make empty bins); a value equal to an edge falls in the bin above.
    Empty bins count as PSI_FLOOR of the sample. Rule of thumb: < 0.1 stable, 0.1-0.25 moderate,
    > 0.25 a major shift.
    """
    baseline, current = np.asarray(baseline, float), np.asarray(current, float)
    edges = np.unique(np.quantile(baseline, np.linspace(0.0, 1.0, bins + 1)[1:-1]))
    expected, actual = _bin_shares(baseline, edges), _bin_shares(current, edges)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def _bin_shares(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    counts = np.bincount(np.searchsorted(edges, values, side="right"), minlength=len(edges) + 1)
    return np.maximum(counts / len(values), PSI_FLOOR)


def kolmogorov_smirnov(baseline: np.ndarray, current: np.ndarray) -> tuple[float, float]:
    """Two-sample KS distance D and its p-value (scipy.stats.ks_2samp)."""
    from scipy.stats import ks_2samp

    result = ks_2samp(baseline, current)
    return float(result.statistic), float(result.pvalue)


def category_counts(baseline, current) -> tuple[list, np.ndarray, np.ndarray]:
    """Categories seen on either side, sorted, with each side's counts of them."""
    categories = sorted(set(np.asarray(baseline).tolist()) | set(np.asarray(current).tolist()))
    base, cur = Counter(np.asarray(baseline).tolist()), Counter(np.asarray(current).tolist())
    return (
        categories,
        np.array([base[c] for c in categories], float),
        np.array([cur[c] for c in categories], float),
    )


def jensen_shannon(baseline, current) -> tuple[float, float]:
    """Jensen-Shannon distance (base 2: 0 same, 1 disjoint) between the two category
    distributions, and the chi-square p-value of the 2 x k table of counts."""
    from scipy.spatial.distance import jensenshannon
    from scipy.stats import chi2_contingency

    categories, base, cur = category_counts(baseline, current)
    distance = float(jensenshannon(base, cur, base=2))
    if len(categories) < 2:
        return distance, 1.0  # one category on both sides: nothing differs
    return distance, float(chi2_contingency(np.vstack([base, cur])).pvalue)


def novel_share(baseline: np.ndarray, current: np.ndarray, tolerance: float) -> tuple[float, float]:
    """How many more current values than baseline values lie where the baseline has (almost)
    none: the share of current values with fewer than MIN_MATCH_SHARE of the baseline within
    `tolerance`, minus the same share of the baseline's values (each against the others), and
    the one-sided Fisher exact p-value of that 2 x 2 table."""
    from scipy.stats import fisher_exact

    ordered = np.sort(np.asarray(baseline, float))
    needed = max(2, int(np.ceil(MIN_MATCH_SHARE * len(ordered))))

    def unmatched(values: np.ndarray, itself: int) -> np.ndarray:
        high = np.searchsorted(ordered, values + tolerance, side="right")
        near = high - np.searchsorted(ordered, values - tolerance, side="left") - itself
        return near < needed

    new, old = unmatched(np.asarray(current, float), 0), unmatched(ordered, 1)
    table = [[int(new.sum()), int((~new).sum())], [int(old.sum()), int((~old).sum())]]
    p_value = float(fisher_exact(table, alternative="greater").pvalue)
    return float(new.mean() - old.mean()), p_value


def measure(name: str, baseline: np.ndarray, current: np.ndarray, params: DriftParams) -> Measure:
    if name == PSI:
        psi = population_stability_index(baseline, current, params.psi_bins)
        return Measure(PSI, psi, params.psi, psi >= params.psi)
    if name == KS:
        d, p = kolmogorov_smirnov(baseline, current)
        return Measure(
            KS, d, params.ks_statistic, d >= params.ks_statistic and p < params.p_value, p
        )
    if name == JS:
        d, p = jensen_shannon(baseline, current)
        return Measure(JS, d, params.js_distance, d >= params.js_distance and p < params.p_value, p)
    if name == NOVEL:
        share, p = novel_share(baseline, current, params.novel_tolerance_m)
        drifted = share >= params.novel_share and p < params.p_value
        return Measure(NOVEL, share, params.novel_share, drifted, p)
    raise ValueError(f"{name}: unknown drift measure (psi, ks, js or novel)")


def describe_measures(measures: list[Measure] | list[dict]) -> str:
    """'PSI 0.412 >= 0.2, KS 0.301 >= 0.1 (p 3.2e-40)': measures or their JSON rows."""
    parts = []
    for m in measures:
        m = m if isinstance(m, dict) else asdict(m)
        relation = ">=" if m["statistic"] >= m["threshold"] else "<"
        text = f"{m['name'].upper()} {m['statistic']:.3f} {relation} {m['threshold']:g}"
        if m["p_value"] is not None:
            text += f" (p {m['p_value']:.2g})"
        parts.append(text)
    return ", ".join(parts) or "no samples"
