"""pipelines.release.gate and .sequential: the sequential two-arm gate on hand-made trials."""

import numpy as np
import pyarrow as pa
import pytest

from pipelines.contract.params import GateParams
from pipelines.release.gate import TrialStats, decide, sequential_stop, trial_stats
from pipelines.release.sequential import Design, efficacy_bounds, run_looks

GATE = GateParams(alpha=0.05, margin=0.02, looks=5, futility_power=0.05, cycle_time_budget_s=5.0)


def arm(successes: list[bool], policy: str, stops=None, cycle: float = 4.0) -> pa.Table:
    """One arm's trial episodes in the order they ran."""
    n = len(successes)
    return pa.table(
        {
            "policy_version": [policy] * n,
            "success": successes,
            "safety_stops": pa.array(stops or [0] * n, pa.int32()),
            "cycle_time_s": pa.array([cycle] * n, pa.float32()),
        }
    )


def draws(rate: float, n: int, seed: int) -> list[bool]:
    return (np.random.default_rng(seed).random(n) < rate).tolist()


def test_the_boundaries_are_the_published_obrien_fleming_spending_values():
    # Lan-DeMets O'Brien-Fleming spending, 5 equal looks, one-sided 0.025 (gsDesign's values)
    bounds = efficacy_bounds(0.025, (0.2, 0.4, 0.6, 0.8, 1.0))
    assert bounds == pytest.approx((4.877, 3.357, 2.680, 2.290, 2.031), abs=2e-3)


def test_equal_arms_at_a_high_rate_can_pass_now():
    # The old gate (candidate's Wilson lower bound >= incumbent's rate) failed 200/200 vs
    # 200/200 (lower bound 0.981 < 1.0); equal perfect arms pass at the cap now.
    perfect = [True] * 200
    decision = decide(arm(perfect, "c"), arm(perfect, "i"), GATE, max_episodes=200)
    assert decision.passed and decision.stopped == "efficacy" and decision.episodes_used == 200
    assert all(r.startswith("pass: ") for r in decision.reasons)
    assert not decision.superiority["shown"]  # no worse, not shown better


def test_a_clearly_better_candidate_stops_early_for_efficacy_with_fewer_episodes():
    candidate, incumbent = draws(0.95, 100, 1), draws(0.5, 100, 2)
    decision = decide(arm(candidate, "c"), arm(incumbent, "i"), GATE, max_episodes=100)
    assert decision.passed and decision.stopped == "efficacy"
    assert decision.episodes_used < 100 and decision.candidate["n"] == decision.episodes_used
    assert decision.superiority["shown"]
    record = decision.as_record()
    assert {"passed", "reasons", "candidate", "incumbent", "stopped", "episodes_used"} <= set(
        record
    )
    assert set(record["candidate"]) >= {"n", "successes", "success_rate", "interval"}


def test_a_clearly_worse_candidate_fails_at_an_early_futility_stop():
    candidate, incumbent = draws(0.5, 100, 3), draws(0.9, 100, 4)
    decision = decide(arm(candidate, "c"), arm(incumbent, "i"), GATE, max_episodes=100)
    assert not decision.passed and decision.stopped == "futility"
    assert decision.episodes_used == 20  # the first look
    assert decision.reasons[0].startswith("FAIL: not shown no worse (futility)")


def test_a_candidate_worse_by_the_margin_is_not_promoted_more_often_than_alpha():
    design = Design(0.05, 0.02, 5, 0.05, 200)
    rng = np.random.default_rng(7)
    steps = np.diff(design.look_sizes(), prepend=0)
    candidate = rng.binomial(steps, 0.88, (4000, 5)).cumsum(axis=1)
    incumbent = rng.binomial(steps, 0.90, (4000, 5)).cumsum(axis=1)
    promoted = (run_looks(design, candidate, incumbent).outcome == "efficacy").mean()
    assert promoted <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 4000)


def test_a_safety_stop_ends_the_trials_at_its_pair_and_fails_the_gate():
    stops = [0] * 100
    stops[6] = 1
    perfect = [True] * 100
    assert sequential_stop(Design(0.05, 0.02, 5, 0.05, 100), perfect, perfect, stops) == (
        "safety",
        7,
    )
    decision = decide(arm(perfect, "c", stops), arm(perfect, "i"), GATE, max_episodes=100)
    assert not decision.passed and decision.stopped == "safety"
    failures = [r for r in decision.reasons if r.startswith("FAIL")]
    assert any("1 safety stops" in r for r in failures)


def test_a_slow_candidate_fails_on_cycle_time_alone():
    candidate, incumbent = draws(0.95, 100, 1), draws(0.5, 100, 2)
    decision = decide(arm(candidate, "c", cycle=5.5), arm(incumbent, "i"), GATE, 100)
    failures = [r for r in decision.reasons if r.startswith("FAIL")]
    assert not decision.passed and len(failures) == 1 and "p95 cycle time" in failures[0]


def test_a_slow_tail_passes_when_it_places_more_parts_within_the_takt_than_the_incumbent():
    # The candidate places the hard parts too, some of them slowly; the incumbent gives up on
    # them: the line is faster with the candidate though its p95 is over the budget.
    candidate = arm([True] * 24, "c", cycle=4.0)
    candidate = candidate.set_column(
        3, "cycle_time_s", pa.array([5.6] * 4 + [4.0] * 20, pa.float32())
    )
    incumbent = arm([True] * 5 + [False] * 19, "i", cycle=6.0)
    decision = decide(candidate, incumbent, GATE, max_episodes=24)
    assert decision.passed, decision.reasons
    used = decision.episodes_used  # the slow four are among the first: in every look
    assert decision.placed_within_budget == {"candidate": used - 4, "incumbent": 0}
    assert (
        f"{used - 4}/{used} against the incumbent's 0/{used}, so the line is no slower"
        in (decision.reasons[2])
    )
    # Over the takt and placing fewer parts within it than the incumbent: fails.
    fast = arm([True] * 24, "i", cycle=4.0)
    decision = decide(candidate, fast, GATE, max_episodes=24)
    assert not decision.passed and decision.reasons[2].startswith("FAIL: p95 cycle time")


def test_the_decision_does_not_depend_on_when_anyone_looked():
    candidate, incumbent = draws(0.9, 100, 5), draws(0.9, 100, 6)
    design = Design(0.05, 0.02, 5, 0.05, 100)
    final = sequential_stop(design, candidate, incumbent, [0] * 100)
    for seen in range(final[1], 101, 7):  # later looks at more episodes: the same answer
        assert sequential_stop(design, candidate[:seen], incumbent[:seen], [0] * seen) == final
    assert sequential_stop(design, candidate[:19], incumbent[:30], [0] * 19) == ("continue", 19)


def test_an_undecided_test_is_not_judged():
    with pytest.raises(ValueError, match="has not decided on 10 episodes per arm"):
        decide(arm([True] * 10, "c"), arm([True] * 10, "i"), GATE, max_episodes=100)


def test_from_episodes_computes_p95_and_refuses_empty_trials():
    trial = TrialStats.from_episodes("c", [True, False, True, True], 0, [1.0, 2.0, 3.0, 10.0])
    assert trial.successes == 3 and trial.p95_cycle_time_s == pytest.approx(8.95)
    with pytest.raises(ValueError, match="no trial episodes"):
        TrialStats.from_episodes("c", [], 0, [])


def test_trial_stats_read_the_ingested_episodes():
    episodes = arm([True, True, False, True], "ft-1", [0, 0, 1, 0]).set_column(
        3, "cycle_time_s", pa.array([3.0, 4.0, 2.5, 5.0], pa.float32())
    )
    stats = trial_stats(episodes)
    assert (stats.policy, stats.n, stats.successes, stats.safety_stops) == ("ft-1", 4, 3, 1)
    # the p95 is over successful episodes only: the failed 2.5 s stop does not lower it
    assert stats.p95_cycle_time_s == pytest.approx(np.percentile([3.0, 4.0, 5.0], 95))


def test_trial_stats_refuse_mixed_policies():
    mixed = arm([True, True], "a").set_column(0, "policy_version", pa.array(["a", "b"]))
    with pytest.raises(ValueError, match="one policy"):
        trial_stats(mixed)


def test_a_candidate_without_successes_has_no_cycle_time_and_fails():
    stats = trial_stats(arm([False, False], "c"))
    assert stats.p95_cycle_time_s is None
    decision = decide(arm([False] * 20, "c"), arm([False] * 20, "i"), GATE, max_episodes=20)
    assert not decision.passed and "no successful trial episode" in decision.reasons[2]


@pytest.mark.slow
def test_the_bench_prints_its_figures_and_a_plot(tmp_path):
    import json
    import subprocess
    import sys

    plot = tmp_path / "gate.png"
    command = [sys.executable, "-m", "bench.gate", "--reps", "200", "--null-reps", "400"]
    run = subprocess.run(
        [*command, "--json", "--plot", str(plot)],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(run.stdout)
    for key in ("alpha", "false_promotion_rate", "power", "mean_trial_episodes"):
        assert key in report
    assert report["gates"] >= 10_000 and plot.stat().st_size > 10_000
    assert report["mean_trial_episodes"] < report["fixed_n_trial_episodes"]
    assert report["false_promotion_rate"]["max"] <= 0.1  # loose: only 400 gates a point
