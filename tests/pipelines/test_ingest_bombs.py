"""Files that ask the decoder for far more than their size are refused before the work:
a zstd chunk of zeros (1 GiB from 33 KB), one far above any log's compression ratio, a chunk
flooded with empty records, a file flooded with empty chunks. Before the limits, the first
took decoding to 5.2 GB of memory and 22 s; the floods were decoded as if they were logs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import mcap_bombs

ROOT = Path(__file__).resolve().parents[2]
MAX_RSS_KB = 300 * 1024
BOMBS = {  # file name: (how to make it, the reason it is refused for)
    "zip.mcap": (mcap_bombs.zip_bomb, "over the 67108864-byte chunk limit"),
    "ratio.mcap": (mcap_bombs.ratio_bomb, "a decompression bomb"),
    "records.mcap": (
        lambda path: mcap_bombs.record_flood(path, 600_000),
        "more than 500000 records",
    ),
    "chunks.mcap": (lambda path: mcap_bombs.chunk_flood(path, 12_000), "more than 10000 chunks"),
}
# Reads each file as ingest does, then reports the reasons and the process's peak RSS.
CHILD = """
import json, sys
from pathlib import Path
from pipelines.ingest.shift_log import read_log
reasons = {}
for path in sys.argv[1:]:
    try:
        read_log(Path(path))
    except Exception as exc:
        reasons[Path(path).name] = str(exc)
# VmHWM, not ru_maxrss: Linux carries a parent's peak over fork and exec into ru_maxrss.
status = Path("/proc/self/status").read_text().splitlines()
peak = int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
print(json.dumps({"reasons": reasons, "max_rss_kb": peak}))
"""


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bombs")
    for name, (make, _) in BOMBS.items():
        make(folder / name)
    return folder


def test_each_bomb_is_refused_with_its_reason_before_it_costs_memory(bombs):
    paths = [str(bombs / name) for name in BOMBS]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *paths], capture_output=True, text=True, check=True
    )
    report = json.loads(done.stdout)
    for name, (_, why) in BOMBS.items():
        assert report["reasons"][name].startswith("refused MCAP: "), name
        assert why in report["reasons"][name], name
    assert report["max_rss_kb"] < MAX_RSS_KB


@pytest.mark.slow
def test_realloop_ingest_quarantines_every_bomb_under_300_mb(bombs, tmp_path):
    """`realloop ingest` itself, measured as an operator would: /usr/bin/time -v."""
    workspace = tmp_path / "ws"
    landing = workspace / "data" / "landing"
    landing.mkdir(parents=True)
    (workspace / "params.yaml").write_bytes((ROOT / "params.yaml").read_bytes())
    for name in BOMBS:
        os.link(bombs / name, landing / name)
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text("[user]\n\tname = test\n\temail = test@example.com\n")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(gitconfig)}
    env.pop("PREFECT_API_URL", None)
    realloop = Path(sys.executable).with_name("realloop")
    done = subprocess.run(
        ["/usr/bin/time", "-v", str(realloop), "ingest", "--json"],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    quarantined = {
        Path(q["source"]).name: q["reason"]
        for q in json.loads(done.stdout)["ingest"]["quarantined"]
    }
    assert {
        name: why in quarantined.get(name, "") for name, (_, why) in BOMBS.items()
    } == dict.fromkeys(BOMBS, True)
    assert sorted(p.name for p in (workspace / "data" / "quarantine").glob("*.mcap")) == sorted(
        BOMBS
    )
    peak = next(line for line in done.stderr.splitlines() if "Maximum resident set size" in line)
    assert int(peak.rsplit(":", 1)[1]) < MAX_RSS_KB
