"""Fine-tuning the production policy on the line's own logs.

The recipe the issue asks for: clone the *successful real episodes* plus the *operators'
corrected actions*. Everything comes from the canonical dataset tables (EPISODES_SCHEMA,
STEPS_SCHEMA); nothing here knows the cell's true state.

How far the policy may move is `train.mode` (docs/operations.md, "Fine-tuning modes";
bench/efficacy measures each):
- `full`: every weight trained on the line's examples (the original recipe);
- `anchored`: as `full`, plus an L2 pull of every weight toward the base's (L2-SP) and the
  base's own actions as extra labels on the steps it handled (distillation), so the line's
  corrections change the policy only where the base was wrong;
- `residual`: the base frozen; a small head learns a correction added to its output.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from edge.runtime import stacked_inputs
from pipelines.contract.params import FinetuneMode, TrainParams
from pipelines.contract.schema import ACTION_SIZE, OBS_SIZE
from pipelines.quality.triage.selection import episode_weights
from pipelines.training.policy import PolicyConfig, PolicyNet, feature_size, residual_head
from pipelines.training.train import EpochMetrics, fit

MODES: tuple[str, ...] = get_args(FinetuneMode)


@dataclass(frozen=True)
class TrainingSet:
    observations: np.ndarray  # (N, 12) float32 in OBS_FIELDS order, as the policy saw them
    actions: np.ndarray  # (N, ACTION_SIZE) float32 labels
    weights: np.ndarray  # (N,) float32 per-example loss weights
    episodes_used: int  # episodes that contributed at least one example
    success_steps: int  # policy-driven steps of successful episodes
    correction_steps: int  # operator-driven steps, from any episode
    is_correction: np.ndarray  # (N,) bool: the label is an operator's correction
    # (E,) the measured part footprint (m, mean over the axes) of each episode used; NaN
    # where the log has none
    part_footprints_m: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # For a policy that sees several observations (`inputs`): every step's observation in
    # episode order (M, 12), each example's row among them (N,), and the row each frame's
    # episode starts at (M,).
    frames: np.ndarray = field(default_factory=lambda: np.zeros((0, OBS_SIZE), np.float32))
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    episode_first: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.observations)

    def inputs(self, config: PolicyConfig) -> np.ndarray:
        """The examples as a policy with `config` sees them (edge.runtime.stacked_inputs)."""
        if config.history == 1:
            return self.observations
        if len(self) and not len(self.frames):
            raise ValueError(
                "these examples were built without their episodes' frames; build them with "
                "training_examples for a policy with history"
            )
        return stacked_inputs(self.frames, config.history, self.episode_first, self.rows)


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
    novel_episodes: frozenset[str] | set[str] = frozenset(),
    novel_weight: float = 1.0,
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
    first = np.ones(n, dtype=bool)
    first[1:] = step_episode[1:] != step_episode[:-1]
    actions = _vectors(steps["action"], ACTION_SIZE)
    observations = _observations(steps, targets, actions, first)

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
    # A part the line rarely shows would be diluted by the common ones: its episodes' examples
    # weigh `novel_weight` more (triage.novel_part_weight; docs/triage.md, data selection).
    weights = weights * episode_weights(step_episode, novel_episodes, novel_weight)
    used = np.unique(step_episode[keep])
    return TrainingSet(
        observations=observations[keep],
        actions=labels[keep].astype(np.float32),
        weights=weights[keep].astype(np.float32),
        episodes_used=len(used),
        success_steps=int(success_step.sum()),
        correction_steps=int(has_correction.sum()),
        is_correction=has_correction[keep],
        part_footprints_m=_footprints(episodes, used),
        frames=observations,
        rows=np.flatnonzero(keep),
        episode_first=np.maximum.accumulate(np.where(first, np.arange(n), 0)),
    )


def _observations(
    steps: pa.Table, targets: np.ndarray, actions: np.ndarray, first: np.ndarray
) -> np.ndarray:
    """(n, 12) observations in OBS_FIELDS order from steps sorted by episode and step; `first`
    marks the rows that start an episode. The previous commanded action is the row above,
    unless this row starts an episode."""
    previous = np.zeros_like(actions)
    previous[1:] = actions[:-1]
    previous[first] = 0.0
    return np.concatenate(
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


def _footprints(episodes: pa.Table, episode_ids: np.ndarray) -> np.ndarray:
    """The mean measured part extent of each of `episode_ids` (NaN where it was not logged)."""
    if "part_extent_m" not in episodes.column_names:
        return np.full(len(episode_ids), np.nan)
    ids = episodes["episode_id"].to_pylist()
    extents = dict(zip(ids, episodes["part_extent_m"].to_pylist(), strict=True))
    return np.array(
        [float(np.mean(extents[e])) if extents.get(e) else np.nan for e in episode_ids.tolist()]
    )


def finetune(
    base: PolicyNet,
    data: TrainingSet,
    params: TrainParams,
    version: str,
    on_epoch: Callable[[EpochMetrics], None] | None = None,
) -> tuple[PolicyNet, list[EpochMetrics]]:
    """A copy of `base` trained further on `data` as `params.mode` says; `base` itself is left
    as it was."""
    if params.mode not in MODES:
        raise ValueError(
            f"params.yaml train.mode: {params.mode!r} is not a fine-tuning mode; "
            f"use one of {', '.join(MODES)}"
        )
    if len(data) == 0:
        raise ValueError("no training examples: no successful episodes and no corrections")
    observations, actions, weights = data.inputs(base.config), data.actions, data.weights
    trainable = penalty = None
    if params.mode == "residual":
        net = _with_residual_head(base, params.residual_hidden, params.seed)
        trainable = list(net.residual.parameters())
    else:
        net = copy.deepcopy(base)
    if params.mode == "anchored":
        observations, actions, weights = _with_base_actions(base, data, params.distill_weight)
        penalty = _l2_sp(net, base, params.anchor_weight)
    frozen = [p for p in net.parameters() if trainable is not None and not _among(p, trainable)]
    for parameter in frozen:  # no gradients for what does not move: half the work, same result
        parameter.requires_grad_(False)
    try:
        history = fit(
            net,
            observations,
            actions,
            epochs=params.epochs,
            batch_size=params.batch_size,
            learning_rate=params.learning_rate,
            seed=params.seed,
            weights=weights,
            val_fraction=params.val_fraction,
            on_epoch=on_epoch,
            threads=params.threads,
            trainable=trainable,
            penalty=penalty,
        )
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)
    net.config.version = version
    net.config.trained_on = {
        "base_version": base.config.version,
        "base_trained_on": dict(base.config.trained_on),
        "finetune_seed": params.seed,
        "finetune_mode": params.mode,
        "episodes_used": data.episodes_used,
        "success_steps": data.success_steps,
        "correction_steps": data.correction_steps,
    }
    return net, history


def _with_residual_head(base: PolicyNet, hidden: tuple[int, ...], seed: int) -> PolicyNet:
    """A copy of `base` with a zero-initialised residual head: it acts exactly as `base`. A base
    that already has one (an earlier residual fine-tune) keeps it, to be trained further."""
    if base.config.residual is not None:
        return copy.deepcopy(base)
    config = copy.deepcopy(base.config)
    config.residual = list(hidden)
    net = PolicyNet(config)
    loaded = net.load_state_dict(base.state_dict(), strict=False)  # all but the new head
    assert not loaded.unexpected_keys and all(
        key.startswith("residual.") for key in loaded.missing_keys
    ), loaded
    with torch.random.fork_rng():  # the head's start follows the training seed alone
        torch.manual_seed(seed)
        net.residual = residual_head(config.residual, feature_size(config))
    return net


def _with_base_actions(
    base: PolicyNet, data: TrainingSet, weight: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`data` with the base's own action as a second label, weighing `weight`, on every step
    it handled (a successful episode's own step): distillation that keeps what worked while
    the corrections teach what did not. Two squared errors on one input are one squared error
    towards their weighted mean, with their summed weight: no extra examples to train on."""
    handled, inputs = ~data.is_correction, data.inputs(base.config)
    with torch.no_grad():
        own = base.eval()(torch.from_numpy(inputs[handled])).numpy()
    actions, weights = data.actions.copy(), data.weights.copy()
    w = weights[handled][:, None]
    actions[handled] = (w * actions[handled] + weight * own) / np.maximum(w + weight, 1e-9)
    weights[handled] += weight
    return inputs, actions.astype(np.float32), weights.astype(np.float32)


def _l2_sp(net: PolicyNet, base: PolicyNet, weight: float) -> Callable[[], torch.Tensor]:
    """L2-SP (Li et al. 2018): `weight` x the squared distance of every weight of `net` from
    the base's, added to each batch's loss."""
    anchors = [
        (p, b.detach().clone()) for p, b in zip(net.parameters(), base.parameters(), strict=True)
    ]

    def penalty() -> torch.Tensor:
        return weight * sum(((p - b) ** 2).sum() for p, b in anchors)

    return penalty


def _among(parameter: torch.Tensor, parameters: list) -> bool:
    return any(parameter is other for other in parameters)
