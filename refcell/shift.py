"""A shift on the line: run a policy, record what the cell writes, keep the ground truth."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from pipelines.contract.params import CellParams, RecordParams
from refcell.cell import Cell
from refcell.recorder import CellIdentity, ShiftRecorder
from refcell.runner import Controller, EpisodeResult, Operator, run_episode, summarize
from refcell.truth import true_failure_cause
from refcell.world import World, load_world

GROUND_TRUTH_DIR = ".groundtruth"  # hidden: ingest skips dot-folders; only tests read it


def record_shift(
    world: World,
    cell_params: CellParams,
    params: RecordParams,
    controller: Controller,
    episodes: int,
    out_dir: Path,
    seed: int,
    *,
    interventions: bool,
    policy_version: str,
    shift_start: datetime,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Run `episodes` on `world`, writing MCAP logs, captures and a ground-truth side file."""
    out_dir = Path(out_dir)
    identity = CellIdentity.from_params(cell_params, policy_version)
    recorder = ShiftRecorder(out_dir, cell_params, params, identity, shift_start)
    operator = Operator(params.operator) if interventions else None
    cell, sim = Cell(world, cell_params), load_world("sim")
    results: list[EpisodeResult] = []
    truth_rows = []
    for index in range(episodes):
        result = run_episode(
            cell, controller, seed, index, episodes, operator, observers=(recorder,)
        )
        episode_id = recorder.episode.episode_id
        results.append(result)
        truth_rows.append(truth_row(episode_id, result))
        if progress:
            progress(index + 1, episodes)
    files = recorder.close()
    # Counterfactual replays come after the logs are closed: they must not be recorded.
    for row, result in zip(truth_rows, results, strict=True):
        if not result.success:
            row["true_cause"] = true_failure_cause(
                cell, sim, controller, seed, result, episodes, operator
            )
    truth_path = out_dir / GROUND_TRUTH_DIR / f"{recorder.shift_id}.jsonl"
    truth_path.parent.mkdir(parents=True, exist_ok=True)
    truth_path.write_text("".join(json.dumps(row) + "\n" for row in truth_rows))
    return {
        **summarize(results),
        "shift_id": recorder.shift_id,
        "files": [str(p) for p in files],
        "captures": [str(p) for p in recorder.captures],
        "ground_truth": str(truth_path),
    }


def truth_row(episode_id: str, result: EpisodeResult) -> dict:
    return {"episode_id": episode_id, "true_cause": None, **asdict(result)}
