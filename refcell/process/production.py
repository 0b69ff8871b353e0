"""Production shifts: the box's active model drives, the operator takes over a failing policy.

Logs are written in place into `<box>/recordings/` (the file grows under its final name and is
closed at rotation), and every closed file is uploaded with its captures after the episode
that closed it. The hidden `.groundtruth/<shift_id>.jsonl` (the true cause of each failure, by
counterfactual replay) stays on the box for tests.

After each activation the new model's first production episodes are its health window
(refcell.process.health; looked at every `edge.health_episodes`, up to
`edge.health_max_episodes`): a failure rolls the box back and leaves a `rollback` capture on
the episode that decided it, uploaded with its log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipelines.contract.params import CellParams, EdgeParams, RecordParams
from refcell.process.edgebox import ActiveModel
from refcell.process.health import HealthWindow
from refcell.process.line import PRODUCTION, TRIAL, Line, Shift
from refcell.process.uploader import LandingUploader
from refcell.recorder import CellIdentity, ShiftRecorder
from refcell.runner import EpisodeResult, Operator
from refcell.shift import GROUND_TRUTH_DIR, truth_row
from refcell.truth import true_failure_cause
from refcell.world import World

RECORDINGS_DIR = "recordings"

log = logging.getLogger("realloop.cell")


class Production:
    def __init__(
        self,
        line: Line,
        cell_params: CellParams,
        record_params: RecordParams,
        box: Path,
        uploader: LandingUploader,
        sim_world: World | None,
        edge_params: EdgeParams | None = None,
        roll_back: Callable[[str], dict[str, Any] | None] | None = None,
    ):
        """`sim_world` None: no ground truth (the counterfactual replays cost sim time).
        `edge_params` and `roll_back` (EdgeBox.roll_back): the health check; without them
        there is none."""
        self.line, self.cell_params, self.record_params = line, cell_params, record_params
        self.folder = Path(box) / RECORDINGS_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.uploader, self.sim_world = uploader, sim_world
        self.operator = Operator(record_params.operator)
        self.recorder: ShiftRecorder | None = None
        self.episodes = self.successes = 0
        self.edge_params, self.roll_back = edge_params, roll_back
        self.health: HealthWindow | None = None
        self.rollbacks: list[dict[str, Any]] = []

    def recover(self) -> None:
        """Before the first shift: set aside what a killed run left open, upload the rest."""
        self.uploader.set_aside_unclosed(self.folder)
        self.uploader.flush(self.folder)

    def episode(self, model: ActiveModel) -> EpisodeResult:
        slot = self.line.take()
        recorder = self._recorder_for(slot.shift, model.bundle_id)
        screen = model.screen if self.edge_params is None or self.edge_params.fallback else None
        result = self.line.run(
            slot, model.controller, recorder, self.operator, PRODUCTION, screen=screen
        )
        self.episodes += 1
        self.successes += result.success
        if self.sim_world is not None:
            self._record_truth(slot.shift, recorder.episode.episode_id, result, model)
        self._check_health(model, result, recorder)
        self.uploader.flush(self.folder, open_file=self._open_file())
        return result

    def _check_health(
        self, model: ActiveModel, result: EpisodeResult, recorder: ShiftRecorder
    ) -> None:
        """Count the episode in the model's health window; on a failure, roll back."""
        if self.edge_params is None or self.roll_back is None:
            return
        if self.health is None or self.health.bundle_id != model.bundle_id:
            edge = self.edge_params
            self.health = HealthWindow(
                model.bundle_id,
                edge.health_episodes,
                model.lower_bound,
                episodes_most=edge.health_max_episodes,
            )
        reason = self.health.record(result.success, result.safety_stop)
        if reason is None:
            return
        restored = self.roll_back(reason)
        if restored is None:
            return  # nothing to go back to: logged by the box; the model keeps running
        note = f"box rolled back from {model.bundle_id} to {restored['bundle_id']}: {reason}"
        capture = recorder.capture_after_episode("rollback", note)
        self.rollbacks.append(
            {**self.health.as_record(), "restored": restored["bundle_id"], "capture": str(capture)}
        )
        # The model restored is the one that ran before: judged already, never rolled back
        # again (its `previous` is the refused bundle).
        self.health = HealthWindow(
            restored["bundle_id"], 0, None, verdict=f"restored by rollback from {model.bundle_id}"
        )

    def end_shift(self, shift: Shift) -> None:
        """Called by the line right after a shift's last episode (production or trial)."""
        if self.recorder is not None and self.recorder.shift_id == shift.shift_id:
            self.close()
        production = shift.outcomes.get(PRODUCTION, [])
        trials = shift.outcomes.get(TRIAL, [])
        rate = f"{sum(production) / len(production):.0%}" if production else "-"
        log.info(
            "%s: shift %s ended: %d production episodes (success %s), %d trial episodes",
            self.cell_params.cell_id,
            shift.shift_id,
            len(production),
            rate,
            len(trials),
        )

    def close(self) -> None:
        """Close the open log and upload everything closed (at shift end and on stop)."""
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
        self.uploader.flush(self.folder)

    # --- internals -------------------------------------------------------------------
    def _recorder_for(self, shift: Shift, bundle_id: str) -> ShiftRecorder:
        if self.recorder is not None and self.recorder.shift_id != shift.shift_id:
            self.close()
        if self.recorder is None:
            self.recorder = ShiftRecorder(
                self.folder,
                self.cell_params,
                self.record_params,
                CellIdentity.from_params(self.cell_params, bundle_id),
                shift.start,
                in_place=True,
                file_indexes=shift.file_indexes,
            )
            log.info(
                "%s: shift %s started (%d episodes)",
                self.cell_params.cell_id,
                shift.shift_id,
                shift.episodes,
            )
        elif self.recorder.identity.policy_version != bundle_id:
            self.recorder.use_policy(bundle_id)  # closes the file that names the old model
        return self.recorder

    def _open_file(self) -> Path | None:
        current = self.recorder.current if self.recorder else None
        return current.path if current else None

    def _record_truth(
        self, shift: Shift, episode_id: str, result: EpisodeResult, model: ActiveModel
    ) -> None:
        row = truth_row(episode_id, result)
        if not result.success:
            row["true_cause"] = true_failure_cause(
                self.line.cell,
                self.sim_world,
                model.controller,
                shift.seed,
                result,
                shift.episodes,
                self.operator,
            )
        path = self.folder / GROUND_TRUTH_DIR / f"{shift.shift_id}.jsonl"
        path.parent.mkdir(exist_ok=True)
        with path.open("a") as out:
            out.write(json.dumps(row) + "\n")
