import numpy as np
import pyarrow as pa
import pytest

from pipelines.release.gate import TrialStats, decide, trial_stats


def stats(policy, successes, n=100, stops=0, p95=4.0):
    return TrialStats(policy, n, successes, stops, p95)


def test_wilson_interval_matches_the_textbook_value():
    low, high = stats("c", 78).interval
    assert low == pytest.approx(0.6893, abs=1e-4) and high == pytest.approx(0.8500, abs=1e-4)


def test_clearly_better_candidate_passes_with_reasons():
    decision = decide(stats("candidate", 85), stats("incumbent", 50), cycle_time_budget_s=5.0)
    assert decision.passed
    assert len(decision.reasons) == 3 and all(r.startswith("pass: ") for r in decision.reasons)


def test_a_lucky_small_sample_does_not_pass():
    # 9/10 beats 0.8 on the point estimate but not on the lower bound.
    decision = decide(stats("candidate", 9, n=10), stats("incumbent", 80), 5.0)
    assert not decision.passed
    assert decision.reasons[0].startswith("FAIL: success lower bound")


@pytest.mark.parametrize(
    ("candidate", "failing"),
    [(stats("c", 95, stops=1), "safety stops"), (stats("c", 95, p95=5.5), "p95 cycle time")],
)
def test_any_safety_stop_or_slow_cycle_fails_the_gate(candidate, failing):
    decision = decide(candidate, stats("incumbent", 50), cycle_time_budget_s=5.0)
    assert not decision.passed
    failures = [r for r in decision.reasons if r.startswith("FAIL")]
    assert len(failures) == 1 and failing in failures[0]


def test_from_episodes_computes_p95_and_refuses_empty_trials():
    trial = TrialStats.from_episodes("c", [True, False, True, True], 0, [1.0, 2.0, 3.0, 10.0])
    assert trial.successes == 3 and trial.p95_cycle_time_s == pytest.approx(8.95)
    with pytest.raises(ValueError, match="no trial episodes"):
        TrialStats.from_episodes("c", [], 0, [])


def _trial_episodes(success: list[bool], stops: list[int], cycle: list[float]) -> pa.Table:
    return pa.table(
        {
            "policy_version": ["ft-1"] * len(success),
            "success": success,
            "safety_stops": pa.array(stops, pa.int32()),
            "cycle_time_s": pa.array(cycle, pa.float32()),
        }
    )


def test_trial_stats_read_the_ingested_episodes():
    episodes = _trial_episodes([True, True, False, True], [0, 0, 1, 0], [3.0, 4.0, 2.5, 5.0])
    stats = trial_stats(episodes)
    assert (stats.policy, stats.n, stats.successes, stats.safety_stops) == ("ft-1", 4, 3, 1)
    # the p95 is over successful episodes only: the failed 2.5 s stop does not lower it
    assert stats.p95_cycle_time_s == pytest.approx(np.percentile([3.0, 4.0, 5.0], 95))


def test_trial_stats_refuse_mixed_policies():
    episodes = _trial_episodes([True, True], [0, 0], [3.0, 4.0])
    mixed = episodes.set_column(0, "policy_version", pa.array(["a", "b"]))
    with pytest.raises(ValueError, match="one policy"):
        trial_stats(mixed)


def test_a_candidate_without_successes_has_no_cycle_time_and_fails():
    stats = trial_stats(_trial_episodes([False, False], [0, 0], [6.0, 6.0]))
    assert stats.p95_cycle_time_s is None
    decision = decide(stats, stats, cycle_time_budget_s=5.5)
    assert not decision.passed and "no successful trial episode" in decision.reasons[2]
