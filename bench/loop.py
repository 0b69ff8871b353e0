"""Wall time of one retraining cycle, by stage, and what Prefect orchestration costs.

    .venv/bin/python -m bench.loop [--params params.yaml] [--json]

Two identical cycles run in one process, each in a fresh workspace (a temporary folder with
the sim policy copied in, so neither pays for pretraining):
(a) direct: the loop's stage functions called as plain functions (each Prefect task and flow
    replaced by the function it wraps), timed stage by stage;
(b) through Prefect: `loop_flow` as `realloop loop` runs it, with the local ephemeral API.
Same params and seeds, so both do the same work, after a tiny untimed cycle has paid the
process's one-time start-up (imports, the GX context, first calls). The ratio (b)/(a) is the
orchestration overhead, given with and without the start of Prefect's local API (a server
via PREFECT_API_URL skips it).
The target is one cycle under 10 minutes at default params on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TARGET_CYCLE_S = 600.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    try:
        report = run(args.params.resolve())
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.loop: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0


def run(params_path: Path) -> dict:
    from pipelines.contract.params import load_params

    sim_policy = Path(load_params(params_path).pretrain.out).resolve()
    if not (sim_policy / "config.json").is_file():
        raise FileNotFoundError(f"{sim_policy}: no sim policy; run `realloop cell pretrain`")
    _pay_process_start_up(params_path, sim_policy)
    stages: dict[str, float] = {}
    with _workspace(params_path, sim_policy) as root:
        started = time.perf_counter()
        with _direct_calls(stages):
            from flows.loop import loop_flow

            direct_summary = loop_flow.fn(str(root / "params.yaml"), str(root))
        direct_s = time.perf_counter() - started
    with _workspace(params_path, sim_policy) as root:
        started = time.perf_counter()
        _start_prefect_api()
        api_start_s = time.perf_counter() - started
        flow_summary = loop_flow(str(root / "params.yaml"), str(root))
        flow_s = time.perf_counter() - started
    return {
        "direct_s": direct_s,
        "prefect_s": flow_s,
        "prefect_api_start_s": api_start_s,
        "overhead_ratio": flow_s / direct_s,
        "overhead_ratio_warm_api": (flow_s - api_start_s) / direct_s,
        "stages_s": stages,
        "target_cycle_s": TARGET_CYCLE_S,
        "same_result": _outcome(direct_summary) == _outcome(flow_summary),
        "episodes": {
            "collected": direct_summary["collected"]["episodes"],
            "trials_each": direct_summary["trials"]["candidate"]["n"],
        },
    }


def _pay_process_start_up(params_path: Path, sim_policy: Path) -> None:
    """One tiny direct cycle first: imports, the GX context and every code path's first-call
    costs are paid before either timed run, so the run that goes first is not charged."""
    import yaml

    from flows.loop import loop_flow

    tiny = yaml.safe_load(params_path.read_text())
    tiny["collect"]["episodes"] = tiny["trials"]["episodes"] = 2
    tiny["train"]["epochs"] = 1
    with _workspace(params_path, sim_policy) as root:
        (root / "params.yaml").write_text(yaml.safe_dump(tiny))
        with _direct_calls({}):
            loop_flow.fn(str(root / "params.yaml"), str(root))


def _start_prefect_api() -> None:
    """Start the local ephemeral API (or reach PREFECT_API_URL) as the flow's first call would."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.hello()


@contextmanager
def _workspace(params_path: Path, sim_policy: Path) -> Iterator[Path]:
    from flows.prefect_env import configure_prefect
    from pipelines.training import use_workspace

    with tempfile.TemporaryDirectory(prefix="realloop-bench-") as tmp:
        root = Path(tmp)
        shutil.copy(params_path, root / "params.yaml")
        from pipelines.contract.params import load_params

        shutil.copytree(sim_policy, root / load_params(params_path).pretrain.out)
        configure_prefect(root)
        use_workspace(root)
        yield root


@contextmanager
def _direct_calls(stages: dict[str, float]) -> Iterator[None]:
    """Swap each task and subflow in the loop modules for its plain function, timed."""
    from prefect import Flow, Task

    import flows.ingest
    import flows.loop

    saved = []
    for module in (flows.loop, flows.ingest):
        for name, value in vars(module).items():
            if isinstance(value, Task | Flow) and value is not flows.loop.loop_flow:
                saved.append((module, name, value))
                setattr(module, name, _timed(value.name, value.fn, stages))
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _timed(name: str, fn: Callable, stages: dict[str, float]) -> Callable:
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stages[name] = stages.get(name, 0.0) + time.perf_counter() - started

    return call


def _outcome(summary: dict) -> tuple:
    trials = summary["trials"]
    return (
        trials["candidate"]["successes"],
        trials["incumbent"]["successes"],
        summary["gate"]["passed"],
    )


def _format(report: dict) -> str:
    lines = [
        f"one cycle: {report['direct_s']:.1f} s direct, {report['prefect_s']:.1f} s through "
        f"Prefect (overhead ratio {report['overhead_ratio']:.3f}; "
        f"{report['overhead_ratio_warm_api']:.3f} without the "
        f"{report['prefect_api_start_s']:.1f} s API start); target "
        f"< {report['target_cycle_s']:.0f} s",
        "stages (direct, summed over calls: ingest runs twice and holds ingest-logs and "
        "version-dataset; hardware-trials runs for both policies):",
    ]
    lines += [f"  {name:<16} {seconds:7.1f} s" for name, seconds in report["stages_s"].items()]
    lines.append(f"same result both ways: {report['same_result']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
