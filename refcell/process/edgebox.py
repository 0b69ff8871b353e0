"""The cell's edge box: follow the channel with the same code a real box runs (`edge.agent`),
and hand the cell's controller the box's active model.

Every poll runs `edge.agent.pull` (verify, then activate atomically); the controller is the
policy in `<box>/current`, reloaded when the active bundle changes and loaded only after its
files match their signed hashes. With nothing published the cell idles and says so once a minute.

A bundle with `policy.onnx` runs on the box's ONNX runtime (edge.runtime) with its OOD screen;
an older one on torch. A model the health check failed is rolled back (`roll_back`) and its
bundle refused (`<box>/refused.json`) until the channel names another one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.agent import pull, rollback, status
from edge.channels import EdgeError, open_channel
from edge.errors import NothingPublishedError
from edge.runtime import PolicySession, RuntimeLoadError, has_runtime_files
from edge.tuf_client import ENROLLMENT_FILE, TUF_DIR, enroll
from edge.tuf_repo import METADATA_PREFIX, named_release
from refcell.process.health import attested_lower_bound
from refcell.runner import Controller, Screen

IDLE_LOG_S = 60.0
REFUSED_FILE = "refused.json"  # bundle ids the health check rolled back

log = logging.getLogger("realloop.cell")


@dataclass(frozen=True)
class ActiveModel:
    bundle_id: str
    model_version: Any
    controller: Controller
    lower_bound: float | None = None  # the attested trial interval's lower end (health check)

    @property
    def screen(self) -> Screen | None:
        """The runtime's per-step OOD screen; None for a torch bundle (no ood.json)."""
        return self.controller.screen if isinstance(self.controller, PolicySession) else None


class EdgeBox:
    def __init__(
        self,
        channel_uri: str,
        cell_id: str,
        box: Path,
        poll_s: float,
        idle_log_s: float = IDLE_LOG_S,
        monotonic: Callable[[], float] = time.monotonic,
        min_confidence: float = 0.0,
    ):
        """`min_confidence`: perception confidence below which the runtime hands a step to
        the fallback (params `edge.min_confidence`)."""
        self.channel_uri, self.cell_id, self.box = channel_uri, cell_id, Path(box)
        self.min_confidence = min_confidence
        self.refused: set[str] = _read_refused(self.box)
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

    def roll_back(self, reason: str) -> dict[str, Any] | None:
        """The health check failed: refuse the active bundle, activate the previous one and
        run it. None (and the model unchanged) when the box has nothing to go back to."""
        active = self._installed()  # what the box runs: the model may not be loaded yet
        failed = active["bundle_id"] if active else self.model.bundle_id if self.model else None
        try:
            summary = rollback(self.box)
        except EdgeError as exc:
            log.error(
                "%s: health check failed (%s); cannot roll back: %s", self.cell_id, reason, exc
            )
            return None
        if failed is not None:
            self.refused.add(failed)
            _write_refused(self.box, self.refused)
        log.warning(
            "%s: health check failed (%s); rolled back to bundle %s and refusing %s until the "
            "channel publishes another",
            self.cell_id,
            reason,
            summary["bundle_id"],
            failed,
        )
        self._load(summary)
        return summary

    def _pull(self) -> dict[str, Any] | None:
        published = self._published_bundle_id()
        if published is not None and published in self.refused:
            self._pull_failed(f"the channel still names bundle {published}, rolled back here")
            return None
        try:
            self._enrolled()
            summary = pull(self.box)
        except NothingPublishedError:
            self._last_error = None  # nothing published: the idle message says what to do
            return None
        except EdgeError as exc:
            self._pull_failed(str(exc))
            return None
        self._last_error = None
        if summary.get("action") == "activated" and self.refused:
            if summary["bundle_id"] in self.refused:  # the unverified look above was stale
                return self.roll_back(f"bundle {summary['bundle_id']} was rolled back here")
            self.refused.clear()  # something newer runs: the refusal has done its job
            _write_refused(self.box, self.refused)
        return summary

    def _enrolled(self) -> None:
        """Enrol the box once with the channel's root metadata: `<box>/root.json` when the
        caller put it there (`realloop cell run --root`, the demo), else the channel's first
        root, trusted on first use. TOFU is for the reference cell only: a real box is
        enrolled with root.json from the publisher (`realloop-edge init --root`)."""
        self.box.mkdir(parents=True, exist_ok=True)  # the cell keeps its own files here too
        if (self.box / TUF_DIR / ENROLLMENT_FILE).exists():
            return
        root = self.box / "root.json"
        if not root.is_file():
            try:
                data = open_channel(self.channel_uri).get_bytes(f"{METADATA_PREFIX}1.root.json")
            except EdgeError as exc:
                raise NothingPublishedError(f"no signed metadata on the channel ({exc})") from None
            root.write_bytes(data)
            log.warning("%s: enrolled trusting the channel's root on first use", self.cell_id)
        enroll(self.channel_uri, self.cell_id, self.box, root)

    def _pull_failed(self, message: str) -> None:
        if message != self._last_error:
            kept = f"; keeping bundle {self.model.bundle_id}" if self.model else ""
            log.warning("%s: pull failed: %s%s", self.cell_id, message, kept)
        self._last_error = message

    def _published_bundle_id(self) -> str | None:
        """The bundle the channel names for this cell now (None: unknown; `pull` says why)."""
        try:
            release = named_release(open_channel(self.channel_uri), self.cell_id)
        except EdgeError:
            return None
        return release["bundle_id"] if release else None

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
            if has_runtime_files(summary["path"]):
                controller = PolicySession(summary["path"], self.min_confidence)
            else:
                controller = load_policy(summary["path"])  # a bundle from before the runtime
        except (OSError, ValueError, RuntimeLoadError) as exc:
            log.error("%s: bundle %s: cannot load the policy (%s)", self.cell_id, bundle_id, exc)
            return
        # Loaded completely before it replaces the running model; the cell calls `poll` only
        # between episodes, so an episode never changes model halfway.
        lower = attested_lower_bound(summary["path"])
        self.model = ActiveModel(bundle_id, summary.get("model_version"), controller, lower)
        log.info(
            "%s: running bundle %s (model version %s, %s) from %s",
            self.cell_id,
            bundle_id,
            summary.get("model_version"),
            "onnx runtime" if isinstance(controller, PolicySession) else "torch",
            self.channel_uri,
        )


def _read_refused(box: Path) -> set[str]:
    try:
        ids = json.loads((box / REFUSED_FILE).read_text()).get("bundle_ids", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {i for i in ids if isinstance(i, str)}


def _write_refused(box: Path, refused: set[str]) -> None:
    path = box / REFUSED_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"bundle_ids": sorted(refused)}) + "\n")
    os.replace(partial, path)
