"""The campaign's day ledger: when a day's shifts have all landed (trials take a share of a
shift), and the part-mix trigger (a new part variant raises the share of non-standard parts)."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc

from flows.campaign_days import DayLedger, answers_a_change, loop_triggers, part_mix_rise
from pipelines.contract.params import load_params
from tests.conftest import ROOT
from tests.pipelines.test_drift import synthetic

EPOCH_NS = int(datetime(2026, 12, 1, 5, 0, tzinfo=UTC).timestamp()) * 10**9
DAY_0, DAY_1 = "20261201T060000Z", "20261202T060000Z"  # shift starts: line days 0 and 1
STANDARD, LARGER = [0.06, 0.06], [0.075, 0.075]  # measured part extents (triage: nominal 0.060)


def shift(start: str, episodes: int, *, trials: int = 0, larger: int = 0, seed: int = 1):
    """One shift's (episodes, steps) of cell-07: its first `trials` episodes are a trial's,
    the next `larger` carry a larger part than the cell's standard one."""
    table, steps = synthetic(seed, episodes, steps=(20, 30), prefix=f"cell-07-{start}")
    rows = range(episodes)
    extents = [LARGER if trials <= i < trials + larger else STANDARD for i in rows]
    requests = [f"trial-{start}" if i < trials else None for i in rows]
    table = table.set_column(
        table.schema.get_field_index("part_extent_m"),
        "part_extent_m",
        pa.array(extents, table.schema.field("part_extent_m").type),
    )
    table = table.set_column(
        table.schema.get_field_index("trial_request_id"),
        "trial_request_id",
        pa.array(requests, pa.string()),
    )
    return table, steps


def ledger(*shifts) -> DayLedger:
    book = DayLedger(ROOT, load_params(ROOT / "params.yaml"), {"cell-07": EPOCH_NS})
    for episodes, steps in shifts:
        book._add(episodes, steps)
    return book


def test_a_shift_the_trials_shared_is_whole_by_all_its_episodes():
    shared = ledger(shift(DAY_0, 100, trials=80))
    assert shared.count("cell-07", 0) == 20  # the day's production figures: its own episodes
    assert shared.day_done("cell-07", 0, episodes_per_shift=100, shifts_per_day=1)
    partial = ledger(shift(DAY_0, 60))
    assert not partial.day_done("cell-07", 0, episodes_per_shift=100, shifts_per_day=1)
    assert not ledger().day_done("cell-07", 0, episodes_per_shift=100, shifts_per_day=1)


def test_a_later_days_shift_closes_a_day_the_cell_was_kept_busy_past():
    moved_on = ledger(shift(DAY_0, 60), shift(DAY_1, 10))
    assert moved_on.day_done("cell-07", 0, episodes_per_shift=100, shifts_per_day=1)
    assert not moved_on.day_done("cell-07", 1, episodes_per_shift=100, shifts_per_day=1)
    trial_only = ledger(shift(DAY_0, 100, trials=100))  # a trial's own shift: no production
    assert not trial_only.day_done("cell-07", 0, episodes_per_shift=100, shifts_per_day=1)


def test_a_new_part_variant_raises_the_part_mix_and_a_quiet_day_does_not():
    before = shift(DAY_0, 100, larger=20)
    new_part = ledger(before, shift(DAY_1, 100, larger=40, seed=2))
    rise = part_mix_rise(new_part, "cell-07", 1, None)
    assert rise["detected"] and (rise["before"], rise["now"]) == ("20/100", "40/100")
    assert rise["against_day"] == 0 and rise["p_value"] < 0.01
    quiet = ledger(before, shift(DAY_1, 100, larger=24, seed=2))
    assert not part_mix_rise(quiet, "cell-07", 1, None)["detected"]
    assert part_mix_rise(quiet, "cell-07", 0, None) is None  # no shift before day 0


def test_trial_episodes_stay_out_of_the_days_tables():
    book = ledger(shift(DAY_0, 100, trials=30))
    episodes, _ = book.tables("cell-07", 0)
    assert pc.all(pc.is_null(episodes["trial_request_id"])).as_py()
    assert episodes.num_rows == 70


def test_a_change_answered_by_no_promotion_is_retried_the_next_day_once():
    """Day-to-day drift sees a knocked camera on its first shift only: the loop that answered
    it and promoted nothing runs again the next day, and a retry is not retried."""
    camera = {"detected": True, "drifted_features": ["contact_offset_y_m"]}
    quiet = {"detected": False, "drifted_features": []}
    knocked = loop_triggers(camera, None, 3, last_cycle=0, retry=False, floor_days=3)
    assert knocked == ["drift: contact_offset_y_m"] and answers_a_change(knocked)
    retried = loop_triggers(quiet, None, 4, last_cycle=3, retry=True, floor_days=3)
    assert retried == ["retry: day 3's cycle answered a change and promoted nothing"]
    assert not answers_a_change(retried)  # so day 5 runs only on a change or the floor
    assert loop_triggers(quiet, None, 5, last_cycle=4, retry=False, floor_days=3) == []
    assert loop_triggers(quiet, None, 7, last_cycle=4, retry=False, floor_days=3) == [
        "floor: last cycle day 4"
    ]
    assert not answers_a_change(["floor: no cycle yet"])
