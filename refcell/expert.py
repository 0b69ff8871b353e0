"""The privileged expert: go behind the part, then push it along the line to the target.

It reads true state, so it plays the demonstrator in sim and the operator on the line.
Actions are normalised velocity commands in [-1, 1] per axis, like the policy's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refcell.cell import TrueState
from refcell.mjcf import PUSHER_RADIUS_M

APPROACH_MARGIN_M = 0.03  # stand-off behind the part before a push
ALIGN_TOLERANCE_M = 0.012  # lateral error that still counts as lined up
CLEARANCE_M = 0.03  # detour distance when going around the part
MAX_SPEED = 1.0
PUSH_GAIN = 8.0  # push speed per metre left to go (normalised units)
MOVE_GAIN = 12.0
LATERAL_GAIN = 12.0


@dataclass(frozen=True)
class PushFrame:
    """Where the pusher is relative to the part and its push line, as the expert sees it."""

    push_dir: np.ndarray  # unit vector from the part to the target
    side_dir: np.ndarray
    distance: float  # part to target, m
    contact: float  # part half-size plus the pusher's radius, m
    along: float  # pusher relative to the part along push_dir (negative: behind it)
    lateral: float

    @property
    def pushing(self) -> bool:
        """Lined up behind the part: push. Otherwise the expert repositions."""
        in_contact = self.along > -(self.contact + 0.01)
        tolerance = ALIGN_TOLERANCE_M * (1.6 if in_contact else 1.0)  # hysteresis while pushing
        return self.along < -0.6 * self.contact and abs(self.lateral) < tolerance


def push_frame(state: TrueState) -> PushFrame | None:
    """The expert's view of `state`; None once the part is on its target."""
    to_goal = state.target - state.part
    distance = float(np.linalg.norm(to_goal))
    if distance < 1e-6:
        return None
    push_dir = to_goal / distance
    side_dir = np.array([-push_dir[1], push_dir[0]])
    relative = state.pusher - state.part
    contact = state.part_size_m + PUSHER_RADIUS_M
    along, lateral = float(relative @ push_dir), float(relative @ side_dir)
    return PushFrame(push_dir, side_dir, distance, contact, along, lateral)


class Expert:
    """Stateless controller; `act` takes the cell's TrueState."""

    name = "expert"

    def act(self, state: TrueState) -> np.ndarray:
        frame = push_frame(state)
        if frame is None:
            return np.zeros(2)
        return self._push(frame) if frame.pushing else self._reposition(state, frame)

    def _push(self, frame: PushFrame) -> np.ndarray:
        """Drive along the push line; steer back onto it gently, since commands arrive late."""
        speed = np.clip(PUSH_GAIN * frame.distance, 0.25, 1.0)
        return _limit(frame.push_dir * speed - frame.side_dir * frame.lateral * LATERAL_GAIN)

    def _reposition(self, state: TrueState, frame: PushFrame) -> np.ndarray:
        push_dir, contact = frame.push_dir, frame.contact
        along, lateral = frame.along, frame.lateral
        staging = state.part - push_dir * (contact + APPROACH_MARGIN_M)
        waypoint = staging
        if along > -0.6 * contact:  # beside or in front of the part: go around, not through it
            side = frame.side_dir * (1.0 if lateral >= 0 else -1.0)
            if abs(lateral) < contact + 0.5 * CLEARANCE_M:  # first step out sideways
                waypoint = state.part + side * (contact + CLEARANCE_M) + push_dir * along
            else:  # then come back down the side to the staging point
                waypoint = staging + side * (contact + CLEARANCE_M)
        return _limit(MOVE_GAIN * (waypoint - state.pusher))


def _limit(action: np.ndarray) -> np.ndarray:
    norm = float(np.max(np.abs(action)))
    return action / norm * MAX_SPEED if norm > MAX_SPEED else action
