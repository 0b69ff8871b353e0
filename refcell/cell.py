"""One cell, one episode at a time: reset, observe, step, and the safety monitor.

Randomness comes from separate streams per concern (start pose, part, sensors, perception,
latency), each seeded from (seed, episode index). Switching one line effect off therefore
leaves every other draw unchanged, which is what the ground-truth counterfactuals rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mujoco
import numpy as np

from pipelines.contract.params import CellParams
from pipelines.contract.schema import ACTION_SIZE
from refcell.mjcf import PART_MASS_IN_MJCF, SUBSTEP_S, build_model
from refcell.world import (
    PartVariant,
    Perception,
    Physics,
    ShiftConditions,
    World,
    draw_part,
    latency_sampler,
    shift_conditions,
)

_STREAMS = ("start", "part", "sensors", "perception", "latency", "inspection")
GRAVITY = 9.81
PART_LIMIT_M = 0.30  # a part pushed beyond this has left the table's reach


@dataclass(frozen=True)
class TrueState:
    """Privileged state, for the expert and for ground truth only."""

    pusher: np.ndarray
    pusher_velocity: np.ndarray
    part: np.ndarray
    part_yaw: float
    part_velocity: np.ndarray
    target: np.ndarray
    part_size_m: float


@dataclass
class Perceived:
    """What the cell's sensors report this step (noisy, biased on the line)."""

    joint_position: np.ndarray
    joint_velocity: np.ndarray
    part_xy: np.ndarray
    part_yaw: float
    confidence: float


@dataclass
class StepResult:
    done: bool = False
    success: bool = False
    safety_stop: str | None = None  # "joint_limit" | "speed" | "contact_force"
    failure: str | None = None  # what the cell itself can tell: timeout, part_lost, safety_stop
    contact_force_n: float = 0.0
    applied_action: np.ndarray = field(default_factory=lambda: np.zeros(ACTION_SIZE))


def apply_physics(
    model: mujoco.MjModel, physics: Physics, part: PartVariant, base_inertia: np.ndarray
) -> None:
    """Set the part's mass (and inertia with it), table friction and gantry damping."""
    mass = physics.part_mass_kg * part.mass_scale
    part_body = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, "part")
    model.body_mass[part_body] = mass
    model.body_inertia[part_body] = base_inertia * (mass / PART_MASS_IN_MJCF)
    sliding = physics.friction * mass * GRAVITY
    # Coulomb friction of the part on the table; turning resists over half its size.
    model.dof_frictionloss[2:4] = sliding
    model.dof_frictionloss[4] = sliding * 0.5 * part.size_m
    model.dof_damping[0:2] = physics.joint_damping


def camera_bias(perception: Perception, lighting: float) -> np.ndarray:
    """Where the camera sees a part, less where it is (m), at `lighting`."""
    return np.array(
        [
            perception.bias_x_m + perception.bias_drift_x_m * lighting,
            perception.bias_y_m + perception.bias_drift_y_m * lighting,
        ]
    )


class Cell:
    """The reference cell in one world. Reuse it across episodes: models are built once."""

    def __init__(self, world: World, params: CellParams):
        self.world = world
        self.params = params
        self.substeps = round(params.dt / SUBSTEP_S)
        self._models: dict[str, tuple[mujoco.MjModel, mujoco.MjData]] = {}
        self._base_inertia: dict[str, np.ndarray] = {}

    # --- episode lifecycle -------------------------------------------------------------
    def reset(
        self, seed: int, episode_index: int, shift_episodes: int, world: World | None = None
    ) -> np.ndarray:
        """Start an episode; `world` overrides the cell's world for this episode (sim DR)."""
        self.episode_world = world or self.world
        self.episode_index = episode_index
        self.rng = {
            name: np.random.default_rng([seed, episode_index, i]) for i, name in enumerate(_STREAMS)
        }
        self.conditions: ShiftConditions = shift_conditions(
            self.episode_world, episode_index, shift_episodes
        )
        self.part: PartVariant = draw_part(self.episode_world, self.rng["part"])
        self._draw_delay = latency_sampler(self.episode_world.latency)
        self.model, self.data = self._model_for(self.part)
        self._apply_physics()
        self._place_bodies()
        self.step_index = 0
        self.pending: list[tuple[int, int, np.ndarray]] = []  # (arrives_at, issued_at, action)
        self.applied = np.zeros(ACTION_SIZE)
        self.last_action = np.zeros(ACTION_SIZE)
        self.perceived = self._perceive()
        # The camera measures the part's footprint once, at pick-up, with its own noise.
        self.part_extent_m = 2 * self.part.size_m + self.rng["inspection"].normal(0, 0.002, 2)
        return self.observation()

    def step(self, action: np.ndarray) -> StepResult:
        """Command `action` (m/s per axis); it reaches the drives after the line's latency."""
        action = np.clip(np.asarray(action, dtype=float), -1.0, 1.0) * self.params.max_speed_mps
        delay = self._draw_delay(self.conditions, self.rng["latency"])
        self.pending.append((self.step_index + delay, self.step_index, action))
        self.applied = self._arrived_command()
        self.data.ctrl[:] = self.applied
        mujoco.mj_step(self.model, self.data, nstep=self.substeps)
        self.step_index += 1
        self.last_action = action / self.params.max_speed_mps
        result = self._judge()
        result.applied_action = self.applied.copy()
        self.perceived = self._perceive()
        return result

    # --- what the cell sees -------------------------------------------------------------
    def observation(self) -> np.ndarray:
        p = self.perceived
        return np.array(
            [
                *p.joint_position,
                *p.joint_velocity,
                *p.part_xy,
                p.part_yaw,
                p.confidence,
                *self.target,
                *self.last_action,
            ],
            dtype=np.float32,
        )

    def true_state(self) -> TrueState:
        d = self.data
        return TrueState(
            pusher=d.qpos[0:2].copy(),
            pusher_velocity=d.qvel[0:2].copy(),
            part=d.qpos[2:4].copy(),
            part_yaw=float(d.qpos[4]),
            part_velocity=d.qvel[2:4].copy(),
            target=self.target.copy(),
            part_size_m=self.part.size_m,
        )

    @property
    def time_s(self) -> float:
        return self.step_index * self.params.dt

    # --- internals ----------------------------------------------------------------------
    def _model_for(self, part: PartVariant) -> tuple[mujoco.MjModel, mujoco.MjData]:
        if part.name not in self._models:
            model = build_model(part)
            self._models[part.name] = (model, mujoco.MjData(model))
            part_body = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, "part")
            self._base_inertia[part.name] = model.body_inertia[part_body].copy()
        model, data = self._models[part.name]
        mujoco.mj_resetData(model, data)
        return model, data

    def _apply_physics(self) -> None:
        apply_physics(
            self.model, self.episode_world.physics, self.part, self._base_inertia[self.part.name]
        )

    def _place_bodies(self) -> None:
        rng = self.rng["start"]
        part = rng.uniform(-0.10, 0.10, size=2)
        heading = rng.uniform(0, 2 * np.pi)
        self.target = np.clip(
            part + rng.uniform(0.10, 0.18) * np.array([np.cos(heading), np.sin(heading)]),
            -0.2,
            0.2,
        )
        while True:  # the gantry starts clear of the part
            pusher = rng.uniform(-0.22, 0.22, size=2)
            if np.linalg.norm(pusher - part) > 0.08:
                break
        yaw = rng.uniform(-np.pi, np.pi)
        self.data.qpos[0:2] = pusher
        self.data.qpos[2:5] = [*part, yaw]
        mujoco.mj_forward(self.model, self.data)

    def _perceive(self) -> Perceived:
        sensors, perception = self.episode_world.sensors, self.episode_world.perception
        lighting = self.conditions.lighting
        rs, rp = self.rng["sensors"], self.rng["perception"]
        q, v = self.data.qpos, self.data.qvel  # read, not copied: the sums below are new arrays
        bias = camera_bias(perception, lighting)
        confidence = (
            perception.confidence_base
            - perception.confidence_drop * lighting
            + rp.normal(0.0, perception.confidence_noise)
        )
        return Perceived(
            joint_position=q[0:2] + rs.normal(0.0, sensors.joint_position_noise_m, 2),
            joint_velocity=v[0:2] + rs.normal(0.0, sensors.joint_velocity_noise_mps, 2),
            part_xy=q[2:4] + bias + rp.normal(0.0, perception.pose_noise_m, 2),
            part_yaw=float(q[4] + rp.normal(0.0, perception.yaw_noise_rad)),
            confidence=float(np.clip(confidence, 0.0, 1.0)),
        )

    def _arrived_command(self) -> np.ndarray:
        arrived = [p for p in self.pending if p[0] <= self.step_index]
        if not arrived:
            return self.applied
        newest = max(arrived, key=lambda p: p[1])
        # Commands older than the newest arrived one can never take effect any more.
        self.pending = [p for p in self.pending if p[1] > newest[1]]
        return newest[2]

    def _judge(self) -> StepResult:
        # Every step runs this: plain floats and views of MuJoCo's state, not a TrueState.
        limits, q, v = self.params.safety, self.data.qpos, self.data.qvel
        force = self._pusher_contact_force()
        stop = None
        if max(abs(q[0]), abs(q[1])) > limits.joint_limit_m:
            stop = "joint_limit"
        elif max(abs(v[0]), abs(v[1])) > limits.speed_mps:
            stop = "speed"
        elif force > limits.contact_force_n:
            stop = "contact_force"
        if stop:
            return StepResult(
                done=True, safety_stop=stop, failure="safety_stop", contact_force_n=force
            )
        if max(abs(q[2]), abs(q[3])) > PART_LIMIT_M:
            return StepResult(done=True, failure="part_lost", contact_force_n=force)
        part_velocity, offset = v[2:4], q[2:4] - self.target
        settled = np.sqrt(part_velocity.dot(part_velocity)) < self.params.settle_speed_mps
        on_target = np.sqrt(offset.dot(offset)) < self.params.success_tolerance_m
        if on_target and settled:
            return StepResult(done=True, success=True, contact_force_n=force)
        if self.step_index >= self.params.max_steps:
            return StepResult(done=True, failure="timeout", contact_force_n=force)
        return StepResult(contact_force_n=force)

    def _pusher_contact_force(self) -> float:
        wrench = np.zeros(6)
        biggest = 0.0
        for i in range(self.data.ncon):  # the pusher-part pair is the only contact there is
            mujoco.mj_contactForce(self.model, self.data, i, wrench)
            biggest = max(biggest, abs(wrench[0]))
        return biggest
