"""The box's health window, exactly: how often it rolls back a good model and catches a bad one.

    .venv/bin/python -m bench.health [--json]

After an activation the box judges the new model's first production episodes against the
lower end of its trial interval (the floor; pipelines.release.rollout.judge_counts). For each
floor the trials of a campaign set and each true success rate around it, this enumerates
every path of successes and failures through the rule (a walk over (episodes, successes),
calling the rule itself at each state) and sums the exact probability that the window fails,
and its expected length. Two rules side by side, from params.yaml's `edge:`:
- `one_look`: the window of `edge.health_episodes` episodes, judged once (the rule to stop 39);
- `sequential`: looked at every `edge.health_episodes` up to `edge.health_max_episodes`,
  failed early only when significantly below the floor.

A good model here places `GOOD` above its floor, a bad one `BAD` below it.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipelines.contract.params import load_params
from pipelines.release.rollout import FAILED, OPEN, judge_counts

# The floors seed 17's trials set for its promotions (docs/benchmarks.md, "The health window"),
# and a weak and a middling one.
FLOORS = (0.60, 0.70, 0.80, 0.882, 0.93, 0.957)
GOOD, BAD = 0.03, -0.10  # true rate minus floor: a model the trials got right, and a bad one


def operating_point(rate: float, floor: float, wanted: int, most: int) -> dict:
    """P(the window fails) and its expected length in episodes, for a model placing `rate`."""
    open_paths = {0: 1.0}  # successes so far -> probability, among windows still open
    failed = length = 0.0
    for episodes in range(1, most + 1):
        grown: dict[int, float] = {}
        for successes, weight in open_paths.items():
            for now, p in ((successes + 1, rate), (successes, 1.0 - rate)):
                grown[now] = grown.get(now, 0.0) + weight * p
        open_paths = {}
        for successes, weight in grown.items():
            state = judge_counts(episodes, successes, 0, wanted, floor, most).state
            if state == OPEN:
                open_paths[successes] = weight
                continue
            failed += weight if state == FAILED else 0.0
            length += weight * episodes
    assert not open_paths, "the rule left windows open past its last look"
    return {"rollback": round(failed, 4), "mean_episodes": round(length, 1)}


def compare(wanted: int, most: int) -> dict:
    rules = {"one_look": (wanted, wanted), "sequential": (wanted, most)}
    rows = []
    for floor in FLOORS:
        good, bad = min(floor + GOOD, 0.999), floor + BAD
        row = {"floor": floor, "good_rate": round(good, 3), "bad_rate": round(bad, 3)}
        for name, (look, longest) in rules.items():
            row[name] = {
                "good": operating_point(good, floor, look, longest),
                "bad": operating_point(bad, floor, look, longest),
            }
        rows.append(row)
    summary = {
        name: {
            "false_rollback": _span(rows, name, "good", "rollback"),
            "caught": _span(rows, name, "bad", "rollback"),
            "mean_episodes_good": _span(rows, name, "good", "mean_episodes"),
            "mean_episodes_bad": _span(rows, name, "bad", "mean_episodes"),
        }
        for name in rules
    }
    return {
        "health_episodes": wanted,
        "health_max_episodes": most,
        "summary": summary,
        "rows": rows,
    }


def _span(rows: list[dict], rule: str, model: str, key: str) -> list[float]:
    values = [row[rule][model][key] for row in rows]
    return [min(values), max(values)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--json", action="store_true", help="the whole result on stdout")
    args = parser.parse_args(argv)
    edge = load_params(args.params).edge
    result = compare(edge.health_episodes, edge.health_max_episodes)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"{'floor':>6} {'rule':>11} {'good: rolled back':>18} {'episodes':>9} "
        f"{'bad: caught':>12} {'episodes':>9}"
    )
    for row in result["rows"]:
        for rule in ("one_look", "sequential"):
            good, bad = row[rule]["good"], row[rule]["bad"]
            print(
                f"{row['floor']:>6.3f} {rule:>11} {good['rollback']:>18.3f} "
                f"{good['mean_episodes']:>9.1f} {bad['rollback']:>12.3f} "
                f"{bad['mean_episodes']:>9.1f}"
            )
    for rule, figures in result["summary"].items():
        print(f"{rule}: " + ", ".join(f"{k} {v[0]}-{v[1]}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
