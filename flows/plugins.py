"""Plug-ins named in params.yaml by import path (`package.module:name`).

Where the pipeline needs a simulator (calibration replays logged commands in it), params.yaml
names one under `simulator:` and this module imports it at run time. So the orchestrator never
imports the reference cell (import-linter checks that), and a user plugs in their own
simulator by naming it, without changing realloop (docs/calibration.md says what it must do).
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPEC_FORM = "package.module:name"


class PluginError(ValueError):
    """A plug-in cannot be used; the message names the params key, the import path and what
    to do, in one line."""


def load_plugin(spec: str, key: str = "plugin", protocol: type | None = None) -> Any:
    """The object that `spec` ("package.module:name", the name may be dotted) names.

    With `protocol` (a typing.Protocol) the object must have the protocol's methods; its data
    attributes are checked on the instance (`check_protocol`), since a class may set them in
    its constructor. PluginError names `key` and `spec` when any of that fails.
    """
    module_name, _, attribute = str(spec).partition(":")
    if not module_name or not attribute:
        raise PluginError(f"params {key}: {spec!r} is not an import path of the form {SPEC_FORM}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any failure inside someone else's module: report, don't crash
        raise PluginError(
            f"params {key}: cannot import {module_name!r} for {spec!r} ({_first_line(exc)}); "
            "install the package or fix the path"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise PluginError(
                f"params {key}: {module_name!r} has no {attribute!r} (from {spec!r}); "
                f"name an object of that module as {SPEC_FORM}"
            )
        target = getattr(target, part)
    if protocol is not None:
        _check_members(
            target,
            [m for m in protocol_members(protocol) if _is_method(protocol, m)],
            key,
            spec,
            protocol,
        )
    return target


def check_protocol(obj: Any, protocol: type, key: str, spec: str) -> Any:
    """`obj` with every method and attribute `protocol` declares, or PluginError."""
    _check_members(obj, protocol_members(protocol), key, spec, protocol)
    return obj


def protocol_members(protocol: type) -> list[str]:
    """The attributes (annotations) and methods a typing.Protocol declares itself."""
    methods = [
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and inspect.isfunction(value)
    ]
    return sorted({*getattr(protocol, "__annotations__", {}), *methods})


def load_simulator(params) -> tuple[Any, Mapping]:
    """The simulator (`simulator.replay`, built for `params.cell`) and the sim's world
    (`simulator.world`) that calibration replays with and starts from."""
    from pipelines.calibrate import Simulator

    spec = params.simulator.replay
    factory = load_plugin(spec, "simulator.replay", Simulator)
    simulator = check_protocol(
        _called(factory, "simulator.replay", spec, params.cell), Simulator, "simulator.replay", spec
    )
    spec = params.simulator.world
    world = _called(load_plugin(spec, "simulator.world"), "simulator.world", spec)
    if not isinstance(world, Mapping) or not isinstance(world.get("physics"), Mapping):
        raise PluginError(
            f"params simulator.world: {spec!r} returned {type(world).__name__}, not a world "
            "(a mapping with a `physics` section, as in a refcell world file)"
        )
    return simulator, world


def load_counterfactual(params, policy: Path, calibration: Path) -> Any:
    """Triage's standard-part replay (`simulator.counterfactual`) of `policy` (the policy
    folder the cell ran; only its version's episodes are replayed) in the sim `calibration`
    describes: a triage `Counterfactual`."""
    from pipelines.quality.triage import Counterfactual, StandardPartReplay

    spec = params.simulator.counterfactual
    replay = load_plugin(spec, "simulator.counterfactual", StandardPartReplay)
    version = json.loads((Path(policy) / "config.json").read_text()).get("version")
    return Counterfactual(replay, Path(policy), Path(calibration), version)


def _called(factory: Any, key: str, spec: str, *args: Any) -> Any:
    if not callable(factory):
        raise PluginError(f"params {key}: {spec!r} is a {type(factory).__name__}, not callable")
    try:
        return factory(*args)
    except Exception as exc:  # the plug-in's own failure, in one line that names it
        raise PluginError(f"params {key}: {spec!r} failed: {_first_line(exc)}") from None


def _check_members(obj: Any, members: list[str], key: str, spec: str, protocol: type) -> None:
    missing = [name for name in members if not hasattr(obj, name)]
    if missing:
        raise PluginError(
            f"params {key}: {spec!r} lacks {', '.join(missing)} of the {protocol.__name__} "
            f"protocol ({protocol.__module__}); see docs/calibration.md"
        )
    uncallable = [m for m in members if _is_method(protocol, m) and not callable(getattr(obj, m))]
    if uncallable:
        raise PluginError(
            f"params {key}: {spec!r}: {', '.join(uncallable)} must be methods "
            f"({protocol.__name__} protocol, {protocol.__module__})"
        )


def _is_method(protocol: type, name: str) -> bool:
    return inspect.isfunction(vars(protocol).get(name))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0]}" if text else exc.__class__.__name__
