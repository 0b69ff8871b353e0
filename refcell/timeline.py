"""A line that changes: dated events in a cell's line file, applied on the cell's clock.

A real line does not keep its parameters: a camera gets knocked, a supplier ships a new part
variant, a drive wears, the light changes with the season. A cell's line file lists such events
under `timeline:`, each on a day counted from the line's first day (the first time a reference
cell ran in its box). The reference cell applies every event whose day has come when a shift
starts, so a shift never changes halfway. Only refcell reads the timeline; the pipeline has to
find the change in the logs (drift, triage), as it would on a real line.

```yaml
timeline:
  - {day: 3, name: camera knocked, add: {perception.bias_x_m: 0.015}}
  - {day: 5, name: new part variant, new_part: {name: small-box, shape: box, size_m: 0.022,
             mass_scale: 0.8, share: 0.2}}
  - {day: 8, name: drive wear, latency_extra_steps: 1}
  - {day: 10, name: winter light, set: {lighting.amplitude: 1.4}}
```
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field, TypeAdapter
from pydantic.dataclasses import dataclass

from refcell.world import PartVariant, World, read_world_file

DAY_NS = 86_400 * 1_000_000_000
EPOCH_FILE = "line-epoch.json"  # in the cell's box: when the line's day 0 began
# `{"through_day": x}`, written by a harness that runs many line days (`realloop campaign`):
# the line idles no further than its day x, so it keeps pace with the work that watches it.
HOLD_FILE = "line-hold.json"
_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class NewPart:
    name: str
    shape: str
    size_m: float
    mass_scale: float
    # Of all parts from that day on; the other variants shrink to make room.
    share: Annotated[float, Field(gt=0.0, lt=1.0)]


@dataclass(frozen=True, config=_STRICT)
class LineEvent:
    day: Annotated[float, Field(ge=0.0)]
    name: str
    add: dict[str, float] = Field(default_factory=dict)  # `section.key`: added to the value
    set: dict[str, float] = Field(default_factory=dict)  # `section.key`: replaces the value
    new_part: NewPart | None = None
    latency_extra_steps: int = 0  # every command arrives this many steps later


Timeline = tuple[LineEvent, ...]


def parse_timeline(raw: object, where: str) -> Timeline:
    """The `timeline:` list of a line file, validated, in day order."""
    if raw is None:
        return ()
    try:
        events = TypeAdapter(list[LineEvent]).validate_python(raw)
    except ValueError as exc:
        first = str(exc).splitlines()[1:3]
        raise ValueError(f"{where}: timeline: {' '.join(s.strip() for s in first)}") from None
    return tuple(sorted(events, key=lambda event: event.day))


def load_timeline(name_or_path: str | Path) -> Timeline:
    """The dated events of a world file by name or path (empty if it has none)."""
    return parse_timeline(read_world_file(name_or_path).get("timeline"), str(name_or_path))


def events_until(timeline: Timeline, day: float) -> Timeline:
    return tuple(event for event in timeline if event.day <= day)


def world_on_day(world: World, timeline: Timeline, day: float) -> World:
    """`world` with every event of `timeline` up to `day` applied, in day order."""
    for event in events_until(timeline, day):
        world = apply_event(world, event)
    return world


def apply_event(world: World, event: LineEvent) -> World:
    for dotted, delta in event.add.items():
        world = _replace(world, dotted, lambda value, d=delta: value + d, event)
    for dotted, value in event.set.items():
        world = _replace(world, dotted, lambda _old, v=value: v, event)
    if event.new_part is not None:
        world = _with_new_part(world, event.new_part)
    if event.latency_extra_steps:
        extra = event.latency_extra_steps
        steps = {step + extra: p for step, p in world.latency.steps.items()}
        world = dataclasses.replace(world, latency=dataclasses.replace(world.latency, steps=steps))
    return world


def _replace(world: World, dotted: str, change, event: LineEvent) -> World:
    section_name, _, key = dotted.partition(".")
    section = getattr(world, section_name, None)
    if section is None or not dataclasses.is_dataclass(section) or not hasattr(section, key):
        raise ValueError(f"timeline event {event.name!r} (day {event.day}): no world key {dotted}")
    changed = dataclasses.replace(section, **{key: float(change(getattr(section, key)))})
    return dataclasses.replace(world, **{section_name: changed})


def _with_new_part(world: World, new: NewPart) -> World:
    scaled = tuple(
        dataclasses.replace(part, probability=part.probability * (1.0 - new.share))
        for part in world.parts
        if part.name != new.name
    )
    variant = PartVariant(new.name, new.shape, new.size_m, new.mass_scale, new.share)
    return dataclasses.replace(world, parts=(*scaled, variant))


def line_epoch_ns(box: Path, now_ns: int) -> int:
    """Day 0 of the cell's line: recorded in the box the first time, kept across restarts."""
    path = Path(box) / EPOCH_FILE
    try:
        return int(json.loads(path.read_text())["epoch_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(json.dumps({"epoch_ns": now_ns}) + "\n")
    temp.replace(path)  # a kill mid-write leaves no half-written epoch
    return now_ns


def line_day(epoch_ns: int, cell_ns: int) -> float:
    return (cell_ns - epoch_ns) / DAY_NS


def held_until_ns(hold_file: Path, epoch_ns: int, now_ns: int) -> int:
    """The cell time `hold_file` lets the line idle to. Not there yet or unreadable: where the
    line is now (the harness has not moved it on; it writes the file atomically)."""
    try:
        through_day = float(json.loads(Path(hold_file).read_text())["through_day"])
    except (OSError, ValueError, KeyError, TypeError):
        return now_ns
    return epoch_ns + round(through_day * DAY_NS)
