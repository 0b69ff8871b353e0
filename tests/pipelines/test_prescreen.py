"""The pre-screen (pipelines/release/prescreen.py), the calibration cache
(pipelines/calibrate/cache.py) and the `loop:` params: unit checks, a few seconds in all."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from pipelines.calibrate.cache import (
    calibration_hash,
    choose_calibration,
    current_calibration,
    moved_estimates,
)
from pipelines.contract.params import ParamsError, load_params
from pipelines.release.prescreen import (
    action_mse,
    prescreen_correlation,
    rank,
    score,
    split_by_shift,
    window,
)

# --- the split: by shift, never by step ---------------------------------------------------


def test_the_split_never_shares_a_shift_between_training_and_held_out():
    shifts = {
        "b1": {"20261201T060000Z"},
        "b2": {"20261201T060000Z", "20261201T140000Z"},  # a log across two shifts
        "b3": {"20261201T140000Z"},
        "b4": {"20261202T060000Z"},
        "b5": {"20261202T060000Z"},
    }
    split = split_by_shift(shifts, 1)
    assert split.heldout_shifts == ["20261202T060000Z"]
    assert split.heldout == ["b4", "b5"] and split.train == ["b1", "b2", "b3"]
    trained_on = set().union(*(shifts[b] for b in split.train))
    assert not trained_on & set(split.heldout_shifts)
    assert split.train_shifts == sorted(trained_on)

    split = split_by_shift(shifts, 2)  # b2 holds a held-out shift's episodes: held out whole
    assert split.heldout_shifts == ["20261201T140000Z", "20261202T060000Z"]
    assert split.train == ["b1"]
    assert not shifts["b1"] & set(split.heldout_shifts)


def test_trial_episodes_do_not_make_a_shift(tmp_path):
    """A log of trial episodes (the arms' own actions, run on request) is never the newest
    shift that the pre-screen holds out: it is trained on, as before candidates."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.release.prescreen import batch_shifts

    (tmp_path / "episodes").mkdir()
    logs = {
        "old": (["cell-07-20261201T060000Z-00000"], [None]),
        "new": (["cell-07-20261202T060000Z-00000", "cell-07-20261202T060000Z-00001"], [None] * 2),
        "trials": (["cell-07-20261203T060000Z-00000"], ["request-1"]),
    }
    for sha, (ids, requests) in logs.items():
        table = pa.table({"episode_id": ids, "trial_request_id": pa.array(requests, pa.string())})
        pq.write_table(table, tmp_path / "episodes" / f"{sha}.parquet")
    shifts = batch_shifts(tmp_path, list(logs))
    assert shifts == {"old": {"20261201T060000Z"}, "new": {"20261202T060000Z"}, "trials": set()}
    split = split_by_shift(shifts, 1)
    assert split.heldout == ["new"] and split.train == ["old", "trials"]


def test_a_single_shift_is_all_trained_on_and_says_why():
    split = split_by_shift({"b1": {"20261201T060000Z"}, "b2": {"20261201T060000Z"}}, 1)
    assert split.train == ["b1", "b2"] and split.heldout == [] and "1 shift" in split.reason
    assert split_by_shift({"b1": {"s1"}, "b2": {"s2"}}, 0).heldout == []


def test_the_window_trains_on_the_newest_shifts_and_the_trials_run_since():
    production = {
        "d1": {"20261201T060000Z"},
        "d2": {"20261202T060000Z"},
        "trials-d1": set(),  # trial logs: no production shift of their own
        "d3": {"20261203T060000Z"},
        "trials-d3": set(),
        "d4": {"20261204T060000Z"},
    }
    recorded = production | {"trials-d1": {"20261201T060000Z"}, "trials-d3": {"20261203T060000Z"}}
    split = window(split_by_shift(production, 1), recorded, 2)
    assert split.heldout == ["d4"] and split.older_shifts == 1
    assert split.train_shifts == ["20261202T060000Z", "20261203T060000Z"]
    assert split.train == ["d2", "d3", "trials-d3"]  # trials-d1 ran before the window opened

    every = split_by_shift(production, 1)
    assert window(every, recorded, None) == every == window(every, recorded, 3)


# --- the score ranks a bad candidate last --------------------------------------------------


def _examples(n: int = 400):
    from pipelines.training.finetune import TrainingSet

    rng = np.random.default_rng(3)
    observations = rng.uniform(-0.3, 0.3, (n, 12)).astype(np.float32)
    observations[:, 7] = 0.95  # perception confidence
    return observations, lambda actions, weights: TrainingSet(
        observations=observations,
        actions=actions.astype(np.float32),
        weights=weights,
        episodes_used=n,
        success_steps=n,
        correction_steps=0,
        is_correction=weights > 1,
    )


def _saved(tmp_path, name: str, seed: int):
    import torch

    from pipelines.training import PolicyConfig, PolicyNet, save_policy

    torch.manual_seed(seed)
    net = PolicyNet(PolicyConfig(hidden=[16], version=name))
    return save_policy(net, tmp_path / name), net


def test_scores_rank_a_deliberately_bad_candidate_last(tmp_path):
    import torch

    observations, examples = _examples()
    good_folder, good = _saved(tmp_path, "good", 1)
    bad_folder, _ = _saved(tmp_path, "bad", 2)
    with torch.no_grad():
        labels = good(torch.from_numpy(observations)).numpy()
    weights = np.where(np.arange(len(labels)) % 4 == 0, 10.0, 1.0).astype(np.float32)
    held_out = examples(labels, weights)
    near_folder, near = _saved(tmp_path, "near", 1)
    with torch.no_grad():  # the good policy, a little off: between the two
        for parameter in near.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    from pipelines.training import save_policy

    save_policy(near, near_folder)

    errors = {f.name: action_mse(f, held_out) for f in (good_folder, near_folder, bad_folder)}
    assert errors["good"] == pytest.approx(0.0, abs=1e-10)
    assert errors["good"] < errors["near"] < errors["bad"]
    sims = {"good": 0.9, "near": 0.85, "bad": 0.2}
    # The bad one first in the list and in the loop's order: ranked last all the same.
    candidates = [
        {"name": name, **score(errors[name], sims[name], 0.5)} for name in ("bad", "near", "good")
    ]
    ranked = rank(candidates)
    assert [c["name"] for c in ranked] == ["good", "near", "bad"]
    assert [c["rank"] for c in ranked] == [1, 2, 3]
    assert [c["selected"] for c in ranked] == [True, False, False]
    assert ranked[0]["score"] == pytest.approx(0.5 * 0.9 + 0.5 * 1.0)


def test_a_missing_term_drops_out_and_unscored_candidates_keep_their_order():
    assert score(None, 0.7, 0.5)["score"] == 0.7  # one shift: nothing held out
    assert score(0.04, None, 0.5)["score"] == pytest.approx(0.8)  # no calibration yet
    assert score(0.04, 0.5, 0.0)["score"] == pytest.approx(0.8)  # sim weighted 0
    assert score(None, None, 0.5)["score"] is None
    ranked = rank([{"name": "a", "score": None}, {"name": "b", "score": None}])
    assert [c["name"] for c in ranked] == ["a", "b"] and ranked[0]["selected"]
    ranked = rank([{"name": "a", "score": None}, {"name": "b", "score": 0.1}])
    assert [c["name"] for c in ranked] == ["b", "a"]
    tie = rank([{"name": "a", "score": 0.5}, {"name": "b", "score": 0.5}])
    assert tie[0]["name"] == "a"  # a tie goes to the earlier in loop.candidates


# --- the pre-screen's predictive value ----------------------------------------------------


def _cycle(number: int, cells: list[tuple[float | None, float | None]]) -> dict:
    rows = []
    for k, (prescreen, trial) in enumerate(cells):
        rows.append(
            {
                "cell": f"cell-{k:02d}",
                "prescreen": {"trialled": {"name": "calibrated", "score": prescreen}},
                "trials": None
                if trial is None
                else {"candidate": {"success_rate": trial, "n": 60}},
            }
        )
    return {"cycle": number, "cells": rows}


def test_the_rank_correlation_over_the_ledger_needs_three_trialled_candidates():
    found = prescreen_correlation([_cycle(0, [(0.8, 0.9), (0.5, None)])])
    assert found["n"] == 1 and found["rho"] is None and "need 3" in found["reason"]
    cycles = [_cycle(0, [(0.8, 0.9), (0.6, 0.7)]), _cycle(1, [(0.7, 0.8), (None, 0.5)])]
    found = prescreen_correlation(cycles)
    assert found["n"] == 3 and found["rho"] == pytest.approx(1.0)
    assert {(p["cycle"], p["cell"]) for p in found["pairs"]} == {
        (0, "cell-00"),
        (0, "cell-01"),
        (1, "cell-00"),
    }
    reversed_ = prescreen_correlation([_cycle(0, [(0.8, 0.6), (0.6, 0.7), (0.7, 0.65)])])
    assert reversed_["rho"] == pytest.approx(-1.0)


# --- the calibration cache -----------------------------------------------------------------


def _calibration(bias: float, delay: dict | None = None) -> dict:
    return {
        "world": {
            "physics": {"friction": 0.44, "joint_damping": 4.95},
            "perception": {"bias_x_m": bias},
            "latency": {"steps": delay or {1: 0.3, 2: 0.5, 3: 0.2}, "load_extra_steps": 1},
        },
        "uncertainty": {
            "physics": {"friction": None, "joint_damping": 0.05},
            "perception": {"bias_x_m": 0.0003},
            "latency": {"mean_delay_steps": 0.005},
        },
        "randomization": {"joint_damping": [4.4, 5.5]},
    }


def test_a_calibration_within_its_errors_reuses_the_cached_policy_and_a_moved_one_does_not(
    tmp_path,
):
    written = []

    def write(path):
        written.append(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(calibrations[-1]))

    calibrations = [_calibration(0.0158)]
    first = choose_calibration(tmp_path, calibrations[-1], 3.0, write)
    assert first.new and first.changed == ["first calibration"] and not first.pretrained
    assert first.hash == calibration_hash(calibrations[-1]) and written == [first.path]
    (first.policy / "config.json").parent.mkdir(parents=True)
    (first.policy / "config.json").write_text("{}")  # pretrained: what a hit finds

    calibrations.append(_calibration(0.0160))  # 0.7 standard errors away: the same line
    again = choose_calibration(tmp_path, calibrations[-1], 3.0, write)
    assert not again.new and again.hash == first.hash and again.pretrained  # cache hit
    assert len(written) == 1

    calibrations.append(_calibration(0.0300))  # the camera was knocked: re-pretrain
    moved = choose_calibration(tmp_path, calibrations[-1], 3.0, write)
    assert moved.new and moved.changed == ["perception.bias_x_m"] and not moved.pretrained
    assert moved.hash != first.hash and current_calibration(tmp_path).hash == moved.hash


def test_unidentified_estimates_never_count_and_the_floor_absorbs_small_moves():
    old = _calibration(0.0158)
    new = _calibration(0.0158)
    new["world"]["physics"]["friction"] = 0.9  # not identified by the logs (std None)
    assert moved_estimates(new, old, 3.0) == []
    new = _calibration(0.0158, delay={2: 0.5, 3: 0.3, 4: 0.2})  # one more step of latency
    assert moved_estimates(new, old, 3.0) == ["latency.mean_delay_steps"]
    slightly = _calibration(0.0170)  # 4 standard errors, but within 10% of the estimate
    assert moved_estimates(slightly, old, 3.0) == ["perception.bias_x_m"]
    assert moved_estimates(slightly, old, 3.0, floor=0.1) == []


def _with_parts(calibration: dict, *parts: tuple[str, float, float]) -> dict:
    """`calibration` with a part mix: (name, size_m, probability) each, shares known to 0.02."""
    calibration["world"]["parts"] = [
        {"name": n, "shape": "cylinder", "size_m": s, "mass_scale": 1.0, "probability": p}
        for n, s, p in parts
    ]
    calibration["uncertainty"]["parts"] = {n: {"probability": 0.02} for n, _, _ in parts}
    return calibration


def test_a_new_part_variant_or_a_moved_share_moves_the_calibration_and_gauge_noise_does_not():
    old = _with_parts(_calibration(0.0158), ("part-30mm", 0.0301, 0.8), ("part-45mm", 0.045, 0.2))
    same = _with_parts(
        _calibration(0.0158), ("part-30mm", 0.0299, 0.78), ("part-44mm", 0.0445, 0.22)
    )
    assert moved_estimates(same, old, 3.0) == []  # sizes within the gauge, shares within 1 sd
    arrived = _with_parts(
        _calibration(0.0158),
        ("part-30mm", 0.030, 0.64),
        ("part-36mm", 0.036, 0.2),
        ("part-45mm", 0.045, 0.16),
    )
    assert moved_estimates(arrived, old, 3.0) == [
        "parts.part-30mm.probability",
        "parts.part-36mm (new)",
    ]
    assert moved_estimates(old, arrived, 3.0) == [
        "parts.part-36mm (gone)",
        "parts.part-30mm.probability",
    ]
    assert moved_estimates(old, _calibration(0.0158), 3.0) == [
        "parts.part-30mm (new)",
        "parts.part-45mm (new)",
    ]  # a calibration from before the mix was estimated


def test_a_box_the_size_of_a_cylinder_is_a_new_variant_not_the_same_part():
    old = _with_parts(_calibration(0.0158), ("part-30mm", 0.030, 0.8), ("part-45mm", 0.045, 0.2))
    found = _with_parts(
        _calibration(0.0158),
        ("part-30mm", 0.030, 0.6),
        ("box-30mm", 0.030, 0.2),
        ("part-45mm", 0.045, 0.2),
    )
    found["world"]["parts"][1]["shape"] = "box"
    assert moved_estimates(found, old, 3.0) == [
        "parts.part-30mm.probability",
        "parts.box-30mm (new)",
    ]


def test_a_cached_calibrated_policy_is_not_pretrained_again(tmp_path, params):
    from pipelines.training import PolicyConfig, PolicyNet
    from pipelines.training.calibrated import ensure_calibrated_policy

    calls = []

    def pretrain(calibration, cell, settings, version):
        calls.append((calibration, settings.dagger_rounds, version))
        student = {
            "history": settings.history,
            "output_gain": settings.output_gain,
            "ensemble": settings.ensemble,
        }
        net = PolicyNet(PolicyConfig(hidden=[8], version=version, **student))
        if settings.reinforce:  # as refcell.pretrain.reinforce_in_sim records it
            net.config.trained_on["reinforce"] = {"iterations": settings.reinforce.iterations}
        inputs = np.random.default_rng(0).normal(size=(64, 12 * settings.history))
        return net, inputs.astype(np.float32)

    def write(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(_calibration(0.0158)))

    chosen = choose_calibration(tmp_path, _calibration(0.0158), 3.0, write)
    made = ensure_calibrated_policy(params, chosen, pretrain)
    assert not made["cached"] and (chosen.policy / "policy.onnx").is_file()
    assert calls == [
        (chosen.path, params.loop.pretrain_dagger_rounds, f"sim-cal-{chosen.hash[:8]}")
    ]
    again = ensure_calibrated_policy(params, chosen, pretrain)
    assert again == {"policy_folder": str(chosen.policy), "cached": True, "seconds": 0.0}
    assert len(calls) == 1
    # Another student (loop.pretrain_history changed since): the cached one is not it.
    one_frame = dataclasses.replace(
        params, loop=dataclasses.replace(params.loop, pretrain_history=1)
    )
    assert not ensure_calibrated_policy(one_frame, chosen, pretrain)["cached"]
    assert len(calls) == 2 and "history" not in json.loads(
        (chosen.policy / "config.json").read_text()
    )
    # ...and loop.pretrain_ensemble: three students averaged are another policy again
    three = dataclasses.replace(
        one_frame, loop=dataclasses.replace(one_frame.loop, pretrain_ensemble=3)
    )
    assert not ensure_calibrated_policy(three, chosen, pretrain)["cached"]
    assert json.loads((chosen.policy / "config.json").read_text())["ensemble"] == 3
    assert ensure_calibrated_policy(three, chosen, pretrain)["cached"] and len(calls) == 3
    # ...and loop.pretrain_reinforce: a student paid for success is another policy too
    imitation_only = dataclasses.replace(
        three, loop=dataclasses.replace(three.loop, pretrain_reinforce=None)
    )
    assert not ensure_calibrated_policy(imitation_only, chosen, pretrain)["cached"]
    assert ensure_calibrated_policy(imitation_only, chosen, pretrain)["cached"] and len(calls) == 4
    assert not ensure_calibrated_policy(three, chosen, pretrain)["cached"]


# --- params ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"candidates": ["incumbent_finetune", "incumbent_finetune"]}, "each may appear once"),
        ({"candidates": ["incumbent", "calibrated"]}, "loop.candidates.0"),
        ({"candidates": []}, "loop.candidates"),
        ({"sim_weight": 1.5}, "loop.sim_weight"),
        ({"heldout_shifts": -1}, "loop.heldout_shifts"),
    ],
)
def test_loop_params_are_validated_with_the_key_named(tmp_path, params_path, change, message):
    settings = yaml.safe_load(params_path.read_text())
    settings["loop"] |= change
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(settings))
    with pytest.raises(ParamsError, match=message) as error:
        load_params(bad)
    assert str(bad) in str(error.value) and "\n" not in str(error.value)


def test_the_loop_builds_all_three_candidates_by_default(params):
    assert params.loop.candidates == ("incumbent_finetune", "calibrated", "calibrated_finetune")
    assert params.simulator.pretrain.startswith("refcell.pretrain:")
    cheaper = dataclasses.replace(params.pretrain, dagger_rounds=params.loop.pretrain_dagger_rounds)
    assert cheaper.dagger_rounds <= params.pretrain.dagger_rounds


@pytest.mark.parametrize(("target", "rounds"), [(0.0, 1), (1.01, 3)])
def test_the_loops_pretrain_adds_dagger_rounds_only_while_the_student_is_below_target(
    params, target, rounds
):
    """dagger_rounds always; more, up to dagger_max_rounds, while the last round's success in
    the student's own sim is below the target (0.0: reached at once; 1.01: never)."""
    from refcell.pretrain import pretrain_with_observations
    from refcell.world import load_world

    tiny = dataclasses.replace(
        params.pretrain,
        demo_episodes=6,
        dagger_rounds=1,
        dagger_max_rounds=3,
        dagger_target_success=target,
        dagger_episodes=3,
        epochs=2,
    )
    net, _ = pretrain_with_observations(load_world("sim"), params.cell, tiny)
    done = sorted(k for k in net.config.trained_on if k.startswith("dagger_"))
    assert done == [f"dagger_{i}_success" for i in range(1, rounds + 1)]


def test_the_loop_pretrains_with_its_own_dagger_floor_ceiling_and_target(params):
    from pipelines.training.calibrated import loop_pretrain_params

    loop, pretrain = params.loop, loop_pretrain_params(params)
    assert pretrain.dagger_rounds == loop.pretrain_dagger_rounds
    assert pretrain.dagger_max_rounds == loop.pretrain_dagger_max_rounds > pretrain.dagger_rounds
    assert pretrain.dagger_target_success == loop.pretrain_dagger_target_success
    assert pretrain.reinforce == loop.pretrain_reinforce and pretrain.reinforce.iterations > 0
    assert params.pretrain.reinforce is None  # `realloop cell pretrain`: imitation only
    assert params.pretrain.dagger_max_rounds == 0  # `realloop cell pretrain`: exactly its rounds
