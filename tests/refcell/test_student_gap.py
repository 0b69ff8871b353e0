"""bench.student_gap: the student pretrained in the calibrated sim and in the true line must
differ only in the world, never in the randomization or the day's events."""

from __future__ import annotations

from argparse import Namespace

import pytest
import yaml

from bench.student_gap import line_training_set, pretrain_settings, pretrain_worlds
from pipelines.contract.params import load_params
from pipelines.training.calibrated import loop_pretrain_params
from refcell.timeline import load_timeline, world_on_day
from refcell.world import load_world


def test_both_arms_share_the_calibrations_ranges_and_the_true_arm_is_the_line_that_day(
    tmp_path,
):
    calibration = tmp_path / "sim-calibration.yaml"
    calibration.write_text(
        yaml.safe_dump(
            {
                "world": {"physics": {"friction": 0.5}, "perception": {"bias_y_m": 0.01}},
                "randomization": {"friction": [0.45, 0.55]},
            }
        )
    )
    args = Namespace(calibration=calibration, cell="cell-09", day=4.0)
    worlds = pretrain_worlds(args, loop_pretrain_params(load_params("params.yaml")))

    (calibrated, ranges), (line, line_ranges) = worlds["calibrated"], worlds["true_line"]
    assert line_ranges is ranges
    assert tuple(ranges.randomization.friction) == (0.45, 0.55)
    assert ranges.randomization.latency_steps is None  # the calibration's own delays
    assert calibrated.physics.friction == 0.5
    cell_09 = load_world("cell-09")
    assert line == world_on_day(cell_09, load_timeline("cell-09"), 4.0)
    # cell-09's camera was knocked 15 mm along +y on day 3: the day-4 line has it.
    assert line.perception.bias_y_m == pytest.approx(cell_09.perception.bias_y_m + 0.015)


def test_settings_changed_with_set_are_checked_against_pretrains_keys():
    params = load_params("params.yaml")
    settings = pretrain_settings(params, ["hidden=[256, 256]", "epochs=80"], seed=8)
    assert (settings.hidden, settings.epochs, settings.seed) == ((256, 256), 80, 8)
    assert settings.dagger_rounds == params.loop.pretrain_dagger_rounds  # the loop's, kept
    with pytest.raises(ValueError, match="pretrain has no setting 'hiden'"):
        pretrain_settings(params, ["hiden=[64]"], seed=8)
    with pytest.raises(ValueError, match="is not JSON"):
        pretrain_settings(params, ["epochs=eighty"], seed=8)


def test_fine_tuning_on_a_workspace_where_the_cycle_never_ran_is_one_line_saying_so(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError) as error:
        line_training_set(load_params("params.yaml"), tmp_path, "cell-09", 2)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path}: no MLflow run 'finetune-calibrated cell-09 cycle 2'")
    assert list(tmp_path.iterdir()) == []  # nothing written where there was no workspace
