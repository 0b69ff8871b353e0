"""The canary's health window (pipelines/release/rollout.py) on small episode tables."""

from __future__ import annotations

import dataclasses
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


def test_a_window_a_little_below_its_floor_watches_more_before_it_decides():
    # Seed 17's cell-09 day-10 model: 17 of 20 against a floor of 0.882. One look at 20
    # episodes rolled it back; it placed 95.3 held out.
    first = rollout.judge_counts(20, 17, 0, wanted=20, floor=0.882, most=60)
    assert first.state == "open" and "not significantly" in first.reason
    assert rollout.judge_counts(20, 17, 0, wanted=20, floor=0.882).state == "failed"  # one look
    assert rollout.judge_counts(30, 27, 0, wanted=20, floor=0.882, most=60).state == "open"
    second = rollout.judge_counts(40, 36, 0, wanted=20, floor=0.882, most=60)
    assert second.state == "passed" and second.most == 60


def test_a_window_well_below_its_floor_fails_at_the_first_look_and_any_below_it_at_the_last():
    early = rollout.judge_counts(20, 14, 0, wanted=20, floor=0.882, most=60)
    assert early.state == "failed" and "significantly (p 0.0" in early.reason
    last = rollout.judge_counts(60, 52, 0, wanted=20, floor=0.882, most=60)  # 0.867
    assert last.state == "failed" and "< trial lower bound 0.882" in last.reason
    # A floor the last look can no longer reach fails as soon as that is so.
    hopeless = rollout.judge_counts(25, 15, 0, wanted=20, floor=0.882, most=60)
    assert hopeless.state == "failed" and "53 of 60 successes needed" in hopeless.reason


def test_the_orchestrator_decides_a_table_at_its_first_deciding_look_as_the_box_does():
    # 17/20 (open), then 20 straight successes: passed at 40, whatever came after.
    rows = [{"success": i >= 3} for i in range(20)] + [{"success": True}] * 20
    rows += [{"success": False, "safety_stops": 1}] * 5
    window = rollout.judge_window(episodes(rows), wanted=20, floor=0.882, most=60)
    assert (window.state, window.episodes, window.successes) == ("passed", 40, 37)
    partial = rollout.judge_window(episodes(rows[:30]), wanted=20, floor=0.882, most=60)
    assert (partial.state, partial.episodes) == ("open", 30)


def test_the_longest_window_is_at_least_the_first_look(params):
    with pytest.raises(ValueError, match="health_max_episodes 10 is below"):
        dataclasses.replace(params.edge, health_episodes=20, health_max_episodes=10)


def test_the_health_bench_sums_the_rules_exact_probabilities():
    from bench.health import operating_point

    # One look of 4 at floor 0.75 fails below 3 of 4: P(Bin(4, 0.5) < 3) = 11/16.
    one = operating_point(0.5, 0.75, wanted=4, most=4)
    assert one["rollback"] == pytest.approx(11 / 16, abs=1e-4)
    # A perfect model is never rolled back, and passes at the first look.
    assert operating_point(0.999999, 0.75, 20, 60) == {"rollback": 0.0, "mean_episodes": 20.0}
    # Watching longer rolls back fewer models a little above their floor.
    good_one = operating_point(0.91, 0.882, 20, 20)["rollback"]
    assert operating_point(0.91, 0.882, 20, 60)["rollback"] < good_one / 2
