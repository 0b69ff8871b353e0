"""Run episodes: a controller drives the cell, an operator may take over, observers listen.

This is the reference cell's trial runner. Recording, evaluation, DAgger data collection and
hardware trials all go through `run_episode`, so they all see the same cell.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge.runtime import Fallback
from pipelines.contract.params import CellParams, OperatorParams
from refcell.cell import Cell, StepResult
from refcell.expert import Expert
from refcell.world import World


class Controller(Protocol):
    name: str

    def act(self, x) -> np.ndarray: ...


@dataclass
class StepRecord:
    """One control step as the cell experiences it (what a recorder may log)."""

    index: int
    time_s: float  # time at which the observation was taken
    observation: np.ndarray
    commanded: np.ndarray  # normalised command sent to the drives
    intervention: bool
    corrected: np.ndarray | None  # the operator's action, on intervention steps
    expert: np.ndarray | None  # privileged label, only when a caller asks for it
    result: StepResult
    fallback: Fallback | None = None  # the box handed this step to the fallback, and why


@dataclass
class EpisodeResult:
    episode_index: int
    success: bool
    failure: str | None
    safety_stop: str | None
    cycle_time_s: float
    steps: int
    interventions: int  # operator takeovers
    intervention_steps: int
    part_variant: str  # ground truth, never logged as such
    lighting: float
    under_load: bool
    final_distance_m: float


StepObserver = Callable[[Cell, StepRecord], None]
# The box's screen of an observation (edge.runtime.PolicySession.screen): None, the policy
# acts; a Fallback, the cell's fallback (the operator) drives this step instead.
# Its second argument is the part's footprint as the camera measured it at pick-up.
Screen = Callable[[np.ndarray, np.ndarray], Fallback | None]


class Operator:
    """The person at the cell: takes over when the policy steers away from what works.

    Takeover when policy and expert disagree by more than an angle for a few steps in a row;
    the operator then drives for at least `hold_steps`. This is human-gated DAgger: the
    corrections land exactly where the policy goes wrong.
    """

    def __init__(self, params: OperatorParams):
        self.params = params
        self.expert = Expert()
        self.cos_limit = float(np.cos(np.deg2rad(params.takeover_angle_deg)))

    def reset(self) -> None:
        self.disagreeing = 0
        self.holding = 0

    def decide(self, proposed: np.ndarray, cell: Cell) -> np.ndarray | None:
        """The operator's action if they take over this step, else None."""
        corrected = self.expert.act(cell.true_state())
        if self.holding > 0:
            self.holding -= 1
            return corrected
        self.disagreeing = (
            self.disagreeing + 1 if _disagree(proposed, corrected, self.cos_limit) else 0
        )
        if self.disagreeing >= self.params.takeover_after_steps:
            self.disagreeing = 0
            self.holding = self.params.hold_steps - 1
            return corrected
        return None

    def drive(self, cell: Cell) -> np.ndarray:
        """The box handed the step over (out of distribution, poor perception): the operator
        drives it, whatever they were about to do."""
        return self.expert.act(cell.true_state())


def _disagree(a: np.ndarray, b: np.ndarray, cos_limit: float) -> bool:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if nb < 0.1:  # the operator would stand still: any real motion disagrees
        return na > 0.3
    if na < 0.1:
        return True
    return float(a @ b) / (na * nb) < cos_limit


def propose(controller: Controller, cell: Cell) -> np.ndarray:
    if isinstance(controller, Expert):
        return controller.act(cell.true_state())
    return controller.act(cell.observation())


def run_episode(
    cell: Cell,
    controller: Controller,
    seed: int,
    episode_index: int,
    shift_episodes: int,
    operator: Operator | None = None,
    world: World | None = None,
    observers: tuple[StepObserver, ...] = (),
    label_with_expert: bool = False,
    screen: Screen | None = None,
) -> EpisodeResult:
    """`screen`: the box's per-step check; a step it refuses goes to the operator (or, with
    no operator, to the expert as the rule controller) and counts as an intervention."""
    cell.reset(seed, episode_index, shift_episodes, world=world)
    labeller = Expert() if label_with_expert else None
    if operator:
        operator.reset()
    if hasattr(controller, "begin_episode"):  # a policy that remembers the episode's frames
        controller.begin_episode()
    takeovers = takeover_steps = 0
    was_intervening = False
    while True:
        obs, time_s = cell.observation(), cell.time_s
        fallback = screen(obs, cell.part_extent_m) if screen else None
        if fallback is not None:
            corrected = operator.drive(cell) if operator else Expert().act(cell.true_state())
            proposed = corrected
            if hasattr(controller, "observe"):  # it still sees the frame it did not act on
                controller.observe(obs)
        else:
            proposed = propose(controller, cell)
            corrected = operator.decide(proposed, cell) if operator else None
        intervening = corrected is not None
        takeovers += intervening and not was_intervening
        takeover_steps += intervening
        was_intervening = intervening
        label = labeller.act(cell.true_state()) if labeller else None
        commanded = np.clip(corrected if intervening else proposed, -1.0, 1.0)
        result = cell.step(commanded)
        record = StepRecord(
            cell.step_index - 1,
            time_s,
            obs,
            commanded,
            intervening,
            corrected,
            label,
            result,
            fallback,
        )
        for observe in observers:
            observe(cell, record)
        if result.done:
            break
    state = cell.true_state()
    return EpisodeResult(
        episode_index=episode_index,
        success=result.success,
        failure=result.failure,
        safety_stop=result.safety_stop,
        cycle_time_s=cell.time_s,
        steps=cell.step_index,
        interventions=takeovers,
        intervention_steps=takeover_steps,
        part_variant=cell.part.name,
        lighting=cell.conditions.lighting,
        under_load=cell.conditions.under_load,
        final_distance_m=float(np.linalg.norm(state.part - state.target)),
    )


def run_episodes(
    world: World,
    cell_params: CellParams,
    controller: Controller,
    episodes: int,
    seed: int,
    operator: Operator | None = None,
    observers: tuple[StepObserver, ...] = (),
) -> Iterator[EpisodeResult]:
    """A shift of `episodes` episodes; lighting and load follow the shift's clock."""
    cell = Cell(world, cell_params)
    for index in range(episodes):
        yield run_episode(cell, controller, seed, index, episodes, operator, observers=observers)


def summarize(results: list[EpisodeResult]) -> dict:
    n = len(results)
    return {
        "episodes": n,
        "success_rate": sum(r.success for r in results) / n if n else 0.0,
        "safety_stops": sum(r.safety_stop is not None for r in results),
        "interventions": sum(r.interventions for r in results),
        "intervention_steps": sum(r.intervention_steps for r in results),
        "mean_cycle_time_s": float(np.mean([r.cycle_time_s for r in results])) if n else 0.0,
        "p95_cycle_time_s": float(np.percentile([r.cycle_time_s for r in results], 95))
        if n
        else 0.0,
        "failures": _count(r.failure for r in results if r.failure),
    }


def _count(items) -> dict[str, int]:
    return dict(sorted(Counter(items).items()))
