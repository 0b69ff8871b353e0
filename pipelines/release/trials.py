"""Hardware trials as requests to a cell, and when they count as done.

The orchestrator never runs a trial (docs/operations.md, "The cell contract", section 3):
- it uploads the candidate's bundle to the cell's channel path without releasing it, and
  publishes a request naming the candidate, the incumbent (the bundle of the signed release),
  the cap of episodes per arm, the gate's sequential design and a deadline: signed by the
  cell's key, with both arms' files, as TUF targets of the cell's role (edge.trials), so the
  cell runs nothing else;
- a request is complete (decided) once one attempt's episodes, in the order they ran, let the
  sequential test (pipelines/release/gate.py) stop: efficacy, futility, a candidate safety
  stop, or the cap. The earliest decided attempt is judged, on exactly the episodes the test
  used; the loop then closes the request, so the cell stops running trials;
- a request not decided by its deadline is withdrawn: nothing is promoted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from edge.bundle import CONFIG_FILE, MODEL_FILE
from edge.channels import Channel, open_channel, upload_bundle
from edge.integrity import sha256_bytes
from edge.trials import (
    ARMS,
    Signing,
    close_request,
    new_request_id,
    publish_request,
    withdraw_request,
)
from edge.tuf_repo import named_release, release_target
from pipelines.contract.params import GateParams, PromoteParams, TrialsParams
from pipelines.contract.schema import EPISODES_SCHEMA, TRIAL_COLUMNS
from pipelines.ingest import read_dataset
from pipelines.release.gate import decide, sequential_stop
from pipelines.release.promote import check_is_registered_version, keys_location
from pipelines.release.sequential import CONTINUE, Design

# What completion needs of each episode: one narrow scan of the episodes files per poll.
_SCAN_ID_COLUMNS = ("episode_id", "cell_id", "source_sha256", "start_time")
_SCAN_COLUMNS = (*_SCAN_ID_COLUMNS, "success", "safety_stops", *TRIAL_COLUMNS)
NO_ATTEMPT = "-"  # a trial episode whose log names no attempt: grouped on its own
_DESIGN_KEYS = ("alpha", "margin", "looks", "futility_power")  # of GateParams, in the request


@dataclass(frozen=True)
class Attempt:
    """One run of a request by the cell: its episodes per arm and the logs holding them."""

    attempt: str
    started: datetime | None  # the earliest episode start of the attempt
    episodes: dict[str, list[str]]  # arm → episode ids, by start time
    episode_sources: dict[str, str]  # episode id → sha256 of its log (its batch)
    # episode id → (success, safety stops): what the interim look needs
    outcomes: dict[str, tuple[bool, int]] = field(default_factory=dict)

    @property
    def sources(self) -> dict[str, list[str]]:
        """arm → the logs holding its episodes, in the order their episodes started."""
        return {
            arm: list(dict.fromkeys(self.episode_sources[e] for e in ids))
            for arm, ids in self.episodes.items()
        }

    def counts(self) -> dict[str, int]:
        return {arm: len(self.episodes.get(arm, [])) for arm in ARMS}

    def is_complete(self, episodes_per_arm: int) -> bool:
        return all(n >= episodes_per_arm for n in self.counts().values())

    def first(self, n: int) -> Attempt:
        """This attempt cut to its first n episodes of each arm."""
        episodes = {arm: ids[:n] for arm, ids in self.episodes.items()}
        kept = {e for ids in episodes.values() for e in ids}
        sources = {e: sha for e, sha in self.episode_sources.items() if e in kept}
        outcomes = {e: o for e, o in self.outcomes.items() if e in kept}
        return Attempt(self.attempt, self.started, episodes, sources, outcomes)

    def arm_outcomes(self, arm: str) -> tuple[list[bool], list[int]]:
        """The arm's successes and safety stops, in the order its episodes started."""
        rows = [self.outcomes[e] for e in self.episodes.get(arm, [])]
        return [bool(ok) for ok, _ in rows], [int(stops or 0) for _, stops in rows]

    def as_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "started": None if self.started is None else self.started.isoformat(),
            "counts": self.counts(),
            "episodes": self.episodes,
            "sources": self.sources,
        }


# --- publishing ----------------------------------------------------------------------------


def incumbent_arm(channel: Channel | str, cell_id: str) -> dict[str, str]:
    """The bundle of the cell's signed release: what the cell runs now."""
    channel = _open(channel)
    release = named_release(channel, cell_id)
    if release is None:
        raise ValueError(
            f"{channel.describe(release_target(cell_id))}: no signed release for {cell_id}; "
            "run realloop deploy --initial"
        )
    return {"bundle_id": release["bundle_id"], "manifest_sha256": release["manifest_sha256"]}


def upload_candidate(
    channel: Channel | str,
    cell_id: str,
    policy_folder: Path,
    trained: dict[str, Any],
    *,
    workspace: Path | None = None,
) -> dict[str, str]:
    """Upload the candidate's bundle to the cell's channel path (not released); return
    its arm. `trained` is the fine-tune stage's result (registered_model, model_version,
    mlflow_run_id, dataset_version); the folder must hold exactly that registered version.
    Uploading the same candidate again rewrites the same bytes."""
    files = {name: Path(policy_folder) / name for name in (MODEL_FILE, CONFIG_FILE)}
    model, version = trained["registered_model"], str(trained["model_version"])
    check_is_registered_version(workspace, model, version, trained["mlflow_run_id"], files)
    metadata = {
        "model_name": model,
        "model_version": int(version) if version.isdigit() else version,
        "dataset_version": trained["dataset_version"],
        "mlflow_run_id": trained["mlflow_run_id"],
    }
    manifest, manifest_bytes = upload_bundle(_open(channel), cell_id, files, metadata)
    return {"bundle_id": manifest["bundle_id"], "manifest_sha256": sha256_bytes(manifest_bytes)}


def new_trial_request(
    cell_id: str,
    candidate: dict[str, str],
    incumbent: dict[str, str],
    params: TrialsParams,
    now: datetime | None = None,
    gate: GateParams | None = None,
) -> dict[str, Any]:
    """The request document, not yet published. Its id is fixed here, so publishing it again
    (a retry) rewrites the same request instead of opening a second one. `gate`: the
    sequential design, fixed in the request before any result (without it the attempt is
    judged at the cap)."""
    now = (now or datetime.now(UTC)).replace(microsecond=0)
    design = {} if gate is None else {"gate": {k: getattr(gate, k) for k in _DESIGN_KEYS}}
    return {
        **design,
        "request_id": new_request_id(cell_id, now),
        "cell_id": cell_id,
        "episodes_per_arm": params.max_episodes,
        "arms": {"candidate": dict(candidate), "incumbent": dict(incumbent)},
        "created_at": _iso(now),
        "deadline": _iso(now + timedelta(seconds=params.timeout_s)),
    }


def trial_signing(params: PromoteParams, workspace: Path | None = None) -> Signing:
    """The keys that sign trial requests: the release keys (promote.keys), whose cell keys
    the boxes trust for their cell's targets."""
    return Signing(keys_location(params.keys, workspace), params.timestamp_expiry_s)


def publish_trial_request(
    channel: Channel | str, request: dict[str, Any], signing: Signing
) -> dict[str, Any]:
    """Sign the request onto the channel (both arms' manifests must be there already)."""
    return publish_request(_open(channel), request, signing)


def withdraw_trial_request(
    channel: Channel | str, request: dict[str, Any], reason: str, signing: Signing
) -> bool:
    """Unlist the request (a new signed list), so the cell stops working on it; True if it
    was still listed."""
    cell, rid = request["cell_id"], request["request_id"]
    return withdraw_request(_open(channel), cell, rid, reason, signing)


def close_trial_request(
    channel: Channel | str, request: dict[str, Any], reason: str, signing: Signing
) -> bool:
    """Unlist a judged request (the cell already ran it)."""
    return close_request(_open(channel), request["cell_id"], request["request_id"], reason, signing)


# --- completion ----------------------------------------------------------------------------


def trial_episodes(dataset: Path, request_ids: list[str]) -> pa.Table:
    """The ingested episodes of these requests, only the columns completion needs. Files
    written before the trial columns existed read back with them null: they never match."""
    schema = pa.schema([EPISODES_SCHEMA.field(name) for name in _SCAN_COLUMNS])
    files = sorted(str(p) for p in (Path(dataset) / "episodes").glob("*.parquet"))
    if not files or not request_ids:
        return schema.empty_table()
    scan = ds.dataset(files, schema=schema, format="parquet")
    return scan.to_table(filter=pc.field("trial_request_id").isin(request_ids))


def attempts(episodes: pa.Table, request: dict[str, Any]) -> list[Attempt]:
    """The request's attempts, earliest first. Only episodes of the request's cell and of a
    known arm count: a log from another cell naming this request is no evidence for it."""
    rows = [
        row
        for row in episodes.select(list(_SCAN_COLUMNS)).to_pylist()
        if row["trial_request_id"] == request["request_id"]
        and row["cell_id"] == request["cell_id"]
        and row["trial_arm"] in ARMS
    ]
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["trial_attempt"] or NO_ATTEMPT, []).append(row)
    found = [_attempt(name, members) for name, members in grouped.items()]
    latest = datetime.max.replace(tzinfo=UTC)
    return sorted(found, key=lambda a: (a.started or latest, a.attempt))


def interim_look(request: dict[str, Any], attempt: Attempt) -> tuple[str, int]:
    """The sequential test on the attempt's episodes so far: (continue, pairs so far) or
    (why it stops: efficacy, futility, safety, cap; episodes per arm it used). A request
    without a design (made before the gate was sequential) stops only at its cap."""
    cap = request["episodes_per_arm"]
    design = request_design(request)
    if design is None:
        done = attempt.is_complete(cap)
        return ("cap", cap) if done else (CONTINUE, min(attempt.counts().values()))
    candidate, stops = attempt.arm_outcomes("candidate")
    incumbent, _ = attempt.arm_outcomes("incumbent")
    return sequential_stop(design, candidate[:cap], incumbent[:cap], stops[:cap])


def complete_attempt(episodes: pa.Table, request: dict[str, Any]) -> Attempt | None:
    """The earliest attempt on which the sequential test has decided, cut to the episodes it
    used (the design was fixed in the request before anyone saw a result); None while no
    attempt has decided."""
    for attempt in attempts(episodes, request):
        stopped, used = interim_look(request, attempt)
        if stopped != CONTINUE:
            return attempt.first(used)
    return None


def request_design(request: dict[str, Any], gate: GateParams | None = None) -> Design | None:
    """The sequential design the request names, capped at its episodes. A request made before
    the gate was sequential names none: judged at its cap in one look, with `gate`'s alpha
    and margin."""
    named = request.get("gate")
    if named is None and gate is None:
        return None
    values = {k: getattr(gate, k) for k in _DESIGN_KEYS} | {"looks": 1} if named is None else named
    return Design(**{k: values[k] for k in _DESIGN_KEYS}, max_pairs=request["episodes_per_arm"])


def progress(episodes: pa.Table, request: dict[str, Any]) -> dict[str, int]:
    """The most episodes any one attempt has of each arm, for progress reports."""
    best = dict.fromkeys(ARMS, 0)
    for attempt in attempts(episodes, request):
        for arm, n in attempt.counts().items():
            best[arm] = max(best[arm], n)
    return best


def check_requests(dataset: Path, requests: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """For each key's request: its complete attempt (or None) and its progress, from one
    scan of the episodes table."""
    episodes = trial_episodes(dataset, [r["request_id"] for r in requests.values()])
    return {
        key: {"attempt": complete_attempt(episodes, r), "progress": progress(episodes, r)}
        for key, r in requests.items()
    }


def poll_state(request: dict[str, Any], attempt: Attempt | None, now: datetime) -> str:
    """The request's state at `now`: complete, timed out (past its deadline with no complete
    attempt) or waiting."""
    if attempt is not None:
        return "complete"
    if now >= parse_time(request["deadline"]):
        return "timed out"
    return "waiting"


# --- judging -------------------------------------------------------------------------------


def judge_attempt(
    dataset: Path, request: dict[str, Any], attempt: Attempt, gate: GateParams
) -> dict[str, Any]:
    """The gate on the attempt's episodes, in the order they ran, with the design the request
    named: candidate arm vs incumbent arm. The record names the request, the attempt, the
    bundles, and each arm's episodes (those the sequential test used) and logs."""
    tables = {}
    for arm in ARMS:
        table, _ = read_dataset(dataset, attempt.sources[arm])
        wanted = pa.array(attempt.episodes[arm])
        chosen = table.filter(pc.is_in(table.column("episode_id"), value_set=wanted))
        if chosen.num_rows != len(attempt.episodes[arm]):
            raise ValueError(
                f"{dataset}: request {request['request_id']} attempt {attempt.attempt} arm "
                f"{arm}: {chosen.num_rows} of {len(attempt.episodes[arm])} episodes found; "
                "run realloop ingest and retry"
            )
        order = {e: i for i, e in enumerate(attempt.episodes[arm])}
        ranks = [order[e] for e in chosen.column("episode_id").to_pylist()]
        tables[arm] = chosen.take(sorted(range(len(ranks)), key=ranks.__getitem__))
    design = request_design(request, gate)
    named = dataclasses.replace(gate, **{k: getattr(design, k) for k in _DESIGN_KEYS})
    decision = decide(tables["candidate"], tables["incumbent"], named, design.max_pairs)
    used = attempt.first(decision.episodes_used)
    return decision.as_record() | {
        "trial_request_id": request["request_id"],
        "trial_attempt": attempt.attempt,
        "episodes_per_arm": decision.episodes_used,  # judged; the cap is max_episodes
        "arms": request["arms"],
        "trial_sources": used.sources,
        "trial_episodes": used.episodes,
    }


# --- helpers -------------------------------------------------------------------------------


def parse_time(text: str) -> datetime:
    """An ISO-8601 UTC time as requests write it (`2026-12-03T12:15:00Z`)."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _attempt(name: str, rows: list[dict]) -> Attempt:
    rows = sorted(rows, key=lambda r: (r["start_time"], r["episode_id"]))
    # An episode counts once, even if two different logs carry it (a re-recorded upload).
    first: dict[str, dict] = {}
    for row in rows:
        first.setdefault(row["episode_id"], row)
    rows = list(first.values())
    episodes = {arm: [r["episode_id"] for r in rows if r["trial_arm"] == arm] for arm in ARMS}
    sources = {r["episode_id"]: r["source_sha256"] for r in rows}
    outcomes = {r["episode_id"]: (bool(r["success"]), int(r["safety_stops"] or 0)) for r in rows}
    started = min((r["start_time"] for r in rows), default=None)
    return Attempt(name, started, episodes, sources, outcomes)


def _open(channel: Channel | str) -> Channel:
    return open_channel(channel) if isinstance(channel, str | Path) else channel
