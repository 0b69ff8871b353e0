"""Supervised training of the policy: behaviour cloning on (observation, action) pairs.

Used by sim pretraining and by fine-tuning on line data; deterministic for a seed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

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


def on_one_thread(train: Callable) -> Callable:
    """Train on one intra-op thread. The policy is small: two threads gain at most 2x on an idle
    machine, but with cells or other work on the same cores their spin-waits made an epoch 10-20x
    slower (0.33 s on one thread against 5.7-6.9 s on two, 2 shared cores). The weights are
    the same bytes either way (checked), so one thread also gives every machine the same result."""

    @functools.wraps(train)
    def on_one(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return train(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return on_one


@on_one_thread
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
    on_epoch: Callable[[EpochMetrics], None] | None = None,
) -> list[EpochMetrics]:
    """Minimise (weighted) squared action error; hold out `val_fraction` for a val loss."""
    generator = seed_everything(seed)
    x = torch.from_numpy(np.asarray(observations, dtype=np.float32))
    y = torch.from_numpy(np.asarray(actions, dtype=np.float32))
    w = torch.from_numpy(
        np.ones(len(x), np.float32) if weights is None else np.asarray(weights, np.float32)
    )
    order = torch.randperm(len(x), generator=generator)
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    optimizer = torch.optim.Adam(net.parameters(), lr=learning_rate)
    history = []
    for epoch in range(epochs):
        net.train()
        total = 0.0
        for batch in torch.randperm(len(train), generator=generator).split(batch_size):
            idx = train[batch]
            loss = _weighted_mse(net(x[idx]), y[idx], w[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        metrics = EpochMetrics(epoch, total / max(len(train), 1), _evaluate(net, x, y, w, val))
        history.append(metrics)
        if on_epoch:
            on_epoch(metrics)
    net.eval()
    return history


def _weighted_mse(pred: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (((pred - target) ** 2).sum(dim=-1) * w).sum() / w.sum().clamp_min(1e-9)


@torch.no_grad()
def _evaluate(net: nn.Module, x, y, w, idx) -> float:
    if len(idx) == 0:
        return float("nan")
    net.eval()
    return float(_weighted_mse(net(x[idx]), y[idx], w[idx]))
