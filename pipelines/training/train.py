"""Supervised training of the policy: behaviour cloning on (observation, action) pairs.

Used by sim pretraining and by fine-tuning on line data; deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipelines.contract.params import LearningRateSchedule
from pipelines.training.policy import PolicyNet


@dataclass(frozen=True)
class EpochMetrics:
    epoch: int
    train_loss: float
    val_loss: float


def seed_everything(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    return torch.Generator().manual_seed(seed)


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch on `threads` intra-op threads inside the block (None: torch's default, one per
    core). Where reference cells share the cores (`make demo`), two threads' spin-waits made
    fine-tuning 6.7x slower than one (bench/train_threads); on idle cores two are up to 2x
    faster. The weights are the same bytes either way (tests/pipelines/test_finetune.py)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fit(
    net: PolicyNet,
    observations: np.ndarray,
    actions: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    weights: np.ndarray | None = None,
    val_fraction: float = 0.1,
    learning_rate_schedule: LearningRateSchedule = "constant",
    on_epoch: Callable[[EpochMetrics], None] | None = None,
    threads: int | None = None,
    trainable: list[nn.Parameter] | None = None,
    penalty: Callable[[], torch.Tensor] | None = None,
) -> list[EpochMetrics]:
    """Minimise (weighted) squared action error; hold out `val_fraction` for a val loss.
    `threads`: torch's intra-op threads while training (None: its default). `trainable`: the
    parameters the optimiser moves (None: all of `net`'s). `penalty`: a term added to every
    batch's loss (a regulariser; the reported losses are the action error alone).
    `learning_rate_schedule`: "cosine" anneals the rate to zero over the fit's steps."""
    with intra_op_threads(threads):
        return _fit(net, observations, actions, epochs, batch_size, learning_rate, seed, weights,
                    val_fraction, on_epoch, trainable, penalty, learning_rate_schedule)  # fmt: skip


def _fit(
    net, observations, actions, epochs, batch_size, learning_rate, seed, weights, val_fraction,
    on_epoch, trainable=None, penalty=None, learning_rate_schedule="constant",
) -> list[EpochMetrics]:  # fmt: skip
    generator = seed_everything(seed)
    x = torch.from_numpy(np.asarray(observations, dtype=np.float32))
    y = torch.from_numpy(np.asarray(actions, dtype=np.float32))
    w = torch.from_numpy(
        np.ones(len(x), np.float32) if weights is None else np.asarray(weights, np.float32)
    )
    order = torch.randperm(len(x), generator=generator)
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    optimizer = torch.optim.Adam(
        net.parameters() if trainable is None else trainable, lr=learning_rate
    )
    schedule = _schedule(optimizer, learning_rate_schedule, epochs * -(-len(train) // batch_size))
    history = []
    for epoch in range(epochs):
        net.train()
        total = 0.0
        for batch in torch.randperm(len(train), generator=generator).split(batch_size):
            idx = train[batch]
            # every member of an ensemble on its own error: members stay apart, their mean
            # gains what averaging gives (PolicyConfig.ensemble)
            loss = _weighted_mse(net.member_actions(x[idx]), y[idx], w[idx])
            optimizer.zero_grad()
            (loss if penalty is None else loss + penalty()).backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * len(idx)
        metrics = EpochMetrics(epoch, total / max(len(train), 1), _evaluate(net, x, y, w, val))
        history.append(metrics)
        if on_epoch:
            on_epoch(metrics)
    net.eval()
    return history


def _schedule(
    optimizer: torch.optim.Optimizer, kind: LearningRateSchedule, steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
    return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)


def _weighted_mse(pred: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Weighted squared action error; `pred` with a leading member axis (an ensemble's
    member_actions): the members' mean of it."""
    errors = ((pred - target) ** 2).sum(dim=-1) * w
    if pred.dim() > target.dim():
        return errors.sum(dim=-1).mean() / w.sum().clamp_min(1e-9)
    return errors.sum() / w.sum().clamp_min(1e-9)


@torch.no_grad()
def _evaluate(net: nn.Module, x, y, w, idx) -> float:
    if len(idx) == 0:
        return float("nan")
    net.eval()
    return float(_weighted_mse(net(x[idx]), y[idx], w[idx]))
