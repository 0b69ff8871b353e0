"""Hardware trials as requests to a cell, and when they count as done.

The orchestrator never runs a trial (docs/operations.md, "The cell contract", section 3):
- it uploads the candidate's bundle to the cell's channel path without moving CURRENT.json,
  and publishes a request naming the candidate, the incumbent (the bundle CURRENT.json names),
  the episodes per arm and a deadline;
- a request is complete when the episodes table holds one attempt with `episodes_per_arm`
  episodes of each arm. The earliest complete attempt is judged, on the first
  `episodes_per_arm` episodes of each arm by start time; a partial attempt never is;
- a request not complete by its deadline is withdrawn: nothing is promoted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from edge.bundle import CONFIG_FILE, MODEL_FILE, parse_pointer, pointer_key
from edge.channels import Channel, KeyNotFoundError, open_channel, upload_bundle
from edge.integrity import sha256_bytes
from edge.trials import ARMS, close_request, new_request_id, publish_request, withdraw_request
from pipelines.contract.params import GateParams, TrialsParams
from pipelines.contract.schema import EPISODES_SCHEMA, TRIAL_COLUMNS
from pipelines.ingest import read_dataset
from pipelines.release.gate import decide, trial_stats
from pipelines.release.promote import check_is_registered_version

# What completion needs of each episode: one narrow scan of the episodes files per poll.
_SCAN_COLUMNS = ("episode_id", "cell_id", "source_sha256", "start_time", *TRIAL_COLUMNS)
NO_ATTEMPT = "-"  # a trial episode whose log names no attempt: grouped on its own


@dataclass(frozen=True)
class Attempt:
    """One run of a request by the cell: its episodes per arm and the logs holding them."""

    attempt: str
    started: datetime | None  # the earliest episode start of the attempt
    episodes: dict[str, list[str]]  # arm → episode ids, by start time
    episode_sources: dict[str, str]  # episode id → sha256 of its log (its batch)

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
        return Attempt(self.attempt, self.started, episodes, sources)

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
    """The bundle the cell's CURRENT.json names: what the cell runs now."""
    channel = _open(channel)
    key = pointer_key(cell_id)
    try:
        data = channel.get_bytes(key)
    except KeyNotFoundError:
        raise ValueError(
            f"{channel.describe(key)}: nothing published for {cell_id}; "
            "run realloop deploy --initial"
        ) from None
    pointer = parse_pointer(data, channel.describe(key))
    return {"bundle_id": pointer.bundle_id, "manifest_sha256": pointer.manifest_sha256}


def upload_candidate(
    channel: Channel | str,
    cell_id: str,
    policy_folder: Path,
    trained: dict[str, Any],
    signing_key: Path | None = None,
    *,
    workspace: Path | None = None,
) -> dict[str, str]:
    """Upload the candidate's bundle to the cell's channel path (CURRENT.json stays); return
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
    manifest, manifest_bytes = upload_bundle(_open(channel), cell_id, files, metadata, signing_key)
    return {"bundle_id": manifest["bundle_id"], "manifest_sha256": sha256_bytes(manifest_bytes)}


def new_trial_request(
    cell_id: str,
    candidate: dict[str, str],
    incumbent: dict[str, str],
    params: TrialsParams,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The request document, not yet published. Its id is fixed here, so publishing it again
    (a retry) rewrites the same request instead of opening a second one."""
    now = (now or datetime.now(UTC)).replace(microsecond=0)
    return {
        "request_id": new_request_id(cell_id, now),
        "cell_id": cell_id,
        "episodes_per_arm": params.episodes,
        "arms": {"candidate": dict(candidate), "incumbent": dict(incumbent)},
        "created_at": _iso(now),
        "deadline": _iso(now + timedelta(seconds=params.timeout_s)),
    }


def publish_trial_request(channel: Channel | str, request: dict[str, Any]) -> dict[str, Any]:
    """Put the request on the channel (both arms' manifests must be there already)."""
    return publish_request(_open(channel), request)


def withdraw_trial_request(channel: Channel | str, request: dict[str, Any], reason: str) -> bool:
    """Delete the request from the channel, so the cell stops working on it; True if it was
    still there."""
    return withdraw_request(_open(channel), request["cell_id"], request["request_id"], reason)


def close_trial_request(channel: Channel | str, request: dict[str, Any], reason: str) -> bool:
    """Delete a judged request from the channel (the cell already ran it)."""
    return close_request(_open(channel), request["cell_id"], request["request_id"], reason)


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


def complete_attempt(episodes: pa.Table, request: dict[str, Any]) -> Attempt | None:
    """The earliest attempt with `episodes_per_arm` episodes of each arm, cut to its first
    `episodes_per_arm` of each (the number fixed before anyone saw a result); None while no
    attempt is complete."""
    wanted = request["episodes_per_arm"]
    for attempt in attempts(episodes, request):
        if attempt.is_complete(wanted):
            return attempt.first(wanted)
    return None


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
    """The gate on exactly the attempt's episodes: candidate arm vs incumbent arm. The
    record names the request, the attempt, the bundles, and each arm's episodes and logs."""
    stats = {}
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
        stats[arm] = trial_stats(chosen, gate.confidence)
    decision = decide(stats["candidate"], stats["incumbent"], gate.cycle_time_budget_s)
    return decision.as_record() | {
        "trial_request_id": request["request_id"],
        "trial_attempt": attempt.attempt,
        "episodes_per_arm": request["episodes_per_arm"],
        "arms": request["arms"],
        "trial_sources": attempt.sources,
        "trial_episodes": attempt.episodes,
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
    started = min((r["start_time"] for r in rows), default=None)
    return Attempt(name, started, episodes, sources)


def _open(channel: Channel | str) -> Channel:
    return open_channel(channel) if isinstance(channel, str | Path) else channel
