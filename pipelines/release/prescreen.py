"""The pre-screen: a cycle's candidates ranked before any robot time; only the best is trialled.

    score = sim_weight x sim success + (1 - sim_weight) x action agreement

- action agreement = max(0, 1 - RMS action error) on the held-out steps of the cell's newest
  shifts: the weighted mean squared error of the candidate's actions against the operator's
  corrections (weight train.intervention_weight) and the actions of successful episodes
  (weight 1), as fine-tuning weighs them, in the action's units (a fraction of the command
  limit per axis). Those shifts are held out of fine-tuning whole (`split_by_shift`: by
  shift, never by step, so no candidate saw a step of them).
- sim success: the share of `loop.sim_eval_episodes` episodes placed in the sim calibrated
  from the cell's logs, the same episodes for each candidate (the simulator plug-in).

A term that cannot be measured (one shift only: nothing held out; no calibration yet) drops
out and the other is the score; with neither, candidates keep their order in
`loop.candidates`. A tie goes to the earlier one. Whether the ranking predicts the trials is
measured over the cycles in the ledger: `prescreen_correlation` (Spearman's rank correlation
of each trialled candidate's score with its trial success).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipelines.contract.params import CellParams, Params, PretrainParams


class SimPretrain(Protocol):
    """params `simulator.pretrain`: a policy pretrained in the sim a calibration file
    describes (its ranges for domain randomization), and the observations it trained on."""

    def __call__(
        self, calibration: Path, cell: CellParams, params: PretrainParams, version: str
    ) -> tuple[Any, np.ndarray]: ...


class SimEvaluate(Protocol):
    """params `simulator.evaluate`: a saved policy's success rate over `episodes` episodes in
    the sim a calibration file describes (the same episodes for the same seed)."""

    def __call__(
        self, policy: Path, calibration: Path, cell: CellParams, episodes: int, seed: int
    ) -> float: ...


@dataclass(frozen=True)
class ShiftSplit:
    """A cell's batches split by shift: fine-tuning reads `train`, the pre-screen
    `heldout_shifts` of `heldout` (a held-out batch may hold older episodes too; they are in
    neither)."""

    train: list[str]
    heldout: list[str]
    heldout_shifts: list[str]
    train_shifts: list[str]
    reason: str | None = None  # why nothing is held out
    older_shifts: int = 0  # training shifts before the window (`window`): not read

    def as_dict(self) -> dict:
        return {
            "train_batches": len(self.train),
            "heldout_batches": len(self.heldout),
            "heldout_shifts": self.heldout_shifts,
            "train_shifts": self.train_shifts,
            "older_shifts": self.older_shifts,
            "reason": self.reason,
        }


def shift_of(episode_id: str) -> str:
    """The shift an episode belongs to, from its id (`<cell>-<shift start>-<NNNNN>`)."""
    from pipelines.calibrate.logs import shift_position

    return shift_position(episode_id)[0]


def batch_shifts(
    dataset: Path, batches: Sequence[str], trials: bool = False
) -> dict[str, set[str]]:
    """batch -> the shifts of its production episodes, from the episodes files' id columns
    alone. Trial episodes do not count (a log of trials alone has none): they are the arms'
    own actions, run on request, not the line's shift. `trials`: count them too (the shift
    each ran during), to tell when a log of trials was recorded."""
    import pyarrow.parquet as pq

    shifts = {}
    for sha in batches:
        path = Path(dataset) / "episodes" / f"{sha}.parquet"
        rows = pq.read_table(path, columns=["episode_id", "trial_request_id"]).to_pydict()
        pairs = zip(rows["episode_id"], rows["trial_request_id"], strict=True)
        shifts[sha] = {shift_of(i) for i, trial in pairs if trials or trial is None}
    return shifts


def split_by_shift(shifts: Mapping[str, set[str]], heldout_shifts: int) -> ShiftSplit:
    """Hold out the newest `heldout_shifts` shifts (shift ids are UTC start times) with every
    batch that holds any of their episodes; train on the rest. Nothing is held out when that
    would leave no shift to train on."""
    every = sorted(set().union(*shifts.values())) if shifts else []
    batches = list(shifts)  # in the given order: the fine-tune reads them so
    if heldout_shifts == 0:
        return ShiftSplit(batches, [], [], every, "loop.heldout_shifts is 0")
    if len(every) <= heldout_shifts:
        reason = f"{len(every)} shift(s): none to spare for the pre-screen, all trained on"
        return ShiftSplit(batches, [], [], every, reason)
    held = set(every[-heldout_shifts:])
    heldout = [b for b in batches if shifts[b] & held]
    train = [b for b in batches if not shifts[b] & held]
    train_shifts = sorted(set().union(*(shifts[b] for b in train))) if train else []
    return ShiftSplit(train, heldout, sorted(held), train_shifts)


def window(split: ShiftSplit, recorded: Mapping[str, set[str]], newest: int | None) -> ShiftSplit:
    """Fine-tuning reads the newest `newest` training shifts only (None: all), with every log
    recorded since the oldest of them (`recorded`: batch -> the shifts of all its episodes,
    trials included). A line that changed is taught by what it is now, not by weeks of what it
    was, and a cycle's fine-tunes cost the same on day 14 as on day 3."""
    if newest is None or len(split.train_shifts) <= newest:
        return split
    kept = split.train_shifts[-newest:]
    train = [b for b in split.train if max(recorded[b], default="") >= kept[0]]
    older = len(split.train_shifts) - newest
    return replace(split, train=train, train_shifts=kept, older_shifts=older)


def heldout_steps(episodes, steps, shifts: Sequence[str], intervention_weight: float):
    """The pre-screen's examples: the held-out shifts' corrections and success steps, as
    fine-tuning would weigh them (pipelines.training.finetune.training_examples); production
    episodes only, as `batch_shifts` counts them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipelines.training.finetune import training_examples

    rows = episodes.select(["episode_id", "trial_request_id"]).to_pydict()
    pairs = zip(rows["episode_id"], rows["trial_request_id"], strict=True)
    held = set(shifts)
    keep = pa.array([i for i, trial in pairs if trial is None and shift_of(i) in held], pa.string())
    episodes = episodes.filter(pc.is_in(episodes["episode_id"], value_set=keep))
    steps = steps.filter(pc.is_in(steps["episode_id"], value_set=keep))
    return training_examples(episodes, steps, intervention_weight)


def action_mse(policy_folder: Path, examples) -> float | None:
    """The policy's weighted mean squared action error on `examples` (a TrainingSet), as
    fine-tuning's validation loss is computed; None without examples."""
    import torch

    from pipelines.training.policy import load_policy
    from pipelines.training.train import _evaluate

    if len(examples) == 0:
        return None
    net = load_policy(policy_folder).net
    x, y, w = (
        torch.from_numpy(a)
        for a in (examples.inputs(net.config), examples.actions, examples.weights)
    )
    return _evaluate(net, x, y, w, torch.arange(len(examples)))


def score(action_error: float | None, sim_success: float | None, sim_weight: float) -> dict:
    """One candidate's pre-screen figures (see the module's docstring for the score)."""
    agreement = None if action_error is None else max(0.0, 1.0 - math.sqrt(action_error))
    terms = [(sim_weight, sim_success), (1.0 - sim_weight, agreement)]
    present = [(w, v) for w, v in terms if v is not None]
    weight = sum(w for w, _ in present)
    if not present:
        value = None
    elif weight > 0:
        value = sum(w * v for w, v in present) / weight
    else:  # a term weighted 0 is all there is: it still ranks
        value = sum(v for _, v in present) / len(present)
    return {
        "action_mse": action_error,
        "action_agreement": agreement,
        "sim_success": sim_success,
        "score": value,
    }


def rank(candidates: Sequence[Mapping]) -> list[dict]:
    """Candidates (each with `name` and its `score` figures) best first, `rank` 1.. set and the
    best `selected`; an unscored candidate ranks after every scored one, ties keep order."""
    order = sorted(
        range(len(candidates)),
        key=lambda i: (candidates[i].get("score") is None, -(candidates[i].get("score") or 0), i),
    )
    ranked = []
    for position, i in enumerate(order, start=1):
        ranked.append(dict(candidates[i]) | {"rank": position, "selected": position == 1})
    return ranked


def prescreen_cell(
    params: Params,
    workspace: Path,
    split: ShiftSplit,
    candidates: Sequence[Mapping],
    calibration: Path | None,
    evaluate: SimEvaluate | None,
) -> tuple[list[dict], int]:
    """Score and rank a cell's `candidates` (each with `name` and `policy_folder`): action
    error on the split's held-out shifts, success in the sim `calibration` describes (through
    `evaluate`, params `simulator.evaluate`). Returns them ranked and the held-out examples'
    count."""
    from pipelines.ingest import read_dataset
    from pipelines.training.train import intra_op_threads

    loop, examples = params.loop, None
    if split.heldout:
        dataset = Path(workspace) / params.ingest.dataset
        episodes, steps = read_dataset(dataset, sources=split.heldout)
        weight = params.train.intervention_weight
        examples = heldout_steps(episodes, steps, split.heldout_shifts, weight)
    scored = []
    for candidate in candidates:
        folder = Path(candidate["policy_folder"])
        error = None if examples is None else action_mse(folder, examples)
        success = None
        if calibration is not None and evaluate is not None:
            episodes_n, seed = loop.sim_eval_episodes, loop.sim_eval_seed
            # One observation a step: torch's thread pool cannot speed that up, and its
            # spin-waits take the cores the cells and the other candidates share.
            with intra_op_threads(1):
                success = float(evaluate(folder, calibration, params.cell, episodes_n, seed))
        scored.append(dict(candidate) | score(error, success, loop.sim_weight))
    return rank(scored), 0 if examples is None else len(examples)


def prescreen_correlation(cycles: Iterable[Mapping]) -> dict:
    """Spearman's rank correlation between the trialled candidate's pre-screen score and its
    trial success rate, over every cell of every cycle summary (the ledger,
    `.realloop/cycles.jsonl`) that has both: `rho`, `p_value`, `n` and the `pairs`. Fewer
    than three pairs, or no spread on a side: rho is None and `reason` says why."""
    from scipy.stats import spearmanr

    pairs = []
    for summary in cycles:
        for cell in summary.get("cells", []):
            pair = trialled_pair(cell)
            if pair is not None:
                pairs.append({"cycle": summary.get("cycle"), "cell": cell["cell"], **pair})
    result: dict[str, Any] = {"n": len(pairs), "rho": None, "p_value": None, "pairs": pairs}
    scores = [p["score"] for p in pairs]
    successes = [p["trial_success"] for p in pairs]
    if len(pairs) < 3:
        return result | {"reason": f"{len(pairs)} trialled candidate(s) with a score: need 3"}
    if len(set(scores)) < 2 or len(set(successes)) < 2:
        return result | {"reason": "no spread in the scores or the trial outcomes"}
    rho, p_value = spearmanr(scores, successes)
    return result | {"rho": float(rho), "p_value": float(p_value), "reason": None}


def trialled_pair(cell: Mapping) -> dict | None:
    """(score, trial success) of the candidate a cell's cycle trialled, when it has both."""
    prescreen = cell.get("prescreen") or {}
    trialled = prescreen.get("trialled") or {}
    candidate = ((cell.get("trials") or {}).get("candidate")) or {}
    if trialled.get("score") is None or candidate.get("success_rate") is None:
        return None
    return {
        "candidate": trialled.get("name"),
        "score": float(trialled["score"]),
        "trial_success": float(candidate["success_rate"]),
        "trial_episodes": candidate.get("n"),
    }
