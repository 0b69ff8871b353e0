"""Open-loop replay of logged drive commands in the sim: what calibration fits against.

`pipelines.calibrate` asks for replays through this small interface (it never imports
refcell); `flows` hands it a `SimReplay`. Windows are rolled out in parallel with MuJoCo's
native `rollout`, one model per candidate physics.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import mujoco
import numpy as np
from mujoco import rollout

from pipelines.calibrate import ReplayBatch, ReplayResult
from pipelines.contract.params import CellParams
from refcell.cell import apply_physics
from refcell.mjcf import PUSHER_RADIUS_M, SUBSTEP_S, build_model
from refcell.world import PartVariant, Physics

_STATE = mujoco.mjtState.mjSTATE_FULLPHYSICS


class SimReplay:
    """Replays windows of a logged episode in the sim with candidate physics."""

    pusher_radius_m = PUSHER_RADIUS_M

    def __init__(self, cell_params: CellParams, threads: int | None = None):
        self.control_dt_s = cell_params.dt
        self.substeps = round(cell_params.dt / SUBSTEP_S)
        self.threads = threads or min(os.cpu_count() or 1, 8)

    def replay(
        self, physics: Sequence[Mapping[str, float]], batch: ReplayBatch
    ) -> list[ReplayResult]:
        """One result per candidate in `physics`, each over every window of `batch`."""
        part = PartVariant("replayed", batch.part_shape, batch.part_radius_m, 1.0, 1.0)
        models = [self._model(candidate, part) for candidate in physics]
        datas = [mujoco.MjData(models[0]) for _ in range(self.threads)]
        start = self._initial_states(models[0], datas[0], batch)
        n = len(batch.pusher_start)
        control = np.repeat(batch.applied, self.substeps, axis=1)  # held over the substeps
        state, _ = rollout.rollout(
            [m for m in models for _ in range(n)],
            datas,
            np.tile(start, (len(models), 1)),
            np.tile(control, (len(models), 1, 1)),
        )
        every = state[:, self.substeps - 1 :: self.substeps]  # after each control step
        qpos, qvel = 1, 1 + models[0].nq
        return [
            ReplayResult(
                pusher=chunk[..., qpos : qpos + 2],
                pusher_velocity=chunk[..., qvel : qvel + 2],
                part=chunk[..., qpos + 2 : qpos + 4],
                part_yaw=chunk[..., qpos + 4],
            )
            for chunk in np.split(every, len(models))
        ]

    def _model(self, candidate: Mapping[str, float], part: PartVariant) -> mujoco.MjModel:
        model = build_model(part)
        body = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, "part")
        apply_physics(model, Physics(**candidate), part, model.body_inertia[body].copy())
        return model

    def _initial_states(self, model, data, batch: ReplayBatch) -> np.ndarray:
        states = np.empty((len(batch.pusher_start), mujoco.mj_stateSize(model, _STATE)))
        for i, (pusher, part) in enumerate(zip(batch.pusher_start, batch.part_start, strict=True)):
            mujoco.mj_resetData(model, data)
            data.qpos[:] = [*pusher, *part]
            mujoco.mj_forward(model, data)
            mujoco.mj_getState(model, data, states[i], _STATE)
        return states
