"""Fine-tuning the production policy on the line's own logs.

The recipe the issue asks for: clone the *successful real episodes* plus the *operators'
corrected actions*. Everything comes from the canonical dataset tables (EPISODES_SCHEMA,
STEPS_SCHEMA); nothing here knows the cell's true state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import TrainParams
from pipelines.contract.schema import ACTION_SIZE
from pipelines.training.policy import PolicyNet
from pipelines.training.train import EpochMetrics, fit


@dataclass(frozen=True)
class TrainingSet:
    observations: np.ndarray  # (N, 12) float32 in OBS_FIELDS order, as the policy saw them
    actions: np.ndarray  # (N, ACTION_SIZE) float32 labels
    weights: np.ndarray  # (N,) float32 per-example loss weights
    episodes_used: int  # episodes that contributed at least one example
    success_steps: int  # policy-driven steps of successful episodes
    correction_steps: int  # operator-driven steps, from any episode

    def __len__(self) -> int:
        return len(self.observations)


def _vectors(column: pa.ChunkedArray | pa.Array, size: int) -> np.ndarray:
    """A fixed-size list<float32> column as an (n, size) float32 array (no Python loop)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return flat.astype(np.float32, copy=False).reshape(-1, size)


def training_examples(
    episodes: pa.Table,
    steps: pa.Table,
    intervention_weight: float,
) -> TrainingSet:
    """Observations and labels from the line's logs.

    Labels: on intervention steps the operator's `corrected_action` (any episode: a
    correction is a correction, even if the episode failed later); on the other steps of
    *successful* episodes the commanded action. The policy's own actions in failed episodes
    are never labels. Corrections weigh `intervention_weight`, success steps 1.
    """
    order = pc.sort_indices(steps, [("episode_id", "ascending"), ("step", "ascending")])
    steps = steps.take(order)
    n = steps.num_rows
    step_episode = steps["episode_id"].to_numpy(zero_copy_only=False)

    # Per-step episode facts, joined by episode id (episodes without steps just drop out).
    episode_ids = episodes["episode_id"].to_numpy(zero_copy_only=False)
    by_id = np.argsort(episode_ids)
    found = np.searchsorted(episode_ids, step_episode, sorter=by_id)
    episode_row = by_id[np.minimum(found, max(len(by_id) - 1, 0))] if len(by_id) else found
    if n and (len(by_id) == 0 or np.any(episode_ids[episode_row] != step_episode)):
        raise ValueError("steps reference episodes missing from the episodes table")
    targets = _vectors(episodes["target"], 2)[episode_row]
    success = episodes["success"].to_numpy(zero_copy_only=False).astype(bool)[episode_row]

    # Previous commanded action: the row above, unless this row starts an episode.
    actions = _vectors(steps["action"], ACTION_SIZE)
    first = np.ones(n, dtype=bool)
    first[1:] = step_episode[1:] != step_episode[:-1]
    previous = np.zeros_like(actions)
    previous[1:] = actions[:-1]
    previous[first] = 0.0

    observations = np.concatenate(
        [
            _vectors(steps["joint_position"], 2),
            _vectors(steps["joint_velocity"], 2),
            _vectors(steps["part_pose"], 3),
            steps["part_confidence"].to_numpy(zero_copy_only=False).astype(np.float32)[:, None],
            targets,
            previous,
        ],
        axis=1,
    ).astype(np.float32)

    intervention = steps["intervention"].to_numpy(zero_copy_only=False).astype(bool)
    corrected = steps["corrected_action"]
    # An intervention step without its correction breaks the contract (validate flags it);
    # it is no label here, and not a policy step either.
    has_correction = intervention & ~pc.is_null(corrected).to_numpy(zero_copy_only=False)
    # Nulls flatten to nothing, so fill them first to keep one row per step.
    filled = pc.fill_null(corrected, pa.scalar([0.0] * ACTION_SIZE, corrected.type))
    labels = np.where(has_correction[:, None], _vectors(filled, ACTION_SIZE), actions)

    success_step = success & ~intervention
    keep = has_correction | success_step
    # Corrections are the only labels that say what the policy should have done, exactly
    # where it went wrong, so they dominate the loss (intervention_weight, 10 in params.yaml);
    # the policy's own steps in successful episodes anchor what already works on the line.
    weights = np.where(has_correction, np.float32(intervention_weight), np.float32(1.0))
    return TrainingSet(
        observations=observations[keep],
        actions=labels[keep].astype(np.float32),
        weights=weights[keep].astype(np.float32),
        episodes_used=len(np.unique(step_episode[keep])),
        success_steps=int(success_step.sum()),
        correction_steps=int(has_correction.sum()),
    )


def finetune(
    base: PolicyNet,
    data: TrainingSet,
    params: TrainParams,
    version: str,
    on_epoch: Callable[[EpochMetrics], None] | None = None,
) -> tuple[PolicyNet, list[EpochMetrics]]:
    """A copy of `base` trained further on `data`; `base` itself is left as it was."""
    if len(data) == 0:
        raise ValueError("no training examples: no successful episodes and no corrections")
    net = copy.deepcopy(base)
    history = fit(
        net,
        data.observations,
        data.actions,
        epochs=params.epochs,
        batch_size=params.batch_size,
        learning_rate=params.learning_rate,
        seed=params.seed,
        weights=data.weights,
        val_fraction=params.val_fraction,
        on_epoch=on_epoch,
        threads=params.threads,
    )
    net.config.version = version
    net.config.trained_on = {
        "base_version": base.config.version,
        "base_trained_on": dict(base.config.trained_on),
        "finetune_seed": params.seed,
        "episodes_used": data.episodes_used,
        "success_steps": data.success_steps,
        "correction_steps": data.correction_steps,
    }
    return net, history
