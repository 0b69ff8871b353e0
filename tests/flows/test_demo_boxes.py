"""`make demo` keeps its cells running until their boxes take the releases it promoted."""

from __future__ import annotations

import time

from flows.demo import promoted_versions, wait_for_boxes


def _row(cell: str, outcome: str, version) -> dict:
    return {"cell": cell, "outcome": outcome, "promoted_version": version}


def test_each_cells_awaited_version_is_the_one_its_promotion_published():
    cycles = [
        {
            "cycle": 0,
            "cells": [_row("cell-07", "not promoted", None), _row("cell-08", "promoted", 4)],
        },
        {"cycle": 1, "cells": [_row("cell-07", "promoted", 5)]},
    ]
    assert promoted_versions(cycles) == {"cell-07": "5", "cell-08": "4"}
    assert promoted_versions([{"cycle": 0, "cells": [_row("cell-07", "failed", None)]}]) == {}


def test_a_box_that_never_takes_its_release_is_waited_for_a_bounded_time_and_named(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # no box at .realloop/demo/boxes/cell-07: status says so
    started = time.monotonic()
    wait_for_boxes({"cell-07": "5"}, timeout_s=1.5)
    assert 1.5 <= time.monotonic() - started < 10
    assert "cell-07's box has not taken version 5 in 2 s" in capsys.readouterr().err


def test_nothing_promoted_is_nothing_to_wait_for():
    started = time.monotonic()
    wait_for_boxes({}, timeout_s=60)
    assert time.monotonic() - started < 1
