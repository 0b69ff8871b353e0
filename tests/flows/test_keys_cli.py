"""`realloop keys init | rotate | refresh` in-process (typer's runner): JSON, one-line errors."""

from __future__ import annotations

import json
import stat

from typer.testing import CliRunner

from edge import agent
from flows.cli import app
from tests.conftest import ROOT
from tests.edge.signed import enrolled, publish_override


def run(*args: str):
    return CliRunner().invoke(app, [*args, "--params", str(ROOT / "params.yaml")])


def test_init_rotate_refresh(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    keys, channel = tmp_path / "keys", str(tmp_path / "channel")
    made = run("keys", "init", str(keys), "--channel", channel, "--json")
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["made"] == ["root", "timestamp", "snapshot", "targets", "gate"]
    assert stat.S_IMODE((keys / "offline" / "root.key").stat().st_mode) == 0o600

    model = tmp_path / "model.safetensors"
    model.write_bytes(b"w1")
    publish_override(
        channel,
        "cell-07",
        {"model.safetensors": model},
        {"model_name": "m", "model_version": 1},
        keys,
    )
    box = enrolled(channel, keys, "cell-07", tmp_path / "box")
    agent.pull(box)

    rotated = run(
        "keys", "rotate", "timestamp", "--keys", str(keys), "--channel", channel, "--json"
    )
    assert rotated.exit_code == 0, rotated.output
    assert json.loads(rotated.stdout)["root_version"] == 2
    refreshed = run("keys", "refresh", "--keys", str(keys), "--channel", channel, "--json")
    assert refreshed.exit_code == 0, refreshed.output
    assert agent.pull(box)["action"] == "already_active"  # followed root 2 and the new key

    (keys / "offline").rename(tmp_path / "vault")
    refused = run("keys", "rotate", "root", "--keys", str(keys), "--channel", channel)
    assert refused.exit_code == 1
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("realloop: ") and "no root key" in line and "offline" in line
