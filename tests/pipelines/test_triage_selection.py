"""Novel parts for data selection: which episodes carry another part (snapshot, extent, turn),
and the weights their training examples get."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.quality.triage.selection import episode_weights, novel_part_ids
from tests.pipelines.test_triage import _snapshot, _tables


def test_episode_weights_weigh_novel_part_examples():
    ids = np.array(["a", "b", "a", "c", "d"])
    weights = episode_weights(ids, {"a", "d", "z"}, 3.0)
    assert weights.dtype == np.float32
    assert weights.tolist() == [3.0, 1.0, 3.0, 1.0, 3.0]
    assert episode_weights(["a", "b"], set(), 3.0).tolist() == [1.0, 1.0]
    assert episode_weights([], {"a"}, 3.0).shape == (0,)


def _episode(episode_id: str, extent: float, turn: float = 0.0, capture: bool = False):
    """A part pushed 20 steps along x, turning steadily by `turn` radians."""
    n = 20
    part = np.column_stack([np.linspace(0.0, 0.1, n), np.zeros(n)])
    episodes, steps = _tables(
        episode_id, part, part - 0.05, np.zeros((n, 2)), np.zeros((n, 2)),
        yaw=np.linspace(0.0, turn, n), extent=extent, success=True,
    )  # fmt: skip
    if capture:  # the cell kept a capture of it: the sidecar lists its snapshot
        reasons = pa.array([["near_failure"]], episodes.schema.field("edge_case_reasons").type)
        index = episodes.schema.get_field_index("edge_case_reasons")
        episodes = episodes.set_column(index, episodes.schema.field(index), reasons)
    return episodes, steps


def test_novel_parts_from_snapshot_extent_and_turn(params, tmp_path):
    captures = tmp_path / "captures"
    captures.mkdir()
    made = [
        _episode("standard", 0.060),
        _episode("large", 0.090),  # the camera's extent tells
        _episode("turning-box", 0.059, turn=1.5),  # reads standard, but swung round
        _episode("box-in-snapshot", 0.060, capture=True),  # reads standard, the image tells
        _episode("standard-in-snapshot", 0.052, capture=True),  # the image overrules the extent
    ]
    # The test's drawing is not antialiased: its radius reads about a pixel (1.2 mm) small.
    drawn = {"box-in-snapshot": 0.0292, "standard-in-snapshot": 0.0312}
    for episode_id, radius in drawn.items():
        (captures / f"{episode_id}.png").write_bytes(_snapshot((0.05, 0.0), radius))
        sidecar = {"step": 5, "attachments": [f"{episode_id}.png"]}
        (captures / f"{episode_id}_near_failure.json").write_text(json.dumps(sidecar))
    episodes = pa.concat_tables([e for e, _ in made])
    steps = pa.concat_tables([s for _, s in made])

    found = novel_part_ids(episodes, steps, captures, params.triage)
    assert found == {"large", "turning-box", "box-in-snapshot"}
    # Without the captures the logs alone decide: the box in the image reads standard, and the
    # standard part the camera measured small reads as a box.
    without = novel_part_ids(episodes, steps, None, params.triage)
    assert without == {"large", "turning-box", "standard-in-snapshot"}
    empty = episodes.filter(pc.equal(episodes.column("episode_id"), "none"))
    assert novel_part_ids(empty, steps, captures, params.triage) == set()
