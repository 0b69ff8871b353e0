import numpy as np
import pytest
from safetensors.numpy import load_file

from pipelines.training.policy import Policy, load_policy, save_policy
from refcell.expert import Expert
from refcell.pretrain import pretrain
from refcell.runner import Operator, run_episodes, summarize
from refcell.world import load_world


@pytest.mark.parametrize("world", ["sim", "line"])
def test_expert_succeeds_on_at_least_90_percent(world, params):
    results = list(run_episodes(load_world(world), params.cell, Expert(), 60, seed=11))
    assert summarize(results)["success_rate"] >= 0.9


def test_pretraining_is_deterministic_for_a_seed(tmp_path, params, tiny_pretrain):
    sim = load_world("sim")
    first = save_policy(pretrain(sim, params.cell, tiny_pretrain), tmp_path / "a")
    second = save_policy(pretrain(sim, params.cell, tiny_pretrain), tmp_path / "b")
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert (first / "config.json").read_text() == (second / "config.json").read_text()


def test_policy_round_trips_through_safetensors_without_pickle(tmp_path, params, tiny_pretrain):
    net = pretrain(load_world("sim"), params.cell, tiny_pretrain)
    folder = save_policy(net, tmp_path / "policy")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    obs = np.zeros(12, np.float32)
    assert np.allclose(load_policy(folder).act(obs), Policy(net).act(obs))


def test_loading_a_folder_without_weights_names_the_missing_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_policy(tmp_path)


class Frozen:
    """A policy that never moves: the operator must take over."""

    name = "frozen"

    def act(self, obs):
        return np.zeros(2)


def test_operator_takes_over_a_failing_policy_and_rescues_it(params):
    line = load_world("line")
    alone = summarize(list(run_episodes(line, params.cell, Frozen(), 10, seed=4)))
    helped = summarize(
        list(
            run_episodes(
                line, params.cell, Frozen(), 10, seed=4, operator=Operator(params.record.operator)
            )
        )
    )
    assert alone["success_rate"] == 0 and alone["interventions"] == 0
    assert helped["interventions"] >= 10 and helped["success_rate"] >= 0.8


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("model.safetensors", b"garbage", "unreadable or mismatched weights"),
        ("config.json", b"{bad", "not a policy config"),
    ],
)
def test_corrupt_policy_files_are_named_in_one_line(
    tmp_path, params, tiny_pretrain, name, content, reason
):
    folder = save_policy(pretrain(load_world("sim"), params.cell, tiny_pretrain), tmp_path / "p")
    (folder / name).write_bytes(content)
    with pytest.raises(ValueError, match=reason) as err:
        load_policy(folder)
    assert name in str(err.value) and "\n" not in str(err.value)
