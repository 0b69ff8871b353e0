"""Fine-tuning a pretrained student on its own success (PPO), in a simulator.

Imitation leaves the loop's student a few points below the expert on the hardest lines, and
no better imitator closed that (docs/calibration.md, stops 35-38): its failures are episodes
that run out of time a few centimetres short. Paid for placing the part in time instead of
for copying the expert's path, the student learns to arrive: on cell-09's line the
calibrated student placed 92.3 and, after 30 iterations in the sim calibrated from the line's
logs, 97-98 (docs/calibration.md, "Paid for arriving").

This is clipped PPO (Schulman et al. 2017) with generalized advantage estimates, written
here rather than taken from Stable-Baselines3 because the actor must stay the loop's own
network (its frame history, output gain and file format; the edge box runs it) and must be
held near the imitation policy it starts from: an anchor term, the squared distance from the
starting policy's actions on the states visited, keeps the fine-tune from unlearning what
imitation taught where the reward says little. The episodes come from a simulator plug-in
(`Episodes`): nothing here imports one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from edge.runtime import EpisodeInputs
from pipelines.contract.params import ReinforceParams
from pipelines.training.policy import PolicyNet, feature_size

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass
class Step:
    """What one command led to: the next observation, its reward, whether the episode ended
    and, if it did, whether the part was placed."""

    observation: np.ndarray
    reward: float
    done: bool
    success: bool


class Episodes(Protocol):
    """A simulator's episodes, for a policy to be rewarded in: `start(index)` begins episode
    `index` (each index its own draw) and returns its first observation; `step(command)` runs
    one control step; `elapsed` is the share of the episode's time limit used so far."""

    def start(self, index: int) -> np.ndarray: ...

    def step(self, command: np.ndarray) -> Step: ...

    @property
    def elapsed(self) -> float: ...


@dataclass
class Batch:
    """One iteration's episodes, step by step."""

    inputs: list[torch.Tensor] = field(default_factory=list)  # the policy's stacked input
    elapsed: list[float] = field(default_factory=list)
    actions: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    last: list[bool] = field(default_factory=list)  # the episode's last step
    successes: list[bool] = field(default_factory=list)  # per episode

    def add(
        self,
        inputs: torch.Tensor,
        elapsed: float,
        action: torch.Tensor,
        log_prob: torch.Tensor,
        step: Step,
    ) -> None:
        self.inputs.append(inputs)
        self.elapsed.append(elapsed)
        self.actions.append(action)
        self.log_probs.append(log_prob)
        self.rewards.append(step.reward)
        self.last.append(step.done)
        if step.done:
            self.successes.append(step.success)

    def extend(self, other: Batch) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.stack(self.inputs),
            torch.tensor(self.elapsed)[:, None],
            torch.stack(self.actions),
            torch.stack(self.log_probs),
        )


class Critic(nn.Module):
    """The value of a state: the policy's own features and the share of time used (the
    same state is worth less with less time left to place the part)."""

    def __init__(self, policy: PolicyNet, hidden: int = 128):
        super().__init__()
        self.features = policy.features  # read, never trained: the critic's own layers learn
        width = feature_size(policy.config) + 1
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, 1),
        )

    def forward(self, inputs: torch.Tensor, elapsed: torch.Tensor) -> torch.Tensor:
        features = self.features(inputs).detach()
        return self.mlp(torch.cat([features, elapsed], dim=-1))[:, 0]


def fine_tune_on_success(
    net: PolicyNet,
    lanes: Sequence[Episodes],
    settings: ReinforceParams,
    seed: int,
    first_episode: int = 0,
    progress: Progress | None = None,
) -> dict:
    """PPO on `net` in place for `settings.iterations` iterations of
    `settings.episodes_per_iteration` episodes each, numbered from `first_episode`. `lanes`
    run episodes side by side, the policy acting for all of them at once (a network call
    costs about what a simulator step does). Returns the share placed per iteration (while
    exploring) and the episodes run."""
    generator = torch.Generator().manual_seed(seed)
    anchor = copy.deepcopy(net).eval().requires_grad_(False)
    critic = Critic(net)
    log_std = nn.Parameter(torch.full((2,), float(np.log(settings.exploration_std))))
    actor_optimizer = torch.optim.Adam([*net.parameters(), log_std], lr=settings.learning_rate)
    critic_optimizer = torch.optim.Adam(critic.mlp.parameters(), lr=settings.critic_learning_rate)
    placed, next_episode = [], first_episode
    for iteration in range(settings.iterations):
        indices = range(next_episode, next_episode + settings.episodes_per_iteration)
        batch = _run_batch(net, lanes, log_std, indices, generator)
        next_episode = indices.stop
        actor_learns = iteration >= settings.critic_warmup_iterations
        optimizers = (actor_optimizer, critic_optimizer)
        _update(net, anchor, critic, log_std, batch, settings, optimizers, actor_learns, generator)
        placed.append(float(np.mean(batch.successes)))
        if progress:
            progress("reinforce", iteration + 1, settings.iterations)
    net.eval()
    return {"placed_while_exploring": placed, "episodes": next_episode - first_episode}


@dataclass
class _Lane:
    """One lane's episode in progress: its frames and its steps so far."""

    episodes: Episodes
    inputs: EpisodeInputs
    observation: np.ndarray | None = None
    steps: Batch = field(default_factory=Batch)


def _run_batch(
    net: PolicyNet,
    lanes: Sequence[Episodes],
    log_std: torch.Tensor,
    indices: range,
    generator: torch.Generator,
) -> Batch:
    """Run the policy with Gaussian exploration around its action, clipped to the command
    limit as the edge box clips it, until every episode in `indices` has ended. A lane
    whose episode ends starts the next one; each episode's steps stay together."""
    net.eval()
    batch, std, todo = Batch(), log_std.detach().exp(), iter(indices)
    running = [_Lane(episodes, EpisodeInputs(net.config.history)) for episodes in lanes]
    running = [lane for lane in running if _start_next(lane, todo)]
    while running:
        stacked = torch.from_numpy(
            np.stack([lane.inputs.push(lane.observation) for lane in running])
        )
        with torch.no_grad():
            means = net(stacked)
            actions = means + std * torch.randn(means.shape, generator=generator)
            log_probs = torch.distributions.Normal(means, std).log_prob(actions).sum(-1)
        for lane, inputs, action, log_prob in zip(
            running, stacked, actions, log_probs, strict=True
        ):
            elapsed = lane.episodes.elapsed
            step = lane.episodes.step(action.clamp(-1.0, 1.0).numpy().astype(float))
            lane.observation = step.observation
            lane.steps.add(inputs, elapsed, action, log_prob, step)
            if step.done:
                batch.extend(lane.steps)
                lane.steps = Batch()
        running = [lane for lane in running if lane.steps.inputs or _start_next(lane, todo)]
    return batch


def _start_next(lane: _Lane, todo: Iterator[int]) -> bool:
    index = next(todo, None)
    if index is None:
        return False
    lane.inputs.begin()
    lane.observation = lane.episodes.start(index)
    return True


def advantages(
    rewards: np.ndarray, values: np.ndarray, last: np.ndarray, gamma: float, lam: float
) -> np.ndarray:
    """Generalized advantage estimates over consecutive episodes. An episode's last step
    bootstraps from nothing: after placing, losing or a safety stop there is nothing more to
    earn, and at a timeout the time is up (the critic sees the time, so this is its value)."""
    out = np.zeros_like(rewards)
    running = 0.0
    for i in reversed(range(len(rewards))):
        next_value = 0.0 if last[i] else values[i + 1]
        if last[i]:
            running = 0.0
        delta = rewards[i] + gamma * next_value - values[i]
        running = delta + gamma * lam * running
        out[i] = running
    return out


def _update(
    net: PolicyNet,
    anchor: PolicyNet,
    critic: Critic,
    log_std: torch.Tensor,
    batch: Batch,
    settings: ReinforceParams,
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    actor_learns: bool,
    generator: torch.Generator,
) -> None:
    """One iteration's learning: the critic on the returns, then (once `actor_learns`) the
    student on the clipped surrogate plus the anchor, `settings.epochs` passes in minibatches."""
    actor_optimizer, critic_optimizer = optimizers
    inputs, elapsed, actions, old_log_probs = batch.tensors()
    with torch.no_grad():
        values = critic(inputs, elapsed).numpy()
        anchor_actions = anchor(inputs)
    rewards, last = np.asarray(batch.rewards, np.float32), np.asarray(batch.last)
    adv = advantages(rewards, values, last, settings.discount, settings.gae_lambda)
    returns = torch.from_numpy(adv + values)
    adv_t = torch.from_numpy(adv)
    adv_t = (adv_t - adv_t.mean()) / (adv_t.std() + 1e-8)
    net.train()  # the output is clamped below as the box clamps it
    n = len(adv)
    for _ in range(settings.epochs):
        for rows in torch.randperm(n, generator=generator).split(settings.minibatch_steps):
            value_loss = ((critic(inputs[rows], elapsed[rows]) - returns[rows]) ** 2).mean()
            critic_optimizer.zero_grad()
            value_loss.backward()
            critic_optimizer.step()
            if not actor_learns:  # a fresh critic's advantages are noise: learn values first
                continue
            mean = net(inputs[rows]).clamp(-1.0, 1.0)
            log_prob = torch.distributions.Normal(mean, log_std.exp()).log_prob(actions[rows])
            ratio = (log_prob.sum(-1) - old_log_probs[rows]).exp()
            clipped = ratio.clamp(1 - settings.clip, 1 + settings.clip)
            surrogate = torch.min(ratio * adv_t[rows], clipped * adv_t[rows]).mean()
            drift = ((mean - anchor_actions[rows]) ** 2).sum(-1).mean()
            loss = -surrogate + settings.anchor_weight * drift
            actor_optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), settings.max_grad_norm)
            actor_optimizer.step()
    net.eval()
