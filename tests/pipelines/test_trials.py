"""pipelines.release.trials: trial requests on a folder channel, completion and attempt
selection from hand-made episodes tables, and the gate on exactly the selected episodes."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from edge.channels import open_channel
from edge.trials import Signing, fetch_arm, open_requests, read_history
from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA
from pipelines.ingest import storage_schema
from pipelines.release import trials
from pipelines.training import tracking
from pipelines.training.policy import PolicyConfig, PolicyNet, save_policy
from pipelines.training.registry import register_policy
from pipelines.training.tracking import start_finetune_run
from tests.edge.signed import EXPIRY_S, publish_override

REQUEST = "cell-07-20261203T101500Z-3f9a0c1d"
T0 = datetime(2026, 12, 3, 10, 20, tzinfo=UTC)


def request(n: int = 2, request_id: str = REQUEST, cell: str = "cell-07") -> dict:
    arm = {"bundle_id": "1-aaaaaaaaaaaa", "manifest_sha256": "0" * 64}
    return {
        "request_id": request_id,
        "cell_id": cell,
        "episodes_per_arm": n,
        "arms": {"candidate": arm, "incumbent": arm},
        "created_at": "2026-12-03T10:15:00Z",
        "deadline": "2026-12-03T12:15:00Z",
    }


def episode(i: int, arm: str, attempt: str | None, minute: int, **row) -> dict:
    """One trial episode row; `minute` after T0 is its start, which orders attempts."""
    return {
        "episode_id": f"cell-07-x-{i:05d}",
        "cell_id": "cell-07",
        "robot_serial": "GX",
        "policy_version": "cand" if arm == "candidate" else "inc",
        "sensor_calibration_id": "cam",
        "software_version": "1",
        "source_uri": f"{arm}-{attempt}.mcap",
        "source_sha256": f"{arm}-{attempt}",
        "source_chunk": None,
        "ingest_run_id": "run",
        "ingested_at": T0,
        "realloop_version": "0",
        "start_time": T0 + timedelta(minutes=minute),
        "target": [0.0, 0.0],
        "part_extent_m": None,
        "success": True,
        "failure_cause": None,
        "safety_stops": 0,
        "safety_stop_kind": None,
        "interventions": 0,
        "steps": 80,
        "cycle_time_s": 4.0,
        "edge_case": False,
        "edge_case_reasons": None,
        "attachments": None,
        "trial_request_id": REQUEST,
        "trial_arm": arm,
        "trial_attempt": attempt,
    } | row


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=EPISODES_SCHEMA)


def interleaved(attempt: str, pairs: int, first_minute: int, start_id: int) -> list[dict]:
    """`pairs` candidate/incumbent pairs, alternating as the contract says."""
    rows = []
    for k in range(pairs):
        for j, arm in enumerate(("candidate", "incumbent")):
            i = start_id + 2 * k + j
            rows.append(episode(i, arm, attempt, first_minute + 2 * k + j))
    return rows


# --- completion and attempt selection ------------------------------------------------------


def test_nothing_landed_is_not_complete_and_shows_no_progress():
    assert trials.complete_attempt(table([]), request()) is None
    assert trials.progress(table([]), request()) == {"candidate": 0, "incumbent": 0}


def test_a_partial_attempt_is_never_complete():
    rows = interleaved("a1", 2, 0, 0)[:-1]  # the last incumbent episode is missing
    assert trials.complete_attempt(table(rows), request(n=2)) is None
    assert trials.progress(table(rows), request(n=2)) == {"candidate": 2, "incumbent": 1}


def test_one_complete_attempt_is_selected_with_its_episodes_and_logs():
    rows = interleaved("a1", 2, 0, 0)
    chosen = trials.complete_attempt(table(rows), request(n=2))
    assert chosen.attempt == "a1" and chosen.counts() == {"candidate": 2, "incumbent": 2}
    assert chosen.episodes == {
        "candidate": ["cell-07-x-00000", "cell-07-x-00002"],
        "incumbent": ["cell-07-x-00001", "cell-07-x-00003"],
    }
    assert chosen.sources == {"candidate": ["candidate-a1"], "incumbent": ["incumbent-a1"]}
    assert json.loads(json.dumps(chosen.as_dict()))["counts"] == chosen.counts()


def test_partial_episodes_of_two_attempts_never_add_up_to_a_complete_one():
    rows = interleaved("a1", 1, 0, 0) + interleaved("a2", 1, 30, 10)
    assert trials.complete_attempt(table(rows), request(n=2)) is None


def test_a_cut_attempt_then_a_complete_one_judges_the_complete_one_only():
    rows = interleaved("a1", 1, 0, 0) + interleaved("a2", 2, 30, 10)
    chosen = trials.complete_attempt(table(rows), request(n=2))
    assert chosen.attempt == "a2"
    assert all(
        e.endswith(("10", "11", "12", "13")) for ids in chosen.episodes.values() for e in ids
    )


def test_of_two_complete_attempts_the_earliest_is_judged_whatever_its_name():
    rows = interleaved("zz-first", 2, 0, 0) + interleaved("aa-later", 2, 30, 10)
    listed = trials.attempts(table(rows), request(n=2))
    assert [a.attempt for a in listed] == ["zz-first", "aa-later"]
    assert trials.complete_attempt(table(rows), request(n=2)).attempt == "zz-first"


def test_an_attempt_with_more_episodes_than_asked_is_judged_on_the_first_n_per_arm():
    rows = interleaved("a1", 3, 0, 0)
    # the third pair went to a log of its own: a log holding only dropped episodes is no evidence
    for row in rows[4:]:
        row["source_sha256"] = f"{row['trial_arm']}-extra"
    chosen = trials.complete_attempt(table(rows), request(n=2))
    assert chosen.counts() == {"candidate": 2, "incumbent": 2}
    assert chosen.episodes["candidate"] == ["cell-07-x-00000", "cell-07-x-00002"]
    assert chosen.sources == {"candidate": ["candidate-a1"], "incumbent": ["incumbent-a1"]}


def test_episodes_of_other_requests_cells_or_arms_do_not_count():
    rows = interleaved("a1", 2, 0, 0)
    rows[0]["cell_id"] = "cell-08"  # another cell claiming this request
    rows[1]["trial_request_id"] = "cell-07-20261203T111500Z-00000000"
    rows[2]["trial_arm"] = "baseline"
    assert trials.complete_attempt(table(rows), request(n=2)) is None
    assert trials.progress(table(rows), request(n=2)) == {"candidate": 0, "incumbent": 1}


def test_a_log_without_an_attempt_id_is_an_attempt_of_its_own():
    rows = interleaved(None, 1, 0, 0) + interleaved("a1", 1, 5, 10)
    assert [a.attempt for a in trials.attempts(table(rows), request(n=1))] == [
        trials.NO_ATTEMPT,
        "a1",
    ]


def test_an_episode_carried_by_two_logs_counts_once():
    rows = interleaved("a1", 2, 0, 0)
    copy = dict(rows[0], source_sha256="candidate-a1-again", start_time=T0 + timedelta(hours=1))
    chosen = trials.attempts(table([*rows, copy]), request(n=2))[0]
    assert chosen.counts() == {"candidate": 2, "incumbent": 2}
    assert chosen.episodes["candidate"] == ["cell-07-x-00000", "cell-07-x-00002"]
    assert chosen.sources["candidate"] == ["candidate-a1"]


def test_poll_state_waits_until_complete_or_the_deadline():
    req, attempt = request(), trials.Attempt("a1", None, {}, {})
    before, at = (
        datetime(2026, 12, 3, 12, 14, tzinfo=UTC),
        datetime(2026, 12, 3, 12, 15, tzinfo=UTC),
    )
    assert trials.poll_state(req, None, before) == "waiting"
    assert trials.poll_state(req, None, at) == "timed out"
    assert trials.poll_state(req, attempt, at) == "complete"


# --- the interim look: the sequential gate decides while the episodes come in -------------

DESIGN = {"alpha": 0.05, "margin": 0.02, "looks": 5, "futility_power": 0.05}


def sequential_request(n: int = 100) -> dict:
    return request(n) | {"gate": dict(DESIGN)}


def outcomes_rows(candidate: list[bool], incumbent: list[bool], stops=()) -> list[dict]:
    """Interleaved pairs of attempt a1 with these outcomes; `stops`: candidate pairs (0-based)
    with a safety stop."""
    rows = interleaved("a1", len(candidate), 0, 0)
    for k, row in enumerate(rows):
        pair, arm = divmod(k, 2)
        row["success"] = (candidate if arm == 0 else incumbent)[pair]
        row["safety_stops"] = int(arm == 0 and pair in stops)
    return rows


def test_the_interim_look_waits_between_looks_then_stops_a_clear_winner_at_the_first():
    req = sequential_request()
    winner, loser = [True] * 30, [k % 5 == 0 for k in range(30)]
    early = outcomes_rows(winner[:19], loser[:19])
    assert trials.complete_attempt(table(early), req) is None  # no look before 20 pairs
    assert trials.interim_look(req, trials.attempts(table(early), req)[0]) == ("continue", 19)
    rows = outcomes_rows(winner, loser)  # 30 pairs in: the look at 20 decided
    chosen = trials.complete_attempt(table(rows), req)
    assert chosen.counts() == {"candidate": 20, "incumbent": 20}
    assert trials.interim_look(req, chosen) == ("efficacy", 20)
    assert trials.poll_state(req, chosen, T0) == "complete"


def test_the_interim_look_stops_a_clearly_worse_candidate_for_futility():
    req = sequential_request()
    rows = outcomes_rows([k % 2 == 0 for k in range(20)], [True] * 20)
    assert trials.interim_look(req, trials.complete_attempt(table(rows), req)) == ("futility", 20)


def test_a_candidate_safety_stop_decides_the_request_at_its_pair():
    req = sequential_request()
    rows = outcomes_rows([True] * 5, [True] * 5, stops=(2,))
    chosen = trials.complete_attempt(table(rows), req)
    assert chosen.counts() == {"candidate": 3, "incumbent": 3}
    assert trials.interim_look(req, chosen) == ("safety", 3)


def test_a_request_carries_its_sequential_design_and_cap(params):
    arm = {"bundle_id": "1-aaaaaaaaaaaa", "manifest_sha256": "0" * 64}
    doc = trials.new_trial_request("cell-07", arm, arm, params.trials, T0, gate=params.gate)
    assert doc["episodes_per_arm"] == params.trials.max_episodes
    assert doc["gate"] == {k: getattr(params.gate, k) for k in DESIGN}
    design = trials.request_design(doc)
    assert (design.max_pairs, design.looks, design.margin) == (
        params.trials.max_episodes,
        params.gate.looks,
        params.gate.margin,
    )


# --- the episodes table on disk, and the gate on it ---------------------------------------


def write_batch(dataset, sha: str, rows: list[dict], columns=None) -> None:
    """As ingest stores a batch (its steps are not needed here: an empty steps file)."""
    episodes = table(rows).cast(storage_schema(EPISODES_SCHEMA))
    if columns is not None:  # a batch written before some columns existed
        episodes = episodes.select(columns)
    for name, data in (
        ("episodes", episodes),
        ("steps", storage_schema(STEPS_SCHEMA).empty_table()),
    ):
        (dataset / name).mkdir(parents=True, exist_ok=True)
        pq.write_table(data, dataset / name / f"{sha}.parquet")


@pytest.fixture
def dataset(tmp_path):
    """Two attempts on disk (a1 cut short, a2 complete), a production batch written before
    the trial columns existed, and another request's trial batch."""
    root = tmp_path / "dataset"
    rows = interleaved("a1", 1, 0, 0) + interleaved("a2", 2, 30, 10)
    for row in rows[2:]:  # a2's incumbent episodes: one success, one failure
        if row["trial_arm"] == "incumbent":
            row.update(success=row["episode_id"].endswith("11"), cycle_time_s=6.0)
    for sha in {r["source_sha256"] for r in rows}:
        write_batch(root, sha, [r for r in rows if r["source_sha256"] == sha])
    old_columns = [n for n in EPISODES_SCHEMA.names if not n.startswith("trial_")]
    production = episode(90, "candidate", None, 1, trial_request_id=None, trial_arm=None)
    write_batch(root, "production", [production], columns=old_columns)
    other = episode(91, "candidate", "b1", 2, trial_request_id="cell-07-2026-other")
    write_batch(root, "other", [other])
    return root


def test_the_scan_reads_only_the_requests_episodes_old_files_included(dataset):
    found = trials.trial_episodes(dataset, [REQUEST])
    assert found.num_rows == 6 and set(found.column("trial_request_id").to_pylist()) == {REQUEST}
    assert trials.trial_episodes(dataset, []).num_rows == 0
    checked = trials.check_requests(dataset, {"cell-07": request(n=2)})["cell-07"]
    assert checked["attempt"].attempt == "a2"
    assert checked["progress"] == {"candidate": 2, "incumbent": 2}


def test_the_gate_judges_exactly_the_selected_episodes_per_arm(dataset, params):
    req = request(n=2)
    chosen = trials.check_requests(dataset, {"cell-07": req})["cell-07"]["attempt"]
    record = trials.judge_attempt(dataset, req, chosen, params.gate)
    assert (record["candidate"]["n"], record["candidate"]["successes"]) == (2, 2)
    assert (record["incumbent"]["n"], record["incumbent"]["successes"]) == (2, 1)
    assert (record["candidate"]["policy"], record["incumbent"]["policy"]) == ("cand", "inc")
    assert record["trial_request_id"] == REQUEST and record["trial_attempt"] == "a2"
    assert record["trial_episodes"] == chosen.episodes
    assert record["trial_sources"] == {"candidate": ["candidate-a2"], "incumbent": ["incumbent-a2"]}
    assert len(record["reasons"]) == 3  # the gate's own rules, unchanged


def test_the_gate_judges_a_decided_attempt_on_the_episodes_the_test_used(tmp_path, params):
    req = sequential_request() | {"request_id": REQUEST}
    rows = outcomes_rows([True] * 30, [k % 5 == 0 for k in range(30)])
    root = tmp_path / "dataset"
    write_batch(root, "candidate-a1", [r for r in rows if r["trial_arm"] == "candidate"])
    write_batch(root, "incumbent-a1", [r for r in rows if r["trial_arm"] == "incumbent"])
    chosen = trials.check_requests(root, {"cell-07": req})["cell-07"]["attempt"]
    record = trials.judge_attempt(root, req, chosen, params.gate)
    assert (record["stopped"], record["episodes_used"], record["max_episodes"]) == (
        "efficacy",
        20,
        100,
    )
    assert record["passed"] and record["candidate"]["n"] == record["episodes_per_arm"] == 20
    assert record["incumbent"]["successes"] == 4
    assert [len(ids) for ids in record["trial_episodes"].values()] == [20, 20]


# --- publishing and withdrawing on a folder channel ---------------------------------------


@pytest.fixture(scope="module")
def registered(tmp_path_factory, params):
    """A registered candidate, and an incumbent policy the cell runs."""
    workspace = tmp_path_factory.mktemp("workspace")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.setattr(tracking, "_workspace_in_use", None)
        torch.manual_seed(0)
        folder = save_policy(PolicyNet(PolicyConfig(hidden=[8], version="c")), workspace / "cand")
        with start_finetune_run(
            workspace, params.train.experiment, params.train, "abc.dir", "data", {}
        ) as run:
            version = register_policy(run.info.run_id, folder, params.train.registered_model)
        incumbent = save_policy(PolicyNet(PolicyConfig(hidden=[8], version="i")), workspace / "inc")
    trained = {
        "registered_model": params.train.registered_model,
        "model_version": version,
        "mlflow_run_id": run.info.run_id,
        "dataset_version": "abc.dir",
    }
    return SimpleNamespace(workspace=workspace, folder=folder, incumbent=incumbent, trained=trained)


@pytest.fixture(params=["folder", "s3"])
def env(request, registered, monkeypatch, tmp_path):
    """The registered candidate, and a channel (a folder, or an S3 prefix on the loopback
    server) on which cell-07 runs the incumbent."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    if request.param == "folder":
        channel = str(tmp_path / "channel")
    else:
        channel = f"s3://{request.getfixturevalue('s3_bucket')}/releases"
    files = {n: registered.incumbent / n for n in ("model.safetensors", "config.json")}
    meta = {"model_name": "m", "model_version": 1}
    publish_override(channel, "cell-07", files, meta, tmp_path / "keys")
    return SimpleNamespace(**vars(registered), channel=channel)


def test_a_request_names_the_uploaded_candidate_and_the_running_incumbent(env, params, tmp_path):
    channel = open_channel(env.channel)
    timestamp = channel.get_bytes("tuf/metadata/timestamp.json")
    incumbent = trials.incumbent_arm(env.channel, "cell-07")
    candidate = trials.upload_candidate(
        env.channel, "cell-07", env.folder, env.trained, workspace=env.workspace
    )
    assert channel.get_bytes("tuf/metadata/timestamp.json") == timestamp  # nothing released
    now = datetime(2026, 12, 3, 10, 15, 0, 500, tzinfo=UTC)
    trial_params = dataclasses.replace(params.trials, max_episodes=3, timeout_s=600)
    doc = trials.new_trial_request("cell-07", candidate, incumbent, trial_params, now)
    assert (doc["created_at"], doc["deadline"]) == ("2026-12-03T10:15:00Z", "2026-12-03T10:25:00Z")
    assert doc["request_id"].startswith("cell-07-20261203T101500Z-")

    signing = Signing(tmp_path / "keys", EXPIRY_S)  # the keys env's release was signed with
    trials.publish_trial_request(env.channel, doc, signing)
    trials.publish_trial_request(env.channel, doc, signing)  # a retry: still one request
    [listed] = open_requests(channel, "cell-07")
    assert listed["request_id"] == doc["request_id"] and listed["episodes_per_arm"] == 3
    arms = {
        arm: fetch_arm(channel, "cell-07", listed["arms"][arm], tmp_path)
        for arm in ("candidate", "incumbent")
    }
    assert (arms["candidate"] / "model.safetensors").read_bytes() == (
        env.folder / "model.safetensors"
    ).read_bytes()
    manifest = json.loads((arms["candidate"] / "manifest.json").read_text())
    assert manifest["model_version"] == int(env.trained["model_version"])

    assert trials.withdraw_trial_request(env.channel, doc, "trials incomplete", signing)
    assert not trials.withdraw_trial_request(env.channel, doc, "again", signing)
    assert open_requests(channel, "cell-07") == []
    actions = [
        e["action"] for e in read_history(channel, "cell-07") if e["subject"] == doc["request_id"]
    ]
    assert actions == ["trial_requested", "trial_requested", "trial_withdrawn"]


def test_a_cell_with_nothing_published_is_told_to_deploy_first(env):
    with pytest.raises(ValueError, match="realloop deploy --initial"):
        trials.incumbent_arm(env.channel, "cell-09")


def test_weights_other_than_the_registered_version_are_not_offered_for_trials(env, tmp_path):
    other = save_policy(PolicyNet(PolicyConfig(hidden=[8])), tmp_path / "other")
    with pytest.raises(ValueError, match="refusing to publish"):
        trials.upload_candidate(env.channel, "cell-07", other, env.trained, workspace=env.workspace)
