"""The canary's health window (pipelines/release/rollout.py) on small episode tables."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.release import rollout

START = datetime(2026, 12, 3, 6, tzinfo=UTC)
CANARY, NEW, OLD = "cell-07", "bundle-new", "bundle-old"


def episodes(rows: list[dict]) -> pa.Table:
    """Rows with defaults: the canary, the new version, production, a success, no stop."""
    full = [
        {
            "episode_id": f"ep-{i:03d}",
            "cell_id": CANARY,
            "policy_version": NEW,
            "start_time": START + timedelta(minutes=i),
            "success": True,
            "safety_stops": 0,
            "trial_request_id": None,
        }
        | row
        for i, row in enumerate(rows)
    ]
    schema = pa.schema([rollout.EPISODES_SCHEMA.field(name) for name in rollout._SCAN_COLUMNS])
    return pa.Table.from_pylist(full, schema=schema)


def write_batch(dataset, name: str, table: pa.Table) -> None:
    (dataset / "episodes").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, dataset / "episodes" / f"{name}.parquet")


def test_only_the_canarys_production_episodes_of_the_new_version_count(tmp_path):
    dataset = tmp_path / "dataset"
    write_batch(
        dataset,
        "a",
        episodes(
            [
                {},  # counts
                {"cell_id": "cell-08"},  # another cell
                {"policy_version": OLD},  # the old model's episode
                {"trial_request_id": "req-1"},  # a trial episode, not production
                {"success": False},  # counts
            ]
        ),
    )
    # The same log landed twice: its episodes count once; a later batch counts too.
    write_batch(dataset, "b", episodes([{}]).slice(0, 1))
    write_batch(dataset, "c", episodes([{}] * 6).slice(5, 1))
    found = rollout.production_episodes(dataset, CANARY, NEW)
    assert found.column("episode_id").to_pylist() == ["ep-000", "ep-004", "ep-005"]
    window = rollout.check_health(dataset, CANARY, NEW, wanted=3, floor=0.6)
    assert (window.state, window.episodes, window.successes) == ("passed", 3, 2)
    assert "2/3 successes, 0 safety stops in 3 of 3 episodes" in window.reason


def test_no_episodes_at_all_leave_the_window_open(tmp_path):
    window = rollout.check_health(tmp_path / "none", CANARY, NEW, wanted=4, floor=0.5)
    assert (window.state, window.episodes, window.success_rate) == ("open", 0, None)


@pytest.mark.parametrize(
    ("outcomes", "stops", "state", "words"),
    [
        # 4 episodes, floor 0.7: a whole window needs 3 successes.
        ([True, True, True, False], 0, "passed", "success 0.750 >= trial lower bound 0.700"),
        ([True, False, True, False], 0, "failed", "success 0.500 < trial lower bound 0.700"),
        ([True, True], 0, "open", "3 of 4 successes needed"),
        ([False, False], 0, "failed", "no longer reachable"),  # 2 more cannot make 3
        ([True], 1, "failed", "1 safety stops (0 allowed)"),  # at once, window not whole
    ],
)
def test_the_window_passes_fails_or_stays_open(outcomes, stops, state, words):
    rows = [{"success": ok} for ok in outcomes]
    rows[-1]["safety_stops"] = stops
    window = rollout.judge_window(episodes(rows), wanted=4, floor=0.7)
    assert window.state == state
    assert words in window.reason


def test_only_the_first_episodes_of_the_window_are_judged():
    # Later failures do not undo a window that was whole and healthy.
    rows = [{"success": True}] * 3 + [{"success": False, "safety_stops": 2}]
    window = rollout.judge_window(episodes(rows), wanted=3, floor=1.0)
    assert (window.state, window.episodes, window.safety_stops) == ("passed", 3, 0)


def test_the_floor_is_the_candidates_trial_lower_bound():
    record = {"passed": True, "candidate": {"interval": [0.62, 0.91]}}
    assert rollout.trial_floor(record) == 0.62
    with pytest.raises(ValueError, match="no candidate trial interval"):
        rollout.trial_floor({"passed": True})
