"""`realloop cell run`: one reference cell as a process, meeting realloop only through storage.

Between episodes the cell polls its edge box (pull, verify, activate; reload the controller
when the active bundle changes), runs an open trial request if there is one, and otherwise
records the next production episode. SIGTERM or SIGINT finishes the current episode, abandons
an unfinished trial attempt, closes and uploads the open log, and ends the run.

Box folder: the edge box's own layout (docs/edge.md) plus `recordings/` (logs being written,
captures, `.groundtruth/`), `uploaded/` (what reached the landing zone), `trials/` (attempts,
fetched arms, `<request_id>.done`) and `cell-clock.json` (the cell clock's high-water mark).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.contract.params import CellParams, EdgeParams, RecordParams
from refcell.cell import Cell
from refcell.process.clock import NS, CellClock, resumed_start_ns
from refcell.process.edgebox import IDLE_LOG_S, EdgeBox
from refcell.process.line import Line, scheduled_start_ns
from refcell.process.production import Production
from refcell.process.trials import TrialRunner
from refcell.process.uploader import LandingUploader
from refcell.timeline import held_until_ns, load_timeline
from refcell.world import load_world

UPLOADED_DIR = "uploaded"

log = logging.getLogger("realloop.cell")


@dataclass(frozen=True)
class CellRunConfig:
    cell_id: str
    world: str  # a shipped world's name or a world YAML file
    channel: str
    landing: str
    box: Path
    episodes_per_shift: int = 300
    seed: int = 0
    speed: float = 60.0
    poll_s: float = 2.0  # wall seconds between pulls, and between looks for trial requests
    ground_truth: bool = True
    idle_log_s: float = IDLE_LOG_S
    max_shifts: int | None = None  # production shifts to record; then the cell only runs trials
    # Production starts at fixed times of the line's day, this many a day, each recording
    # episodes_per_shift episodes; the clock idles between (trials still run on request), so
    # a day takes 86,400 / speed wall seconds. None: production runs back to back.
    shifts_per_day: int | None = None
    # A harness's hold on the line (refcell.timeline.HOLD_FILE): idling stops at the line day
    # it names. None: the line keeps the wall's pace only.
    hold_file: Path | None = None


class CellProcess:
    def __init__(
        self,
        config: CellRunConfig,
        cell_params: CellParams,
        record_params: RecordParams,
        stop: threading.Event | None = None,
        edge_params: EdgeParams | None = None,
    ):
        """`cell_params` already carry this cell's id. `edge_params`: the box's OOD screen's
        confidence floor and the health check after each activation (none without)."""
        self.config, self.stop = config, stop or threading.Event()
        box = Path(config.box)
        box.mkdir(parents=True, exist_ok=True)
        self.clock = CellClock(config.speed, resumed_start_ns(box), self.stop)
        self.line = Line(
            Cell(load_world(config.world), cell_params),
            self.clock,
            box,
            config.episodes_per_shift,
            config.seed,
            on_shift_end=lambda shift: self.production.end_shift(shift),
            timeline=load_timeline(config.world),
        )
        if config.hold_file is not None:
            hold_file, clock = Path(config.hold_file), self.clock
            clock.hold_ns = lambda: held_until_ns(hold_file, self.line.epoch_ns, clock.now_ns())
        self.uploader = LandingUploader(config.landing, box / UPLOADED_DIR, config.cell_id)
        sim = load_world("sim") if config.ground_truth else None
        self.production = Production(
            self.line,
            cell_params,
            record_params,
            box,
            self.uploader,
            sim,
            edge_params,
            roll_back=lambda reason: self.box.roll_back(reason),
        )
        self.box = EdgeBox(
            config.channel,
            config.cell_id,
            box,
            config.poll_s,
            config.idle_log_s,
            min_confidence=edge_params.min_confidence if edge_params else 0.0,
        )
        self.trials = TrialRunner(
            config.channel,
            cell_params,
            record_params,
            box,
            self.line,
            self.uploader,
            self.stop,
            config.poll_s,
        )
        self.stopped_by: str | None = None
        self._wall_start = time.monotonic()
        self._scheduled_ns: int | None = None  # the scheduled start production last took
        self._owed = 0  # production episodes still to record for it

    def stop_on_signals(self) -> None:
        """SIGTERM and SIGINT end the run after the current episode (main thread only)."""

        def handle(signum: int, _frame: Any) -> None:
            if not self.stop.is_set():
                log.info(
                    "%s: %s: stopping after this episode",
                    self.config.cell_id,
                    signal.Signals(signum).name,
                )
            self.stopped_by = signal.Signals(signum).name
            self.stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handle)

    def run(self) -> dict[str, Any]:
        """Recover what a previous run left, run until stopped, then finish."""
        config = self.config
        log.info(
            "%s: cell up on world %s, speed %gx, channel %s, landing %s, box %s",
            config.cell_id,
            config.world,
            config.speed,
            config.channel,
            config.landing,
            config.box,
        )
        self.production.recover()
        self.trials.recover()
        while not self.stop.is_set():
            self.step()
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """Close and upload the open log; the run's summary."""
        self.production.close()
        log.info(
            "%s: stopped; %d files uploaded this run",
            self.config.cell_id,
            len(self.uploader.uploaded),
        )
        return self.summary(time.monotonic() - self._wall_start)

    def step(self) -> None:
        """One turn between episodes: the box, then trials, then production (or idling)."""
        model = self.box.poll()
        request = self.trials.next_request()
        if request is not None:
            self.trials.run(request)
        elif model is not None and not self._production_done() and self._production_due():
            self.production.episode(model)
            self._end_scheduled_shift()
        else:
            self.stop.wait(self.config.poll_s)
            self.clock.catch_up()

    def _production_due(self) -> bool:
        """Back to back without a schedule; with one, a scheduled start that production has
        not taken yet owes a shift's episodes (a start missed while trials ran is taken late,
        several missed ones once)."""
        shifts_per_day = self.config.shifts_per_day
        if shifts_per_day is None or self._owed > 0:
            return True
        self.clock.catch_up()
        due = scheduled_start_ns(self.line.epoch_ns, shifts_per_day, self.clock.now_ns())
        if self._scheduled_ns is not None and due <= self._scheduled_ns:
            return False
        self._scheduled_ns, self._owed = due, self.config.episodes_per_shift
        if self.line.shift is not None:  # opened by trials before this start
            self.line.end_shift()
        return True

    def _end_scheduled_shift(self) -> None:
        """Count the episode against what production owes; when it owes nothing and trials
        took slots of its shift (the line's shift is still open), close and upload its log
        now: the day's production must land the day it ran, not with the next shift."""
        if self.config.shifts_per_day is None:
            return
        self._owed = max(0, self._owed - 1)
        if self._owed == 0 and self.line.shift is not None:
            self.production.close()

    def _production_done(self) -> bool:
        done = self.config.max_shifts is not None
        return done and self.line.shifts_ended >= self.config.max_shifts

    def summary(self, wall_s: float) -> dict[str, Any]:
        model = self.box.model
        production = self.production
        return {
            "cell_id": self.config.cell_id,
            "world": self.config.world,
            "speed": self.config.speed,
            "stopped_by": self.stopped_by,
            "wall_s": round(wall_s, 2),
            "cell_clock_start": _iso(self.clock.start_ns),
            "cell_clock_end": _iso(self.clock.now_ns()),
            "bundle_id": model.bundle_id if model else None,
            "shifts_ended": self.line.shifts_ended,
            "production_episodes": production.episodes,
            "production_success_rate": (
                round(production.successes / production.episodes, 4)
                if production.episodes
                else None
            ),
            "health": production.health.as_record() if production.health else None,
            "rollbacks": production.rollbacks,
            "trials": self.trials.reports,
            "uploaded": len(self.uploader.uploaded),
        }


def _iso(cell_ns: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(cell_ns / NS, tz=UTC).isoformat(timespec="seconds")


class CellClockFormatter(logging.Formatter):
    """Log lines stamped with the cell clock, the time the cell's logs carry."""

    def __init__(self, clock: CellClock, fmt: str):
        super().__init__(fmt)
        self.clock = clock

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return self.clock.now().strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def log_to_stderr(clock: CellClock) -> logging.Handler:
    handler = logging.StreamHandler()
    handler.setFormatter(CellClockFormatter(clock, "%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return handler
