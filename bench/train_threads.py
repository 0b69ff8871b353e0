"""Fine-tuning speed on one intra-op thread against torch's default, idle and beside busy cells.

    .venv/bin/python -m bench.train_threads [--examples 14000] [--epochs 5] [--json]

`train.threads` (params.yaml) sets fit's torch threads; `make demo` uses 1. This bench times the
same fit on synthetic data (the policy's input and output sizes, a cycle's typical example
count) with one thread and with torch's default (one per core), first on an idle machine, then
with one busy process per core standing in for the reference cells that record beside the
loop. Each figure is a ratio against the one-thread run in the same condition and the same
script, so a noisy machine shifts both. The weights of the two runs are compared too: the
thread count must not change them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from contextlib import contextmanager

import numpy as np
import torch

from pipelines.training.policy import OBS_SIZE, PolicyConfig, PolicyNet
from pipelines.training.train import fit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train_threads", description=__doc__)
    parser.add_argument("--examples", type=int, default=14_000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    data = _examples(args.examples)
    default_threads = os.cpu_count() or 1
    report = {"examples": args.examples, "epochs": args.epochs, "cores": default_threads}
    _timed_fit(data, 1, threads=1)  # warm-up: torch's first fit in a process costs extra
    for condition, busy in (("idle", 0), ("beside busy cells", default_threads)):
        with _busy_processes(busy):
            one, weights_one = _timed_fit(data, args.epochs, threads=1)
            many, weights_many = _timed_fit(data, args.epochs, threads=default_threads)
        report[condition] = {
            "busy_processes": busy,
            "one_thread_s_per_epoch": round(one, 3),
            "default_threads_s_per_epoch": round(many, 3),
            "default_over_one": round(many / one, 2),
            "same_weights": bool(torch.equal(weights_one, weights_many)),
        }
    _print(report, args.json)
    return 0


def _examples(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, OBS_SIZE)).astype(np.float32),
        rng.uniform(-1, 1, size=(n, 2)).astype(np.float32),
    )


def _timed_fit(data, epochs: int, threads: int) -> tuple[float, torch.Tensor]:
    """Seconds per epoch, and the trained weights, with torch on `threads` threads."""
    torch.manual_seed(0)
    net = PolicyNet(PolicyConfig())
    started = time.perf_counter()
    fit(net, *data, threads=threads, epochs=epochs, batch_size=256, learning_rate=1e-3, seed=1)
    elapsed = time.perf_counter() - started
    return elapsed / epochs, torch.cat([p.detach().flatten() for p in net.parameters()])


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@contextmanager
def _busy_processes(n: int):
    """n processes each keeping a core busy, as a recording cell does at 20x speed."""
    stop = multiprocessing.Event()
    workers = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(n)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(0.5 if n else 0.0)
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"fit on {report['examples']} examples, {report['epochs']} epochs, {report['cores']} cores"
    )
    for condition in ("idle", "beside busy cells"):
        r = report[condition]
        print(
            f"  {condition:<18} one thread {r['one_thread_s_per_epoch']:.3f} s/epoch, "
            f"default {r['default_threads_s_per_epoch']:.3f} s/epoch "
            f"(x{r['default_over_one']:.2f}), same weights: {r['same_weights']}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
