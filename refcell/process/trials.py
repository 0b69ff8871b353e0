"""Hardware trials on request (docs/operations.md, section 3).

Between episodes the cell looks for open requests on the channel and runs the oldest one it
has not completed: both arms' bundles are fetched and verified like a release, then the arms
alternate episode by episode (candidate, incumbent, ...) in the shift's slots, operator off,
each arm into its own logs whose `realloop` metadata names the request, the arm and the
attempt. An attempt's logs are uploaded only once all its episodes are recorded; a withdrawn
request, a stop or a kill abandons the attempt and nothing of it is uploaded. Completed
requests are remembered in `<box>/trials/<request_id>.done`.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.channels import EdgeError, open_channel
from edge.trials import ARMS, fetch_arm, open_requests, request_key
from pipelines.contract.params import CellParams, RecordParams
from refcell.process.clock import stamp
from refcell.process.line import TRIAL, Line, Shift
from refcell.process.uploader import LandingUploader
from refcell.recorder import CellIdentity, ShiftRecorder
from refcell.runner import Controller

TRIALS_DIR = "trials"
BUNDLES_DIR = "bundles"
COMPLETE_MARK = ".complete"  # in an attempt folder: every episode is recorded

log = logging.getLogger("realloop.cell")


class AttemptAbandoned(Exception):
    """The attempt stops here; its files are deleted, never uploaded."""


class TrialRunner:
    def __init__(
        self,
        channel_uri: str,
        cell_params: CellParams,
        record_params: RecordParams,
        box: Path,
        line: Line,
        uploader: LandingUploader,
        stop: threading.Event,
        poll_s: float,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.channel = open_channel(channel_uri)
        self.cell_id = cell_params.cell_id
        self.cell_params, self.record_params = cell_params, record_params
        self.folder = Path(box) / TRIALS_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.line, self.uploader, self.stop = line, uploader, stop
        self.poll_s, self._monotonic = poll_s, monotonic
        self._last_poll: float | None = None
        self._refused: set[str] = set()  # requests whose arms failed verification: not retried
        self._last_error: str | None = None
        self.reports: list[dict[str, Any]] = []

    # --- between episodes ------------------------------------------------------------
    def next_request(self) -> dict[str, Any] | None:
        """The oldest open request not yet done here (one channel listing per `poll_s`)."""
        now = self._monotonic()
        if self._last_poll is not None and now - self._last_poll < self.poll_s:
            return None
        self._last_poll = now
        self.deliver_complete()
        try:
            requests = open_requests(self.channel, self.cell_id)
        except EdgeError as exc:
            if str(exc) != self._last_error:
                log.warning("%s: cannot read trial requests: %s", self.cell_id, exc)
            self._last_error = str(exc)
            return None
        self._last_error = None
        for request in requests:
            rid = request["request_id"]
            if rid not in self._refused and not self._done_path(rid).exists():
                return request
        return None

    def recover(self) -> None:
        """After a restart: deliver attempts that finished recording, drop unfinished ones."""
        for attempt in sorted(self.folder.glob(f"*/*/{COMPLETE_MARK}")):
            rid, attempt_id = attempt.parts[-3:-1]
            log.info(
                "%s: trial %s: attempt %s finished before the restart",
                self.cell_id,
                rid,
                attempt_id,
            )
        self.deliver_complete()
        for request_dir in sorted(p for p in self.folder.iterdir() if p.is_dir()):
            if request_dir.name != BUNDLES_DIR:
                self._discard_attempts(request_dir, keep=None)

    def deliver_complete(self) -> None:
        """Upload recorded attempts whose upload has not gone through yet."""
        for mark in sorted(self.folder.glob(f"*/*/{COMPLETE_MARK}")):
            self._deliver(mark.parent, json.loads(mark.read_text()))

    # --- one attempt -----------------------------------------------------------------
    def run(self, request: dict[str, Any]) -> str:
        """Run one attempt of `request`; 'complete', 'withdrawn', 'stopped' or 'refused'."""
        rid = request["request_id"]
        arms = self._fetch_arms(request)
        if arms is None:
            return "refused"
        attempt_id = f"{self.cell_id}-{stamp(self.line.clock.now_ns())}-{secrets.token_hex(4)}"
        folder = self.folder / rid / attempt_id
        self._discard_attempts(folder.parent, keep=attempt_id)
        folder.mkdir(parents=True)
        episodes = request["episodes_per_arm"]
        log.info(
            "%s: trial %s: attempt %s started: %d episodes per arm, interleaved, candidate %s vs "
            "incumbent %s",
            self.cell_id,
            rid,
            attempt_id,
            episodes,
            arms["candidate"][0],
            arms["incumbent"][0],
        )
        try:
            outcomes = self._episodes(rid, attempt_id, folder, arms, episodes)
        except AttemptAbandoned as exc:
            shutil.rmtree(folder, ignore_errors=True)
            log.warning(
                "%s: trial %s: attempt %s abandoned (%s); nothing uploaded",
                self.cell_id,
                rid,
                attempt_id,
                exc,
            )
            return "stopped" if self.stop.is_set() else "withdrawn"
        report = {
            "request_id": rid,
            "attempt": attempt_id,
            **{arm: {"bundle_id": arms[arm][0], **outcomes[arm]} for arm in ARMS},
        }
        (folder / COMPLETE_MARK).write_text(json.dumps(report) + "\n")
        self._deliver(folder, report)
        return "complete"

    def _episodes(
        self,
        rid: str,
        attempt_id: str,
        folder: Path,
        arms: dict[str, tuple[str, Controller]],
        episodes: int,
    ) -> dict[str, dict[str, int]]:
        recorders: dict[str, ShiftRecorder] = {}
        successes = dict.fromkeys(ARMS, 0)
        try:
            for i in range(episodes * len(ARMS)):
                if self.stop.is_set():
                    raise AttemptAbandoned("the cell is stopping")
                if not self.channel.exists(request_key(self.cell_id, rid)):
                    raise AttemptAbandoned("the request was withdrawn from the channel")
                arm = ARMS[i % len(ARMS)]
                bundle_id, controller = arms[arm]
                slot = self.line.take()
                recorder = recorders.get(arm)
                if recorder is None or recorder.shift_id != slot.shift.shift_id:
                    if recorder is not None:
                        recorder.close()
                    metadata = {
                        "trial_request_id": rid,
                        "trial_arm": arm,
                        "trial_attempt": attempt_id,
                    }
                    recorder = recorders[arm] = self._recorder(
                        folder, slot.shift, bundle_id, metadata
                    )
                result = self.line.run(slot, controller, recorder, None, TRIAL)
                successes[arm] += result.success
        finally:
            for recorder in recorders.values():
                recorder.close()
        return {arm: {"episodes": episodes, "successes": successes[arm]} for arm in ARMS}

    def _recorder(
        self, folder: Path, shift: Shift, bundle_id: str, metadata: dict[str, str]
    ) -> ShiftRecorder:
        return ShiftRecorder(
            folder,
            self.cell_params,
            self.record_params,
            CellIdentity.from_params(self.cell_params, bundle_id),
            shift.start,
            in_place=True,
            metadata=metadata,
            file_indexes=shift.file_indexes,
        )

    def _fetch_arms(self, request: dict[str, Any]) -> dict[str, tuple[str, Controller]] | None:
        from pipelines.training import load_policy  # torch: only once there is a trial

        rid, arms = request["request_id"], {}
        try:
            for arm in ARMS:
                spec = request["arms"][arm]
                folder = fetch_arm(self.channel, self.cell_id, spec, self.folder / BUNDLES_DIR)
                arms[arm] = (spec["bundle_id"], load_policy(folder))
        except (EdgeError, OSError, ValueError) as exc:
            self._refused.add(rid)
            log.error(
                "%s: trial %s: refused: %s (not retried until the cell restarts)",
                self.cell_id,
                rid,
                exc,
            )
            return None
        return arms

    def _deliver(self, folder: Path, report: dict[str, Any]) -> None:
        rid, attempt_id = report["request_id"], report["attempt"]
        if not self.uploader.flush(folder):
            return  # the uploader said why; deliver_complete retries
        self._done_path(rid).write_text(json.dumps(report, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        if not any(folder.parent.iterdir()):
            folder.parent.rmdir()
        self.reports.append(report)
        log.info(
            "%s: trial %s: attempt %s complete and uploaded: candidate %d/%d, incumbent %d/%d",
            self.cell_id,
            rid,
            attempt_id,
            report["candidate"]["successes"],
            report["candidate"]["episodes"],
            report["incumbent"]["successes"],
            report["incumbent"]["episodes"],
        )

    def _discard_attempts(self, request_dir: Path, keep: str | None) -> None:
        """Unfinished attempts of a request: deleted, never uploaded."""
        for attempt in sorted(p for p in request_dir.glob("*") if p.is_dir()):
            if attempt.name == keep or (attempt / COMPLETE_MARK).exists():
                continue
            shutil.rmtree(attempt, ignore_errors=True)
            log.info(
                "%s: trial %s: unfinished attempt %s discarded; nothing of it uploaded",
                self.cell_id,
                request_dir.name,
                attempt.name,
            )

    def _done_path(self, rid: str) -> Path:
        return self.folder / f"{rid}.done"
