"""The cell's edge box: follow the channel with the same code a real box runs (`edge.agent`),
and hand the cell's controller the box's active model.

Every poll runs `edge.agent.pull` (verify, then activate atomically); the controller is the
policy in `<box>/current`, reloaded when the active bundle changes and loaded only after its
sha256 matches the manifest. With nothing published the cell idles and says so once a minute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.agent import pull, status
from edge.bundle import pointer_key
from edge.channels import EdgeError, open_channel
from refcell.runner import Controller

IDLE_LOG_S = 60.0

log = logging.getLogger("realloop.cell")


@dataclass(frozen=True)
class ActiveModel:
    bundle_id: str
    model_version: Any
    controller: Controller


class EdgeBox:
    def __init__(
        self,
        channel_uri: str,
        cell_id: str,
        box: Path,
        poll_s: float,
        idle_log_s: float = IDLE_LOG_S,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.channel_uri, self.cell_id, self.box = channel_uri, cell_id, Path(box)
        self.poll_s, self.idle_log_s, self._monotonic = poll_s, idle_log_s, monotonic
        self.model: ActiveModel | None = None
        self._last_poll: float | None = None
        self._last_idle_log: float | None = None
        self._last_error: str | None = None

    def poll(self) -> ActiveModel | None:
        """The active model after a pull (at most one pull per `poll_s`), or None: idle."""
        now = self._monotonic()
        if self._last_poll is None or now - self._last_poll >= self.poll_s:
            self._last_poll = now
            summary = self._pull() or self._installed()
            if summary is not None and (
                self.model is None or summary["bundle_id"] != self.model.bundle_id
            ):
                self._load(summary)
        if self.model is None and (
            self._last_idle_log is None or now - self._last_idle_log >= self.idle_log_s
        ):
            self._last_idle_log = now
            log.info("%s", self.idle_message())
        return self.model

    def idle_message(self) -> str:
        if self._last_error:
            return f"{self.cell_id}: idle, no verified production model ({self._last_error})"
        return (
            f"{self.cell_id}: idle, no production model on {self.channel_uri} (publish one with "
            f"`realloop deploy --initial PATH --cell {self.cell_id}`)"
        )

    def _pull(self) -> dict[str, Any] | None:
        try:
            summary = pull(self.channel_uri, self.cell_id, self.box)
        except EdgeError as exc:
            self._pull_failed(str(exc))
            return None
        self._last_error = None
        return summary

    def _pull_failed(self, message: str) -> None:
        try:
            published = open_channel(self.channel_uri).exists(pointer_key(self.cell_id))
        except EdgeError:
            published = True  # the channel itself failed: say so below
        if not published:
            self._last_error = None  # nothing published: the idle message says what to do
            return
        if message != self._last_error:
            kept = f"; keeping bundle {self.model.bundle_id}" if self.model else ""
            log.warning("%s: pull failed: %s%s", self.cell_id, message, kept)
        self._last_error = message

    def _installed(self) -> dict[str, Any] | None:
        """What the box already runs (a restart, or a channel that is unreachable now)."""
        try:
            return status(self.box)
        except EdgeError:
            return None

    def _load(self, summary: dict[str, Any]) -> None:
        from pipelines.training import load_policy  # torch: only once there is a model

        bundle_id = summary["bundle_id"]
        if not summary["intact"]:
            log.error(
                "%s: bundle %s on the box fails its sha256 check; not loading it (pull again)",
                self.cell_id,
                bundle_id,
            )
            return
        try:
            controller = load_policy(summary["path"])
        except (OSError, ValueError) as exc:
            log.error("%s: bundle %s: cannot load the policy (%s)", self.cell_id, bundle_id, exc)
            return
        self.model = ActiveModel(bundle_id, summary.get("model_version"), controller)
        log.info(
            "%s: running bundle %s (model version %s) from %s",
            self.cell_id,
            bundle_id,
            summary.get("model_version"),
            self.channel_uri,
        )
