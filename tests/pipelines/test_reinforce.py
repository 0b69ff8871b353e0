"""Fine-tuning on success (pipelines.training.reinforce): the advantages, and a student that
learns to arrive sooner in a world where only arriving pays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.contract.params import ReinforceParams
from pipelines.training import PolicyConfig, PolicyNet, fit, seed_everything
from pipelines.training.reinforce import Step, advantages, fine_tune_on_success

SETTINGS = ReinforceParams(
    iterations=12,
    episodes_per_iteration=16,
    exploration_std=0.2,
    anchor_weight=0.0,
    learning_rate=1e-3,
    critic_warmup_iterations=2,
    minibatch_steps=256,
)


class Slide:
    """A part that moves where it is commanded (0.02 m per step at full command) toward a
    target 0.3 m away; placed within 0.03 m, out of time after 40 steps. An observation as the
    cell's: pusher on the part, part, target, last command."""

    LIMIT = 40

    def start(self, index: int) -> np.ndarray:
        angle = np.random.default_rng(index).uniform(0, 2 * np.pi)
        self.part = np.zeros(2)
        self.target = 0.3 * np.array([np.cos(angle), np.sin(angle)])
        self.steps, self.last = 0, np.zeros(2)
        return self.observation()

    def step(self, command: np.ndarray) -> Step:
        before = np.linalg.norm(self.target - self.part)
        self.part = self.part + 0.02 * np.clip(command, -1, 1)
        self.steps, self.last = self.steps + 1, command
        after = np.linalg.norm(self.target - self.part)
        placed = after < 0.03
        done = placed or self.steps >= self.LIMIT
        reward = 10 * (before - after) + (1.0 if placed else 0.0)
        return Step(self.observation(), reward, done, success=placed)

    @property
    def elapsed(self) -> float:
        return self.steps / self.LIMIT

    def observation(self) -> np.ndarray:
        obs = np.zeros(12, np.float32)
        obs[0:2] = obs[4:6] = self.part
        obs[7] = 1.0
        obs[8:10], obs[10:12] = self.target, self.last
        return obs


@pytest.fixture(scope="module")
def imitation() -> dict:
    return slow_student().state_dict()


def student(weights: dict) -> PolicyNet:
    net = PolicyNet(PolicyConfig(hidden=[32, 32]))
    net.load_state_dict(weights)
    return net.eval()


@pytest.fixture(scope="module")
def paid(imitation) -> tuple[PolicyNet, dict]:
    """The slow student after PPO without an anchor, and what the fine-tune returned."""
    net = student(imitation)
    return net, fine_tune_on_success(net, slides(), SETTINGS, seed=3)


def slides() -> list[Slide]:
    """Four lanes of episodes side by side."""
    return [Slide() for _ in range(4)]


def slow_student() -> PolicyNet:
    """Imitates a teacher that heads for the target at a third of full speed: it places
    every part, in about 40 steps of the 40 it has."""
    seed_everything(0)
    net = PolicyNet(PolicyConfig(hidden=[32, 32]))
    world, inputs, labels = Slide(), [], []
    for index in range(40):
        obs = world.start(index)
        for _ in range(5):
            offset = np.random.default_rng([index, _]).uniform(0, 0.3)
            obs[0:2] = obs[4:6] = world.target * offset / 0.3
            direction = world.target - obs[4:6]
            inputs.append(obs.copy())
            labels.append(0.35 * direction / np.linalg.norm(direction))
    fit(
        net,
        np.stack(inputs),
        np.stack(labels).astype(np.float32),
        epochs=60,
        batch_size=32,
        learning_rate=3e-3,
        seed=0,
    )
    return net.eval()


def steps_to_place(net: PolicyNet, episodes: int = 20) -> tuple[float, float]:
    """Mean steps and share placed, acting without exploration on unseen episodes."""
    world, steps, placed = Slide(), [], []
    for index in range(10_000, 10_000 + episodes):
        obs, step = world.start(index), None
        while step is None or not step.done:
            with torch.no_grad():
                step = world.step(net(torch.from_numpy(obs)[None])[0].numpy())
            obs = step.observation
        steps.append(world.steps)
        placed.append(step.success)
    return float(np.mean(steps)), float(np.mean(placed))


def test_a_student_paid_for_arriving_arrives_sooner(imitation, paid):
    before_steps, before_placed = steps_to_place(student(imitation))
    net, outcome = paid
    after_steps, after_placed = steps_to_place(net)
    assert after_steps < 0.8 * before_steps, (before_steps, after_steps)  # 22.4 against 39.8
    assert after_placed == 1.0 > before_placed
    assert outcome["episodes"] == SETTINGS.iterations * SETTINGS.episodes_per_iteration
    assert len(outcome["placed_while_exploring"]) == SETTINGS.iterations


def test_the_anchor_holds_the_student_to_its_imitation(imitation, paid):
    import dataclasses

    held = student(imitation)
    fine_tune_on_success(held, slides(), dataclasses.replace(SETTINGS, anchor_weight=100.0), seed=3)
    base = steps_to_place(student(imitation))[0]
    free_steps, held_steps = steps_to_place(paid[0])[0], steps_to_place(held)[0]
    assert abs(held_steps - base) < abs(free_steps - base) / 3, (base, free_steps, held_steps)


def test_while_the_critic_warms_up_the_student_is_untouched(imitation):
    import dataclasses

    net = student(imitation)
    weights = [p.detach().clone() for p in net.parameters()]
    warm_only = dataclasses.replace(SETTINGS, iterations=2, critic_warmup_iterations=2)
    fine_tune_on_success(net, slides(), warm_only, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters(), strict=True))


def test_advantages_stop_at_each_episode_end():
    rewards = np.array([0.0, 1.0, 5.0, 0.0], np.float32)
    values = np.array([0.5, 0.5, 2.0, 2.0], np.float32)
    last = np.array([False, True, False, True])  # two episodes of two steps
    adv = advantages(rewards, values, last, gamma=0.9, lam=1.0)
    # The first episode's second step: its reward and nothing after, not the next episode's.
    assert adv[1] == pytest.approx(1.0 - 0.5)
    assert adv[0] == pytest.approx(0.0 + 0.9 * 1.0 - 0.5)
    assert adv[3] == pytest.approx(0.0 - 2.0)
    assert adv[2] == pytest.approx(5.0 + 0.9 * 0.0 - 2.0)
