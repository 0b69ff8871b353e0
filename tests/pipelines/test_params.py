import dataclasses

import pytest

from pipelines.contract.params import ParamsError, load_params


def test_params_load_into_frozen_typed_dataclasses(params):
    assert params.cell.control_hz == 20
    assert isinstance(params.pretrain.randomization.friction, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.cell.control_hz = 10


def test_unknown_key_is_an_error_naming_file_and_key(tmp_path, params_path):
    bad = tmp_path / "params.yaml"
    bad.write_text(
        params_path.read_text().replace("  control_hz: 20", "  control_hz: 20\n  contrl: 1")
    )
    with pytest.raises(ParamsError, match=r"params.yaml: cell.contrl"):
        load_params(bad)


def test_wrong_type_and_missing_file_are_one_line_errors(tmp_path, params_path):
    bad = tmp_path / "params.yaml"
    bad.write_text(params_path.read_text().replace("control_hz: 20", "control_hz: fast"))
    with pytest.raises(ParamsError, match=r"cell\.control_hz") as err:
        load_params(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ParamsError, match="file not found"):
        load_params(tmp_path / "missing.yaml")


def test_the_simulator_is_named_by_import_path_and_required(tmp_path, params_path, params):
    assert params.simulator.replay == "refcell.replay:SimReplay"
    assert params.simulator.world == "refcell.world:sim_world"
    import yaml

    settings = yaml.safe_load(params_path.read_text())
    del settings["simulator"]
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(settings))
    with pytest.raises(ParamsError, match=r"params.yaml: simulator: Field required"):
        load_params(bad)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("novel_share", "0"), ("novel_share", "1.5"), ("novel_tolerance_m", "-0.001")],
)
def test_the_part_size_drift_settings_are_range_checked(tmp_path, params_path, setting, value):
    import yaml

    settings = yaml.safe_load(params_path.read_text())
    settings["drift"][setting] = float(value)
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(settings))
    with pytest.raises(ParamsError, match=rf"params.yaml: drift\.{setting}: ") as err:
        load_params(bad)
    assert "\n" not in str(err.value)
