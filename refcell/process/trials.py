"""Hardware trials on request (docs/operations.md, section 3).

Between episodes the cell looks for open requests on the channel and runs the oldest one it
has not completed. Requests and both arms' bundles are read through the box's TUF client only
(edge.trials: `<cell>/trials.json` and the arms' files are targets signed by the cell's key), so
an unsigned or wrongly signed request or bundle is refused and never run; then the arms
alternate episode by episode (candidate, incumbent, ...) in the shift's slots, operator off,
each arm into its own logs whose `realloop` metadata names the request, the arm and the
attempt. The gate is sequential (pipelines.release.sequential): a request names its planned
looks, and at each look the cell closes the attempt's logs and uploads them, so the loop can
judge them. The design is fixed in the request, so the cell applies the same test at each look
(pipelines.release.gate.sequential_stop) and ends the attempt as soon as it has decided, or at
once on a candidate safety stop: the robot stops on the episodes the gate will judge, however
long the loop takes to look (it was busy building the next cell's candidates, and the cells
ran every trial to its cap). The loop also closes a request once it has judged it. A
withdrawn request, a stop or a kill abandons the attempt: what was recorded since the last look
is deleted, never uploaded. Completed requests are remembered in `<box>/trials/<request_id>.done`.
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

from edge.errors import EdgeError, NothingPublishedError
from edge.trials import ARMS, fetch_signed_arm, signed_requests
from edge.tuf_client import SignedChannel
from pipelines.contract.params import CellParams, RecordParams
from pipelines.release.gate import sequential_stop
from pipelines.release.sequential import CONTINUE, Design
from pipelines.release.trials import request_design
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
        self.channel_uri, self.box = channel_uri, Path(box)  # the box is enrolled: edgebox
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
            requests = self._signed_requests()
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
            design = request_design(request)
            outcomes = self._episodes(rid, attempt_id, folder, arms, episodes, design)
        except AttemptAbandoned as exc:
            shutil.rmtree(folder, ignore_errors=True)
            log.warning(
                "%s: trial %s: attempt %s abandoned (%s); nothing since its last look uploaded",
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
        cap: int,
        design: Design | None,
    ) -> dict[str, dict[str, int]]:
        """Both arms, interleaved, until the request's cap or the sequential test decides."""
        recorders: dict[str, ShiftRecorder] = {}
        outcomes = _ArmOutcomes()
        looks = set() if design is None else {int(size) for size in design.look_sizes()}
        try:
            while outcomes.pairs() < cap:
                if self.stop.is_set():
                    raise AttemptAbandoned("the cell is stopping")
                self._check_still_open(rid)
                arm = ARMS[outcomes.episodes() % len(ARMS)]
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
                outcomes.add(arm, self.line.run(slot, controller, recorder, None, TRIAL))
                if outcomes.episodes() % len(ARMS):
                    continue  # judged on whole pairs only, as the gate does
                decided = outcomes.decided(design)
                if decided is not None and outcomes.pairs() < cap:
                    log.info(
                        "%s: trial %s: the sequential test decided (%s) at %d episodes per arm; "
                        "no more trial episodes",
                        self.cell_id,
                        rid,
                        decided,
                        outcomes.pairs(),
                    )
                if decided is not None:
                    break
                if outcomes.pairs() in looks and outcomes.pairs() < cap:
                    self._upload_look(folder, recorders, rid, outcomes.pairs())
        finally:
            for recorder in recorders.values():
                recorder.close()
        return outcomes.report()

    def _upload_look(
        self, folder: Path, recorders: dict[str, ShiftRecorder], rid: str, pairs: int
    ) -> None:
        """A planned look: both arms' logs so far go up now, so the gate can judge them."""
        for recorder in recorders.values():
            recorder.close()
        recorders.clear()  # the next episode of each arm starts a new log
        uploaded = self.uploader.flush(folder)
        log.info(
            "%s: trial %s: look at %d episodes per arm: logs %s",
            self.cell_id,
            rid,
            pairs,
            "uploaded" if uploaded else "kept for the next upload (the uploader said why)",
        )

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
            signed = self._signed()
            for arm in ARMS:
                spec = request["arms"][arm]
                folder = fetch_signed_arm(signed, spec, self.folder / BUNDLES_DIR)
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

    def _signed(self) -> SignedChannel:
        """A fresh TUF session of the box (one refresh: ngclient's Updater refreshes once)."""
        signed = SignedChannel(self.box)
        signed.refresh()
        return signed

    def _signed_requests(self) -> list[dict[str, Any]]:
        try:
            return signed_requests(self._signed(), self.folder / BUNDLES_DIR)
        except NothingPublishedError:
            return []

    def _check_still_open(self, rid: str) -> None:
        """Between episodes: the signed list must still name the request (unlisted: withdrawn
        or closed; unreadable or refused: stop too, nothing unverified keeps running)."""
        try:
            listed = any(r["request_id"] == rid for r in self._signed_requests())
        except EdgeError as exc:
            raise AttemptAbandoned(f"the signed request list was refused: {exc}") from None
        if not listed:
            raise AttemptAbandoned("the request was withdrawn from the channel")

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


class _ArmOutcomes:
    """Each arm's successes, and the candidate's safety stops, in the order they ran."""

    def __init__(self):
        self.success: dict[str, list[bool]] = {arm: [] for arm in ARMS}
        self.candidate_stops: list[int] = []

    def add(self, arm: str, result) -> None:
        self.success[arm].append(bool(result.success))
        if arm == "candidate":
            self.candidate_stops.append(int(result.safety_stop is not None))

    def episodes(self) -> int:
        return sum(len(runs) for runs in self.success.values())

    def pairs(self) -> int:
        return min(len(runs) for runs in self.success.values())

    def decided(self, design: Design | None) -> str | None:
        """Why the request's sequential test stops on the pairs so far (efficacy, futility,
        safety), or None while it goes on (and always without a design: cap only)."""
        if design is None:
            return None
        why, _ = sequential_stop(
            design, self.success["candidate"], self.success["incumbent"], self.candidate_stops
        )
        return None if why == CONTINUE else why

    def report(self) -> dict[str, dict[str, int]]:
        return {
            arm: {"episodes": len(runs), "successes": int(sum(runs))}
            for arm, runs in self.success.items()
        }
