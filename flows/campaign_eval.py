"""Held-out evaluation for the campaign: `realloop cell eval` on a cell's line as it is on a
day (`--day`: its timeline's events up to then), on seeds the loop never uses, each at its own
start offset in the shift; mean and range over the seeds.

Results are cached by (line, policy sha256, events applied, seeds, episodes per seed): the
reference cell is deterministic given those, so the same policy on the same line state with the
same seeds gives the same figure, and a frozen policy on a line that did not change is
evaluated once. The line is part of the key: cells share the sim policy, the expert and event
names (every line's camera is "knocked"), not their friction, latency or light.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

EXPERT = "expert"  # the privileged expert: no weights, its id is its name
CACHE_FILE = "eval-cache.json"
# Evaluations run in the background while the loop builds the next day's candidates (the
# campaign's critical path): niced, they take the cores the loop leaves idle, not its share.
EVAL_NICENESS = 10


def policy_id(policy: str) -> str:
    """What identifies a policy for the cache: the sha256 of its weights (or `expert`)."""
    from pipelines.ingest import sha256_file

    if policy == EXPERT:
        return EXPERT
    return sha256_file(Path(policy) / "model.safetensors")


def events_on_day(timeline: list[dict], day: float) -> list[str]:
    """The names of a timeline's events applied by `day` (as refcell applies them)."""
    return [event["name"] for event in timeline if event["day"] <= day]


@dataclass(frozen=True)
class EvalJob:
    """One held-out evaluation: `policy` (a folder or `expert`) on `world` as on `day`;
    `events`: those applied by then (the cache key's line state)."""

    policy: str
    world: str
    day: int
    events: tuple[str, ...]


class EvalCache:
    """Evaluations by key, in a JSON file of the campaign's workspace (written atomically).
    `workers`: evaluations run at once, each a `realloop cell eval` process of its own, at
    `niceness`. One thread at a time may evaluate (the campaign's DayFigures)."""

    def __init__(
        self,
        path: Path,
        params_path: Path,
        episodes: int,
        seeds: tuple[int, ...],
        workers: int = 1,
        niceness: int = 0,
    ):
        self.path, self.params_path = Path(path), Path(params_path)
        self.episodes, self.seeds, self.workers = episodes, tuple(seeds), workers
        self.niceness = niceness
        self.entries: dict[str, dict] = (
            json.loads(self.path.read_text()) if self.path.is_file() else {}
        )
        self.hits = self.misses = 0

    def key(self, world: str, policy_sha: str, events: list[str]) -> str:
        what = [world, policy_sha, list(events), list(self.seeds), self.episodes]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()

    def evaluate(self, policy: str, world: str, day: int, events: list[str]) -> dict:
        """`policy` (a folder or `expert`) on `world` as on `day`; `events`: those applied by
        then (the cache key's line state)."""
        return self.evaluate_many([EvalJob(policy, world, day, tuple(events))])[0]

    def evaluate_many(self, jobs: list[EvalJob]) -> list[dict]:
        """Each job's figures, in order: cached ones at once, the others `workers` at a time
        (a key asked twice is evaluated once)."""
        keys = [self.key(j.world, policy_id(j.policy), list(j.events)) for j in jobs]
        missing = {key: job for key, job in zip(keys, jobs, strict=True) if key not in self.entries}
        with ThreadPoolExecutor(max_workers=self.workers) as pool:  # each job a subprocess
            futures = {pool.submit(self._run, job): key for key, job in missing.items()}
            for future in as_completed(futures):
                self._store(futures[future], future.result())
        self.misses += len(missing)
        self.hits += len(jobs) - len(missing)
        return [
            {**self.entries[key], "cached": key not in missing or keys.index(key) != i}
            for i, key in enumerate(keys)
        ]

    def _run(self, job: EvalJob) -> dict:
        result = run_cell_eval(
            self.params_path, job.policy, job.world, job.day, self.episodes, self.seeds,
            niceness=self.niceness,
        )  # fmt: skip
        if result["events"] != list(job.events):  # the cell's timeline is the truth: say so
            raise ValueError(
                f"{job.world} day {job.day}: the cell applied {result['events']}, the campaign "
                f"expected {list(job.events)}; the line file changed during the campaign"
            )
        return {
            "success": round(result["success_rate"], 4),
            "min": round(result["success_min"], 4),
            "max": round(result["success_max"], 4),
            "episodes": result["episodes"],
            "seeds": result["seeds"],
        }

    def _store(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        temp = self.path.with_name(f".{self.path.name}.partial")
        temp.write_text(json.dumps(self.entries, indent=1))
        temp.replace(self.path)


class DayFigures:
    """Each day's held-out evaluations in the background, one day after another, while the
    campaign takes up the next day (its shift, its loop): they read frozen copies of the
    models (snapshot_production) on the line as it was that day (`--day`), so nothing the loop
    does later changes them. Their processes run niced (EVAL_NICENESS): they fill the cores the
    loop leaves idle (trial waits, single-threaded stages) instead of holding it up. The rows
    are filled in on the campaign's thread, in day order (`collect`), never while it writes
    them out."""

    def __init__(self, cache: EvalCache):
        self.cache = cache
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="day-figures")
        self._pending: list[tuple[Future, Callable[[list[dict]], None]]] = []

    def __enter__(self) -> DayFigures:
        return self

    def __exit__(self, *failed) -> None:
        # A failed campaign does not wait for the evaluations queued behind it.
        self._pool.shutdown(wait=True, cancel_futures=failed[0] is not None)

    def submit(self, jobs: list[EvalJob], fill: Callable[[list[dict]], None]) -> None:
        """Evaluate `jobs` after the days before; `fill(figures)` when collected."""
        self._pending.append((self._pool.submit(self.cache.evaluate_many, jobs), fill))

    def collect(self, wait: bool = False) -> None:
        """Fill in the days evaluated so far (all of them, waiting, with `wait`); an
        evaluation's error is raised here."""
        while self._pending and (wait or self._pending[0][0].done()):
            future, fill = self._pending.pop(0)
            fill(future.result())


def fill_day(rows: dict[str, dict], names: list, found: list[dict], before: dict) -> None:
    """The day's held-out figures into its rows; a promotion's before and after."""
    for (cell, name), figure in zip(names, found, strict=True):
        rows[cell]["policies"][name] = figure
    for cell, row in rows.items():
        if row["promoted"]:
            was = row["policies"].pop("replaced")
            row["promotion"] = {
                "from": str(before[cell][0]),
                "to": row["production_model"]["policy"],
                "before": was["success"],
                "after": row["policies"]["production"]["success"],
            }


def run_cell_eval(
    params_path: Path,
    policy: str,
    world: str,
    day: int,
    episodes: int,
    seeds: tuple[int, ...],
    niceness: int = 0,
) -> dict:
    from flows.demo import _realloop

    done = _realloop(
        "cell",
        "eval",
        "--policy",
        policy,
        "--world",
        world,
        "--day",
        str(day),
        "--episodes",
        str(episodes),
        "--seeds",
        ",".join(map(str, seeds)),
        "--params",
        str(params_path),
        "--json",
        niceness=niceness,
    )
    return json.loads(done.stdout)


def cell_timeline(world: str) -> list[dict]:
    """The line's dated events, from the cell (`realloop cell timeline`)."""
    from flows.demo import _realloop

    return json.loads(_realloop("cell", "timeline", "--world", world, "--json").stdout)["events"]


def snapshot_production(box: Path, store: Path) -> tuple[Path, dict]:
    """(a copy of the box's active model under `store`, the box's status): releases on a box
    are pruned, the copy stays for `realloop cell eval --policy` after the campaign."""
    from edge.agent import status

    active = status(box)
    folder = store / active["sha256"][:16]
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(active["path"], partial)
        partial.replace(folder)
    return folder, active
