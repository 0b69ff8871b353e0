"""Crash safety (SIGKILL at many points, then a re-run) and two runs at once."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipelines.ingest import store as ingest_module
from pipelines.ingest.quarantine import REASON_SUFFIX
from pipelines.ingest.store import dataset_content_hash, read_dataset, read_manifest, sha256_file
from tests.pipelines.test_ingest_helpers import (
    RUN_TIME,
    abandoned,
    copy_landing,
    export_table,
    good_logs,
    ingest,
    recorded_shift,
    start_child,
    write_parquet_export,
)

PARQUET_NAME = re.compile(r"^[0-9a-f]{64}\.parquet$")


@pytest.fixture(scope="module")
def pristine(params, tmp_path_factory) -> Path:
    """A landing folder: three logs with captures, an export of two new episodes, and two
    files for quarantine."""
    tmp = tmp_path_factory.mktemp("pristine")
    landing = copy_landing(recorded_shift(), tmp)
    scratch = tmp_path_factory.mktemp("scratch")
    first = good_logs(landing)[0]
    (scratch / "in").mkdir()
    shutil.copy(first, scratch / "in" / first.name)
    ingest(scratch, scratch / "in", params)
    episodes, steps = read_dataset(scratch / "dataset")
    renamed = [
        table.set_column(
            table.schema.get_field_index("episode_id"),
            "episode_id",
            pc.replace_substring(table.column("episode_id"), "T060000Z", "T140000Z"),
        )
        for table in (episodes, steps)
    ]
    write_parquet_export(export_table(*renamed), landing / "late-shift-export.parquet")
    (landing / "empty.mcap").write_bytes(b"")
    data = first.read_bytes()
    (landing / "cut.mcap").write_bytes(data[: len(data) // 2])
    abandoned(landing / "cut.mcap")  # copytree keeps the mtime: every copy is abandoned too
    return landing


def reset(work: Path, pristine: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(pristine, work / "landing", symlinks=True)
    return work / "landing"


def snapshot(work: Path) -> dict:
    """Every file of the dataset by its bytes, what quarantine holds and why, what is left in
    the landing folder."""
    dataset = work / "dataset"
    quarantine = work / "quarantine"
    return {
        "dataset": {
            p.relative_to(dataset).as_posix(): sha256_file(p)
            for p in sorted(dataset.rglob("*"))
            if p.is_file()
        },
        "quarantine": {
            p.name: (p.read_text().splitlines()[0] if p.name.endswith(REASON_SUFFIX) else "")
            for p in sorted(quarantine.iterdir())
            if not p.name.startswith(".")
        },
        "landing": sorted(
            p.relative_to(work / "landing").as_posix() for p in (work / "landing").rglob("*")
        ),
    }


def assert_nothing_partial(dataset: Path) -> None:
    """What a reader (or `dvc add`) sees after a kill: only complete files."""
    for folder in ("episodes", "steps"):
        for path in (dataset / folder).iterdir():
            assert PARQUET_NAME.match(path.name), path
            pq.read_table(path)  # complete and readable
    for path in (dataset / "attachments").iterdir():
        assert path.stem == sha256_file(path), path
    episodes = {p.stem for p in (dataset / "episodes").iterdir()}
    assert episodes <= {p.stem for p in (dataset / "steps").iterdir()}  # steps first


def counting_run(work: Path, landing: Path, params, monkeypatch) -> int:
    """An uninterrupted run, counting the publishing operations a kill can fall between."""
    calls = [0]

    def counted(function):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            return function(*args, **kwargs)

        return wrapper

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", counted(os.replace))
        patch.setattr(os, "rename", counted(os.rename))
        patch.setattr(ingest_module, "_append_line", counted(ingest_module._append_line))
        ingest(work, landing, params, run_id="run-x", ingested_at=RUN_TIME)
    return calls[0]


def test_sigkill_at_random_points_then_a_rerun_gives_the_same_dataset(
    pristine, params, tmp_path, monkeypatch
):
    work = tmp_path / "work"
    landing = reset(work, pristine)
    began = time.monotonic()
    operations = counting_run(work, landing, params, monkeypatch)
    duration = time.monotonic() - began
    reference = snapshot(work)
    reference_content = dataset_content_hash(work / "dataset")
    assert len(reference["quarantine"]) == 4 and operations > 20
    rng = random.Random(20261201)
    quarter = operations / 4  # one kill in each quarter of the run's publishing operations
    kills = [("operation", 1 + int(q * quarter + rng.random() * quarter)) for q in range(4)]
    kills += [("time", round(rng.uniform(0.0, 1.5 * duration), 3)) for _ in range(2)]
    for number, (kind, at) in enumerate(kills):
        landing = reset(work, pristine)
        if kind == "operation":
            child = start_child(
                work, landing, params, "run-x", ingested_at=RUN_TIME.isoformat(), kill_at=at
            )
        else:
            child = start_child(work, landing, params, "run-x", ingested_at=RUN_TIME.isoformat())
            time.sleep(at)
            child.kill()
        child.wait(timeout=120)
        if kind == "operation":
            assert child.returncode == -9, (at, child.stderr.read())
        if (work / "dataset").is_dir():
            assert_nothing_partial(work / "dataset")
        if number == 0:
            # A re-run is a new run: other run id and time, the same data.
            report = ingest(work, landing, params, run_id="run-after-crash").as_dict()
            assert dataset_content_hash(work / "dataset") == reference_content, (kind, at)
            assert snapshot(work)["quarantine"] == reference["quarantine"]
        else:
            # The same run retried: byte for byte what the uninterrupted run wrote.
            report = ingest(work, landing, params, run_id="run-x", ingested_at=RUN_TIME).as_dict()
            assert snapshot(work) == reference, (kind, at)
        assert report["files_landed"] >= 3  # at least the logs, now skipped or ingested
        episodes, _ = read_dataset(work / "dataset")
        ids = episodes.column("episode_id").to_pylist()
        assert len(ids) == len(set(ids)) == 8


def test_two_runs_at_once_on_overlapping_folders_make_one_dataset(pristine, params, tmp_path):
    """Run A ingests the landing folder, run B a subfolder of it, started at the same moment;
    the result is the dataset one run makes, each file ingested or quarantined once."""

    def arrange(work: Path) -> Path:
        landing = reset(work, pristine)
        shutil.rmtree(landing / "captures")  # B's folder cannot see them: not this test's point
        more = landing / "more"
        more.mkdir()
        names = [p.name for p in sorted(landing.glob("cell-*.mcap"))[1:]]
        for name in [*names, "late-shift-export.parquet", "empty.mcap", "cut.mcap"]:
            (landing / name).rename(more / name)
        return landing

    work = tmp_path / "work"
    landing = arrange(work)
    single = ingest(work, landing, params, run_id="single").as_dict()
    expected = snapshot(work)
    expected_content = dataset_content_hash(work / "dataset")
    landing = arrange(work)
    go = work / "go"
    a = start_child(work, landing, params, "run-a", go=str(go))
    b = start_child(work, landing / "more", params, "run-b", go=str(go))
    go.touch()
    reports = []
    for child in (a, b):
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert dataset_content_hash(work / "dataset") == expected_content
    assert snapshot(work)["quarantine"] == expected["quarantine"]
    ingested = [{f["sha256"] for f in r["ingested"]} for r in reports]
    assert not ingested[0] & ingested[1]  # nothing ingested twice
    assert ingested[0] | ingested[1] == {f["sha256"] for f in single["ingested"]}
    quarantined = [{Path(f["source"]).name for f in r["quarantined"]} for r in reports]
    assert not quarantined[0] & quarantined[1]
    assert quarantined[0] | quarantined[1] == {"empty.mcap", "cut.mcap"}
    episodes, steps = read_dataset(work / "dataset")
    ids = episodes.column("episode_id").to_pylist()
    assert len(ids) == len(set(ids)) == 8
    assert steps.num_rows == single["steps_ingested"]
    runs = {row["run_id"] for row in read_manifest(work / "dataset")}
    assert runs == {"run-a", "run-b"}


def test_the_dataset_bytes_depend_only_on_the_files_and_the_run(pristine, params, tmp_path):
    """Two runs over the same files with one run id and time write identical bytes; with
    another run id and time only the run columns differ, which the content hash leaves out."""
    work = tmp_path / "work"
    hashes = []
    for run, when in (("run-x", RUN_TIME), ("run-x", RUN_TIME), ("run-y", None)):
        landing = reset(work, pristine)
        ingest(work, landing, params, run_id=run, ingested_at=when)
        dataset = work / "dataset"
        hashes.append((dataset_content_hash(dataset, exclude=()), dataset_content_hash(dataset)))
    assert hashes[0] == hashes[1]
    assert hashes[2][0] != hashes[0][0] and hashes[2][1] == hashes[0][1]
