"""Production shifts: the box's active model drives, the operator takes over a failing policy.

Logs are written in place into `<box>/recordings/` (the file grows under its final name and is
closed at rotation), and every closed file is uploaded with its captures after the episode
that closed it. The hidden `.groundtruth/<shift_id>.jsonl` (the true cause of each failure, by
counterfactual replay) stays on the box for tests.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipelines.contract.params import CellParams, RecordParams
from refcell.process.edgebox import ActiveModel
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
    ):
        """`sim_world` None: no ground truth (the counterfactual replays cost sim time)."""
        self.line, self.cell_params, self.record_params = line, cell_params, record_params
        self.folder = Path(box) / RECORDINGS_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.uploader, self.sim_world = uploader, sim_world
        self.operator = Operator(record_params.operator)
        self.recorder: ShiftRecorder | None = None
        self.episodes = self.successes = 0

    def recover(self) -> None:
        """Before the first shift: set aside what a killed run left open, upload the rest."""
        self.uploader.set_aside_unclosed(self.folder)
        self.uploader.flush(self.folder)

    def episode(self, model: ActiveModel) -> EpisodeResult:
        slot = self.line.take()
        recorder = self._recorder_for(slot.shift, model.bundle_id)
        result = self.line.run(slot, model.controller, recorder, self.operator, PRODUCTION)
        self.episodes += 1
        self.successes += result.success
        if self.sim_world is not None:
            self._record_truth(slot.shift, recorder.episode.episode_id, result, model)
        self.uploader.flush(self.folder, open_file=self._open_file())
        return result

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
