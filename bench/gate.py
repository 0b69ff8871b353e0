"""The sequential gate, simulated: its error rate, its power and the trial episodes it uses.

    .venv/bin/python -m bench.gate [--reps 2000] [--null-reps 10000] [--plot docs/gate.png] [--json]

Thousands of gates over a grid of true success rates (incumbent 0.50..0.97, candidate minus
incumbent -0.10..+0.10), vectorised: each gate draws each arm's successes between the planned
looks and runs the same test as the gate (pipelines/release/sequential.py).

Two parts:
- `configured`: the gate as params.yaml sets it (alpha, margin, looks, futility, cap
  trials.max_episodes): how often a candidate worse by the margin or more is promoted, and how
  often a better one is, at the configured cap;
- the comparison at equal error rates (the top-level figures): for each incumbent rate p, a
  design alternative (the candidate `DESIGN_GAIN` better, at most halfway to 1) and a power of
  `POWER`. The fixed-N design is the smallest n per arm whose one-look test at alpha reaches
  that power, computed exactly (enumerating both binomials), not by simulation; the sequential
  design's cap is the smallest multiple of that n (steps of 5%) whose simulated power reaches
  it. Then each design's mean trial episodes per arm over every grid point at that p (the
  fixed-N design always uses n), and the false promotions of the sequential one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from pipelines.contract.params import load_params
from pipelines.release.sequential import EFFICACY, Design, run_looks, score_statistic

INCUMBENT_RATES = (0.50, 0.60, 0.70, 0.80, 0.90, 0.95, 0.97)
DIFFERENCES = (-0.10, -0.06, -0.04, -0.02, 0.0, 0.02, 0.05, 0.10)
DESIGN_GAIN = 0.05  # the design alternative: candidate this much better (at most (1 - p) / 2)
POWER = 0.80
STATED = (0.0, 0.02, 0.05, 0.10)  # differences at which the configured gate's power is reported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gate", description=__doc__)
    parser.add_argument("--reps", type=int, default=2000, help="gates per grid point")
    parser.add_argument(
        "--null-reps", type=int, default=10000, help="gates per point at or below -margin"
    )
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--plot", type=Path, help="write power and episodes against the difference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.gate: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    report = run(params, args.reps, args.null_reps, np.random.default_rng(args.seed))
    if args.plot:
        plot(report, args.plot)
        report["plot"] = str(args.plot)
    print(json.dumps(report, indent=2) if args.json else summary(report))
    return 0


def run(params, reps: int, null_reps: int, rng: np.random.Generator) -> dict:
    started = time.monotonic()
    gate = params.gate
    base = Design(gate.alpha, gate.margin, gate.looks, gate.futility_power, gate.looks)
    base.bounds()  # computed once (cached), outside the timing of the simulations below
    configured = _replace(base, params.trials.max_episodes)
    configured_points = [
        _point(configured, p, d, _reps(d, gate.margin, reps, null_reps), rng)
        for p in INCUMBENT_RATES
        for d in DIFFERENCES
        if 0 <= p + d <= 1
    ]
    sized = [_sized(base, p, reps, null_reps, rng) for p in INCUMBENT_RATES]
    points = [pt for s in sized for pt in s["points"]]
    worse = [pt for pt in points if pt["difference"] <= -gate.margin + 1e-12]
    mean_episodes = float(np.mean([s["mean_trial_episodes"] for s in sized]))
    fixed_n = float(np.mean([s["fixed_n_trial_episodes"] for s in sized]))
    gates = sum(pt["gates"] for pt in points) + sum(pt["gates"] for pt in configured_points)
    return {
        "alpha": gate.alpha,
        "margin": gate.margin,
        "looks": gate.looks,
        "futility_power": gate.futility_power,
        "gates": gates,
        "false_promotion_rate": _false_promotions(worse),
        "power": {
            "target": POWER,
            "design_gain": DESIGN_GAIN,
            "at_design_alternative": {s["incumbent"]: s["power"] for s in sized},
        },
        "mean_trial_episodes": round(mean_episodes, 1),
        "fixed_n_trial_episodes": round(fixed_n, 1),
        "episodes_saved": round(1 - mean_episodes / fixed_n, 3),
        "targets": {
            "false_promotion_le_alpha": _false_promotions(worse)["max"] <= gate.alpha,
            "episodes_saved_ge_30pct": 1 - mean_episodes / fixed_n >= 0.30,
        },
        "sized": [{k: v for k, v in s.items() if k != "points"} for s in sized],
        "configured": _configured(configured, configured_points),
        "points": points,
        "seconds": round(time.monotonic() - started, 1),
    }


def _sized(base: Design, p: float, reps: int, null_reps: int, rng) -> dict:
    """The comparison at incumbent rate p: both designs sized for POWER at the design
    alternative, then run over every difference of the grid."""
    gain = min(DESIGN_GAIN, (1 - p) / 2)
    n_fixed = fixed_n(base.alpha, base.margin, p + gain, p, POWER)
    cap, power = n_fixed, 0.0
    for step in range(0, 21):  # the sequential cap: n_fixed x 1.00, 1.05, ... 2.00
        cap = int(np.ceil(n_fixed * (1 + 0.05 * step)))
        power = _point(_replace(base, cap), p, gain, reps, rng)["promoted"]
        if power >= POWER:
            break
    design = _replace(base, cap)
    points = [
        _point(design, p, d, _reps(d, base.margin, reps, null_reps), rng) | {"cap": cap}
        for d in DIFFERENCES
        if 0 <= p + d <= 1
    ]
    return {
        "incumbent": p,
        "design_alternative": round(p + gain, 4),
        "fixed_n_trial_episodes": n_fixed,
        "sequential_cap": cap,
        "power": round(power, 3),
        "mean_trial_episodes": round(float(np.mean([pt["mean_episodes"] for pt in points])), 1),
        "points": points,
    }


def _point(design: Design, p: float, difference: float, reps: int, rng) -> dict:
    """`reps` gates of the design with true rates p + difference (candidate) and p."""
    sizes = design.look_sizes()
    steps = np.diff(sizes, prepend=0)
    candidate = rng.binomial(steps, min(1.0, max(0.0, p + difference)), (reps, len(steps)))
    incumbent = rng.binomial(steps, p, (reps, len(steps)))
    looks = run_looks(design, candidate.cumsum(axis=1), incumbent.cumsum(axis=1))
    promoted = looks.outcome == EFFICACY
    return {
        "incumbent": p,
        "difference": difference,
        "gates": reps,
        "promoted": round(float(promoted.mean()), 4),
        # the upper 95% Clopper-Pearson bound of the promotion rate: the simulation's own error
        "promoted_upper95": round(_upper95(int(promoted.sum()), reps), 4),
        "mean_episodes": round(float(looks.pairs.mean()), 1),
        "stopped": {
            k: round(float((looks.outcome == k).mean()), 3) for k in np.unique(looks.outcome)
        },
    }


def fixed_n(alpha: float, margin: float, p_candidate: float, p_incumbent: float, power: float):
    """The smallest n per arm whose one-look score test at alpha has at least `power` when the
    rates are these: exact, summing the probability of every (successes, successes) outcome
    that passes. Power grows with n up to the binomials' sawtooth; bisection finds the first
    n at which it reaches the target (checked again one below)."""
    from scipy.stats import norm

    bound = norm.isf(alpha)
    low, high = 2, 8
    while _exact_power(high, margin, p_candidate, p_incumbent, bound) < power:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if _exact_power(middle, margin, p_candidate, p_incumbent, bound) >= power:
            high = middle
        else:
            low = middle
    return high


def _exact_power(n: int, margin: float, p_c: float, p_i: float, bound: float) -> float:
    from scipy.stats import binom

    k = np.arange(n + 1)
    z = score_statistic(k[:, None], k[None, :], np.full((1, 1), n), margin)
    weights = binom.pmf(k, n, p_c)[:, None] * binom.pmf(k, n, p_i)[None, :]
    return float(weights[z >= bound].sum())


def _configured(design: Design, points: list[dict]) -> dict:
    worse = [pt for pt in points if pt["difference"] <= -design.margin + 1e-12]
    power = {
        f"{d:+.2f}": {pt["incumbent"]: pt["promoted"] for pt in points if pt["difference"] == d}
        for d in STATED
    }
    return {
        "max_episodes": design.max_pairs,
        "false_promotion_rate": _false_promotions(worse),
        "power": power,
        "mean_trial_episodes": round(float(np.mean([pt["mean_episodes"] for pt in points])), 1),
        "points": points,
    }


def _false_promotions(worse: list[dict]) -> dict:
    total = sum(pt["gates"] for pt in worse)
    promoted = sum(pt["promoted"] * pt["gates"] for pt in worse)
    top = max(worse, key=lambda pt: pt["promoted"])
    return {
        "max": top["promoted"],
        "max_at": {"incumbent": top["incumbent"], "difference": top["difference"]},
        "max_upper95": top["promoted_upper95"],
        "overall": round(promoted / total, 4),
        "gates": total,
    }


def _reps(difference: float, margin: float, reps: int, null_reps: int) -> int:
    return null_reps if difference <= -margin + 1e-12 else reps


def _replace(design: Design, cap: int) -> Design:
    return Design(design.alpha, design.margin, design.looks, design.futility_power, cap)


def _upper95(k: int, n: int) -> float:
    from scipy.stats import beta

    return 1.0 if k == n else float(beta.ppf(0.975, k + 1, n - k))


def summary(report: dict) -> str:
    fp, saved = report["false_promotion_rate"], report["episodes_saved"]
    lines = [
        f"{report['gates']} simulated gates, alpha {report['alpha']}, margin {report['margin']}",
        f"false promotion: max {fp['max']:.4f} at {fp['max_at']} (overall {fp['overall']:.4f})",
        f"mean trial episodes per arm {report['mean_trial_episodes']} vs fixed-N "
        f"{report['fixed_n_trial_episodes']}: {saved:.0%} fewer",
        "incumbent  fixed-N  seq cap  power  mean episodes",
    ]
    for s in report["sized"]:
        lines.append(
            f"{s['incumbent']:9.2f}  {s['fixed_n_trial_episodes']:7d}  {s['sequential_cap']:7d}  "
            f"{s['power']:5.2f}  {s['mean_trial_episodes']:13.1f}"
        )
    lines.append(
        f"configured (cap {report['configured']['max_episodes']}): {report['configured']['power']}"
    )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (power, episodes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in report["sized"]:
        mine = [pt for pt in report["points"] if pt["incumbent"] == s["incumbent"]]
        x = [pt["difference"] for pt in mine]
        power.plot(x, [pt["promoted"] for pt in mine], marker="o", label=f"p={s['incumbent']}")
        share = [pt["mean_episodes"] / s["fixed_n_trial_episodes"] for pt in mine]
        episodes.plot(x, share, marker="o", label=f"p={s['incumbent']}")
    power.axhline(report["alpha"], color="grey", linestyle=":", label="alpha")
    power.axvline(-report["margin"], color="red", linestyle="--", label="-margin")
    power.set(xlabel="candidate - incumbent (true)", ylabel="promoted", title="promotion rate")
    episodes.axhline(1.0, color="grey", linestyle=":", label="fixed-N")
    episodes.set(
        xlabel="candidate - incumbent (true)",
        ylabel="mean episodes / fixed-N episodes",
        title="trial episodes per decision",
    )
    power.legend(fontsize=7)
    episodes.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
