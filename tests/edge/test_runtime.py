"""The box's runtime: load a bundle folder, act with ONNX, screen observations, swap between
episodes without dropping a step, and never import torch."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edge.runtime import (
    LOW_CONFIDENCE,
    NOVEL_PART,
    OOD,
    OOD_FILE,
    EdgeRuntime,
    PolicySession,
    RuntimeLoadError,
    has_runtime_files,
)
from tests.pipelines.test_onnx_export import observations, tiny_net

ROOT = Path(__file__).resolve().parents[2]


def edge_bundle(folder: Path, seed: int = 0) -> Path:
    from pipelines.training.onnx_export import save_policy_for_edge

    path, _ = save_policy_for_edge(tiny_net(seed), folder, observations(2000), 0.01)
    return path


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bundles")
    return edge_bundle(root / "a", seed=0), edge_bundle(root / "b", seed=1)


def test_screen_passes_familiar_steps_and_hands_over_dark_or_unfamiliar_ones(bundles):
    session = PolicySession(bundles[0], min_confidence=0.3)
    familiar = observations(500, seed=11)
    handed = [session.screen(obs) for obs in familiar]
    assert sum(f is not None for f in handed) <= 25  # about the 1% false-alarm rate
    dark = familiar[0].copy()
    dark[7] = 0.1
    assert session.screen(dark).reason == LOW_CONFIDENCE
    unfamiliar = familiar[0].copy()
    unfamiliar[2:4] = [0.8, -0.8]  # the gantry racing with no command behind it
    fallback = session.screen(unfamiliar)
    assert fallback.reason == OOD and fallback.score > fallback.threshold
    score, is_ood = session.ood(unfamiliar)
    assert is_ood and score == pytest.approx(fallback.score)


def test_a_part_far_from_every_part_the_policy_trained_on_is_handed_over_from_any_step(
    tmp_path,
):
    from pipelines.training.onnx_export import save_policy_for_edge

    net = tiny_net()
    net.config.trained_on = {"part_footprints_m": [0.06, 0.09]}  # two cylinders, r 30 and 45 mm
    folder, _ = save_policy_for_edge(net, tmp_path / "p", observations(2000), 0.01, 0.005)
    record = json.loads((folder / OOD_FILE).read_text())
    assert record["part_footprints_m"] == [0.06, 0.09] and record["footprint_tolerance_m"] == 0.005
    session = PolicySession(folder, min_confidence=0.0)
    step = observations(1, seed=11)[0]
    wide_box = session.screen(step, np.array([0.0725, 0.0718]))  # a 36 mm box: between them
    assert wide_box.reason == NOVEL_PART
    assert wide_box.score == pytest.approx(0.07215 - 0.06) and wide_box.threshold == 0.005
    assert session.screen(step, np.array([0.0915, 0.0893])) is None  # the large cylinder
    assert session.screen(step) is None  # no measurement: the step screen alone
    # A bundle exported before footprints were recorded has no part screen.
    assert (
        PolicySession(edge_bundle(tmp_path / "old"), 0.0).screen(step, np.array([0.5, 0.5])) is None
    )


def test_a_folder_without_the_runtime_files_or_with_a_bad_ood_file_is_refused(bundles, tmp_path):
    from pipelines.training.policy import PolicyConfig, PolicyNet, save_policy

    old = save_policy(PolicyNet(PolicyConfig(hidden=[8])), tmp_path / "old")
    assert not has_runtime_files(old) and has_runtime_files(bundles[0])
    with pytest.raises(RuntimeLoadError, match=r"old/policy\.onnx: missing"):
        PolicySession(old, 0.3)
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in bundles[0].iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    record = json.loads((broken / OOD_FILE).read_text())
    (broken / OOD_FILE).write_text(json.dumps({**record, "mean": [0.0, 1.0]}))
    with pytest.raises(RuntimeLoadError, match=r"ood\.json: mean/whitening/threshold do not fit"):
        PolicySession(broken, 0.3)
    for bad in (
        {"part_footprints_m": [0.06], "footprint_tolerance_m": float("nan")},
        {"part_footprints_m": [-0.06], "footprint_tolerance_m": 0.005},
        {"part_footprints_m": ["wide"], "footprint_tolerance_m": 0.005},
    ):
        (broken / OOD_FILE).write_text(json.dumps({**record, **bad}))
        with pytest.raises(RuntimeLoadError, match=r"ood\.json: .*re-export"):
            PolicySession(broken, 0.3)


def test_a_swap_takes_effect_between_episodes_and_no_step_is_dropped(bundles):
    runtime = EdgeRuntime(PolicySession(bundles[0], 0.3))
    obs = observations(50, seed=3)
    episodes: list[tuple[set[str], int]] = []
    stop = threading.Event()

    def control_loop() -> None:
        while not stop.is_set() or len(episodes) < 3:
            session = runtime.begin_episode()
            names, steps = set(), 0
            for step in obs:
                action = runtime.act(step)
                assert action.shape == (2,) and np.all(np.isfinite(action))
                names.add(runtime.name)
                steps += 1
            episodes.append((names | {session.name}, steps))

    worker = threading.Thread(target=control_loop)
    worker.start()
    while len(episodes) < 3:
        time.sleep(0.001)
    runtime.prepare(bundles[1])  # loads while the loop keeps acting on the old session
    with pytest.raises(RuntimeLoadError):
        runtime.prepare(bundles[1] / "missing")  # a failed load leaves both as they were
    before = len(episodes)
    while len(episodes) < before + 3:
        time.sleep(0.001)
    stop.set()
    worker.join(timeout=30)
    assert all(steps == len(obs) for _, steps in episodes)  # every step got an action
    assert all(len(names) == 1 for names, _ in episodes)  # never two models in one episode
    assert {"tiny-0"} in [n for n, _ in episodes] and episodes[-1][0] == {"tiny-1"}


def test_the_runtime_runs_a_bundle_without_importing_torch(bundles):
    script = (
        "import sys, numpy as np\n"
        "from edge.runtime import PolicySession\n"
        f"s = PolicySession({str(bundles[0])!r}, 0.3)\n"
        "obs = np.zeros(12, np.float32); obs[7] = 0.93\n"
        "print(s.act(obs).shape, s.screen(obs) is None or s.screen(obs).reason)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("(2,)")
