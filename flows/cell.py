"""`realloop cell ...`: the reference cell, for pretraining, evaluation and recording, and
`realloop cell run`, a cell as a separate process (the logic lives in refcell.process)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from flows.console import CommandError, emit, fails_cleanly, progress_bar, stdout

app = typer.Typer(
    help="The reference cell: pretrain in sim, evaluate, record line logs, run as a cell.",
    no_args_is_help=True,
)

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
PolicyOpt = Annotated[str, typer.Option("--policy", help="sim, expert, or a policy folder")]


def resolve_controller(policy: str, params_path: Path):
    """`expert`, `sim` (params' pretrain.out) or a folder holding a saved policy."""
    from pipelines.contract.params import load_params

    if policy == "expert":
        from refcell.expert import Expert

        return Expert()
    from pipelines.training import load_policy

    folder = Path(load_params(params_path).pretrain.out) if policy == "sim" else Path(policy)
    if not (folder / "config.json").is_file():
        hint = "run `realloop cell pretrain`" if policy == "sim" else "pass a policy folder"
        raise CommandError(f"{folder}: no policy there ({hint})")
    return load_policy(folder)


@app.command()
@fails_cleanly
def pretrain(
    params_path: ParamsOpt = Path("params.yaml"),
    out: Annotated[
        Path | None, typer.Option(help="overrides pretrain.out (pretrain.calibrated_out)")
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(help="sim-calibration.yaml from `realloop calibrate`: pretrain in that sim"),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Behaviour cloning + DAgger in the domain-randomized sim; writes the sim policy.
    With --calibration, the sim first takes the line's estimated parameters and ranges."""
    from pipelines.contract.params import load_params
    from pipelines.training.onnx_export import save_policy_for_edge
    from pipelines.training.train import intra_op_threads
    from refcell.pretrain import pretrain_with_observations

    params = load_params(params_path)
    world, pretrain_params, identity = _pretrain_world(params.pretrain, calibration)
    with progress_bar(not as_json) as update, intra_op_threads(params.train.threads):
        net, observations = pretrain_with_observations(
            world, params.cell, pretrain_params, progress=update, **identity
        )
    default_out = params.pretrain.calibrated_out if calibration else params.pretrain.out
    # With policy.onnx and ood.json: the sim policy is what `deploy --initial` publishes.
    folder, _ = save_policy_for_edge(
        net,
        out or Path(default_out),
        observations,
        params.edge.ood_false_alarm,
        params.edge.footprint_tolerance_m,
    )
    payload = {"policy": str(folder), "version": net.config.version, **net.config.trained_on}
    emit(
        payload, as_json, lambda p: stdout.print(f"{p['version']} policy written to {p['policy']}")
    )


def _pretrain_world(params, calibration: Path | None):
    """(world, pretrain params, policy identity): the plain sim, or the calibrated one with
    the calibration's randomization ranges and its own delay distribution."""
    from refcell.pretrain import calibrated_setup
    from refcell.world import load_world

    if calibration is None:
        return load_world("sim"), params, {}
    return calibrated_setup(params, calibration)  # as the loop's calibrated candidates


@app.command("eval")
@fails_cleanly
def evaluate(
    policy: PolicyOpt = "sim",
    world: Annotated[str, typer.Option(help="sim, line or a cell's line: cell-07, ...")] = "sim",
    episodes: Annotated[int, typer.Option(min=1)] = 200,
    seed: int = 1000,
    interventions: Annotated[bool, typer.Option(help="let the operator take over")] = False,
    day: Annotated[
        float | None,
        typer.Option(min=0.0, help="the line as on this day: its timeline's events up to it"),
    ] = None,
    seeds: Annotated[
        str | None,
        typer.Option(
            help="comma-separated seeds, N episodes each at a different start offset in the "
            "shift: success is their mean, with the range (instead of --seed)"
        ),
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Run N episodes and report success, safety stops, interventions and cycle time."""
    _one_control_thread()
    if seeds is None:
        payload = run_eval(
            policy, world, episodes, seed, interventions, params_path, progress=True, day=day
        )
    else:
        payload = run_eval_seeds(
            policy, world, episodes, _seed_list(seeds), interventions, params_path, day
        )
    emit(payload, as_json, _print_eval)


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--seeds {text}: not a comma-separated list of integers") from None
    if not seeds:
        raise CommandError("--seeds: give at least one seed")
    return seeds


def run_eval_seeds(
    policy: str,
    world: str,
    episodes: int,
    seeds: list[int],
    interventions: bool,
    params_path: Path,
    day: float | None = None,
) -> dict:
    """`episodes` per seed, seed k starting k/len(seeds) of the way into the shift (so each
    meets the shift's light and load in another order): the mean and range over seeds."""
    rows = [
        run_eval(
            policy,
            world,
            episodes,
            seed,
            interventions,
            params_path,
            progress=True,
            day=day,
            offset=k * episodes // len(seeds),
        )
        for k, seed in enumerate(seeds)
    ]
    rates = [row["success_rate"] for row in rows]
    return {
        "policy": policy,
        "world": world,
        "day": day,
        "events": rows[0]["events"],
        "seeds": [
            {"seed": r["seed"], "offset": r["offset"], "success_rate": r["success_rate"]}
            for r in rows
        ],
        "episodes": sum(r["episodes"] for r in rows),
        "success_rate": sum(rates) / len(rates),
        "success_min": min(rates),
        "success_max": max(rates),
        "safety_stops": sum(r["safety_stops"] for r in rows),
        "interventions": sum(r["interventions"] for r in rows),
        "mean_cycle_time_s": sum(r["mean_cycle_time_s"] for r in rows) / len(rows),
    }


def run_eval(
    policy: str,
    world: str,
    episodes: int,
    seed: int,
    interventions: bool,
    params_path: Path,
    progress: bool = False,
    day: float | None = None,
    offset: int = 0,
) -> dict:
    """`day`: the world with its timeline's events up to that day applied (refcell.timeline);
    `offset`: the episodes take the shift's slots from this one on, wrapping around."""
    from pipelines.contract.params import load_params
    from refcell.cell import Cell
    from refcell.runner import Operator, run_episode, summarize
    from refcell.timeline import events_until, load_timeline, world_on_day
    from refcell.world import WORLD_NAMES, load_world

    if world not in WORLD_NAMES:
        raise CommandError(f"--world {world}: unknown world; use one of {', '.join(WORLD_NAMES)}")
    params = load_params(params_path)
    controller = resolve_controller(policy, params_path)
    operator = Operator(params.record.operator) if interventions else None
    line, events = load_world(world), ()
    if day is not None:
        timeline = load_timeline(world)
        line, events = world_on_day(line, timeline, day), events_until(timeline, day)
    cell, results = Cell(line, params.cell), []
    with progress_bar(progress) as update:
        for index in range(offset, offset + episodes):
            results.append(run_episode(cell, controller, seed, index, episodes, operator))
            update(f"{policy} on {world}", len(results), episodes)
    return {
        "policy": policy,
        "world": world,
        "seed": seed,
        "offset": offset,
        "day": day,
        "events": [event.name for event in events],
        **summarize(results),
    }


def _print_eval(p: dict) -> None:
    spread = f" (seeds {p['success_min']:.1%}-{p['success_max']:.1%})" if "seeds" in p else ""
    stdout.print(
        f"{p['policy']} on {p['world']}: success {p['success_rate']:.1%}{spread} of "
        f"{p['episodes']}, "
        f"safety stops {p['safety_stops']}, interventions {p['interventions']}, "
        f"mean cycle {p['mean_cycle_time_s']:.2f} s"
    )


@app.command()
@fails_cleanly
def timeline(
    world: Annotated[str, typer.Option(help="a cell's line (cell-07, ...) or a world YAML")],
    as_json: JsonOpt = False,
) -> None:
    """The dated events of a line (days from the line's first day), as the cell applies them."""
    from refcell.timeline import load_timeline

    try:
        events = [{"day": e.day, "name": e.name} for e in load_timeline(world)]
    except FileNotFoundError:
        raise CommandError(f"--world {world}: no such world or YAML file") from None
    emit(
        {"world": world, "events": events},
        as_json,
        lambda p: [stdout.print(f"day {e['day']:g}: {e['name']}") for e in p["events"]],
    )


@app.command()
@fails_cleanly
def record(
    out: Annotated[Path, typer.Option(help="landing folder for logs and captures")],
    policy: PolicyOpt = "sim",
    episodes: Annotated[int, typer.Option(min=1)] = 100,
    seed: int = 1,
    interventions: Annotated[
        bool, typer.Option(help="operator takes over a failing policy")
    ] = False,
    start: Annotated[
        str | None, typer.Option(help="shift start, ISO 8601 UTC (default now)")
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Run a policy on the line and write what a real cell writes: MCAP logs and captures."""
    payload = run_record(policy, episodes, out, seed, interventions, start, params_path, True)
    emit(
        payload,
        as_json,
        lambda p: stdout.print(
            f"recorded {p['episodes']} episodes into {len(p['files'])} logs and "
            f"{len(p['captures'])} captures under {out}"
        ),
    )


def run_record(
    policy: str,
    episodes: int,
    out: Path,
    seed: int,
    interventions: bool,
    start: str | None,
    params_path: Path,
    progress: bool = False,
) -> dict:
    from pipelines.contract.params import load_params
    from refcell.shift import record_shift
    from refcell.world import load_world

    params = load_params(params_path)
    controller = resolve_controller(policy, params_path)
    shift_start = _parse_start(start)
    with progress_bar(progress) as update:
        return record_shift(
            load_world("line"),
            params.cell,
            params.record,
            controller,
            episodes,
            out,
            seed,
            interventions=interventions,
            policy_version=controller.name,
            shift_start=shift_start,
            progress=lambda done, total: update("recording shift", done, total),
        )


@app.command("run")
@fails_cleanly
def run_cell(
    cell_id: Annotated[str, typer.Option("--cell-id", help="this cell's id, e.g. cell-07")],
    world: Annotated[str, typer.Option(help="line, a cell's line (cell-07, ...) or a world YAML")],
    channel: Annotated[str, typer.Option(help="edge channel: folder or s3://bucket/prefix")],
    landing: Annotated[str, typer.Option(help="landing zone: folder or s3://bucket/prefix")],
    box: Annotated[Path, typer.Option(help="the edge box's folder (models, recordings, trials)")],
    root: Annotated[
        Path | None,
        typer.Option(
            help="the channel's root.json to enrol the box with (default: trust the channel's "
            "first root on first use, for reference cells only)"
        ),
    ] = None,
    episodes_per_shift: Annotated[int, typer.Option(min=1, help="episodes in a shift")] = 300,
    seed: Annotated[int, typer.Option(help="episode draws: per shift from (seed, shift id)")] = 0,
    speed: Annotated[
        float, typer.Option(min=0.001, help="cell clock speed: cell seconds per wall second")
    ] = 60.0,
    poll_s: Annotated[
        float, typer.Option(min=0.01, help="wall seconds between channel polls")
    ] = 2.0,
    ground_truth: Annotated[
        bool, typer.Option(help="keep .groundtruth side files (replays cost sim time)")
    ] = True,
    shifts: Annotated[
        int | None,
        typer.Option(min=1, help="production shifts to record, then only trials (default: no end)"),
    ] = None,
    shifts_per_day: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="production shifts start at fixed times of the line's day, K a day; the clock "
            "idles between them (default: back to back)",
        ),
    ] = None,
    hold_file: Annotated[
        Path | None, typer.Option(help='{"through_day": x}: idle no further than line day x')
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: Annotated[
        bool, typer.Option("--json", help="a JSON summary on stdout at exit")
    ] = False,
) -> None:
    """Run one reference cell until SIGTERM/SIGINT: follow the channel, record shifts, upload
    closed logs to the landing zone, run trial requests (docs/operations.md). Logs to stderr."""
    import dataclasses

    from edge.channels import EdgeError
    from pipelines.contract.params import load_params
    from refcell.process import CellProcess, CellRunConfig, log_to_stderr
    from refcell.world import WORLD_NAMES

    if world not in WORLD_NAMES and not Path(world).is_file():
        raise CommandError(
            f"--world {world}: no such world; use one of {', '.join(WORLD_NAMES)} or a YAML file"
        )
    params = load_params(params_path)
    _one_control_thread()
    if root is not None:  # the box enrols with it on its first poll (refcell.process.edgebox)
        box.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root, box / "root.json")
    config = CellRunConfig(
        cell_id, world, channel, landing, box, episodes_per_shift, seed, speed, poll_s, ground_truth
    )
    config = dataclasses.replace(config, max_shifts=shifts, shifts_per_day=shifts_per_day)
    config = dataclasses.replace(config, hold_file=hold_file)
    try:
        process = CellProcess(
            config,
            dataclasses.replace(params.cell, cell_id=cell_id),
            params.record,
            edge_params=params.edge,
        )
        log_to_stderr(process.clock)
        process.stop_on_signals()
        summary = process.run()
    except EdgeError as exc:
        raise CommandError(str(exc)) from None
    emit(summary, as_json, lambda p: None)  # the log on stderr already told the story


def _one_control_thread() -> None:
    """A cell acts on one observation at a time: torch's thread pool cannot speed up a batch of
    one, and with cells and training sharing cores its spin-waits only take CPU from them."""
    import torch

    torch.set_num_threads(1)


def _parse_start(start: str | None) -> datetime:
    if start is None:
        return datetime.now(UTC).replace(microsecond=0)
    try:
        parsed = datetime.fromisoformat(start)
    except ValueError:
        raise CommandError(f"--start {start}: not an ISO 8601 time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@app.command()
@fails_cleanly
def demo(
    episodes: Annotated[int, typer.Option(help="evaluation episodes per world")] = 200,
    record_episodes: Annotated[int, typer.Option(help="line episodes to record")] = 20,
    landing: Path = Path("data/landing"),
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Pretrain if needed, show the sim-to-real gap, record a small shift of line logs."""
    from pipelines.contract.params import load_params

    params = load_params(params_path)
    if not (Path(params.pretrain.out) / "config.json").is_file():
        pretrain(params_path=params_path, out=None, as_json=False)
    rows = [
        run_eval(policy, world, episodes, 2000, False, params_path, progress=True)
        for policy in ("sim", "expert")
        for world in ("sim", "line")
    ]
    shift = run_record("sim", record_episodes, landing, 3000, True, None, params_path, True)
    emit({"evaluations": rows, "recorded": shift}, as_json, _print_demo)


def _print_demo(payload: dict) -> None:
    from rich.table import Table

    table = Table(title="The sim-to-real gap")
    for column in ("policy", "world", "success", "safety stops", "mean cycle (s)"):
        table.add_column(column)
    for r in payload["evaluations"]:
        table.add_row(
            r["policy"],
            r["world"],
            f"{r['success_rate']:.1%}",
            str(r["safety_stops"]),
            f"{r['mean_cycle_time_s']:.2f}",
        )
    stdout.print(table)
    shift = payload["recorded"]
    stdout.print(
        f"recorded {shift['episodes']} line episodes (operator on) into "
        f"{len(shift['files'])} MCAP logs and {len(shift['captures'])} captures"
    )
