"""Provenance in both directions.

- model → data: a registered model version names its dataset version (MLflow tag), the batches
  it trained on (run artifact), its params and its gate record with the trial logs;
  each batch is one source log file, whose URI and sha256 the episodes table carries.
- file → models: a log file's sha256 is the name of its batch; every dataset version whose DVC
  listing holds that batch contains the file, and every model version trained on one of those
  versions, or judged on trials from it, descends from it.

At fleet size (hundreds of sources, dataset versions and model versions) both directions work
from indexes, not from the data:
- what a source is (URI, cell, policy version, episode count) comes from
  `.realloop/lineage-sources.jsonl`, one line per source sha256. A source's episodes file
  never changes (its name is its content's sha256), so a line never goes stale; sources it
  lacks are read from their episodes files in one Parquet scan and added.
- which versions hold a file: a text search of each version's `.dir` listing in DVC's cache
  (`versioning.versions_holding`), no checkout and no Parquet;
- which models descend from a file: one registry query lists every version with its tags,
  and each version's two small JSON artifacts (training batches, gate record) are read
  straight from its run's artifact root (a plain file read in the default local store).
"""

from __future__ import annotations

import fcntl
import json
import re
from pathlib import Path

import pyarrow.parquet as pq

from pipelines.ingest import sha256_file, versioning
from pipelines.training import model_version_record, model_version_summaries

SHA256 = re.compile(r"^[0-9a-f]{64}$")
SOURCE_INDEX = Path(".realloop/lineage-sources.jsonl")  # in the workspace
SOURCE_COLUMNS = ("source_sha256", "source_uri", "cell_id", "policy_version")


def model_lineage(workspace: Path, dataset: Path, registered_model: str, version: str) -> dict:
    record = model_version_record(registered_model, version)
    gate = record.get("gate") or {}
    trial_sources = gate.get("trial_sources", {})
    sources = _sources(
        workspace,
        dataset,
        [*record["training_batches"], *(s for shas in trial_sources.values() for s in shas)],
    )
    return {
        "model": registered_model,
        "version": str(version),
        "mlflow_run_id": record["run_id"],
        "dataset_version": record["dataset_version"],
        "sources": [sources[sha] for sha in record["training_batches"]],
        "params": record["params"],
        "trials": {
            role: {
                "stats": gate.get(role),
                "sources": [sources[sha] for sha in shas],
            }
            for role, shas in trial_sources.items()
        },
        "gate": {"passed": gate.get("passed"), "reasons": gate.get("reasons", [])},
    }


def file_lineage(workspace: Path, dataset: Path, registered_model: str, target: str) -> dict:
    """Every dataset version and model version that holds `target` (a path or a sha256)."""
    sha = _sha_of(target)
    versions = versioning.versions_holding(workspace, sha)
    models = []
    for record in model_version_summaries(registered_model, workspace=workspace):
        gate = record.get("gate") or {}
        trial_roles = [r for r, shas in gate.get("trial_sources", {}).items() if sha in shas]
        if sha in record["training_batches"] or trial_roles:
            models.append(
                {
                    "model": registered_model,
                    "version": record["version"],
                    "dataset_version": record["dataset_version"],
                    "trained_on_file": sha in record["training_batches"],
                    "trials": trial_roles,
                }
            )
    return {
        "file": target,
        "sha256": sha,
        "source": _sources(workspace, dataset, [sha])[sha],
        "dataset_versions": versions,
        "models": models,
    }


def _sha_of(target: str) -> str:
    path = Path(target)
    if path.is_file():
        return sha256_file(path)
    if SHA256.match(target):
        return target
    raise ValueError(f"{target}: neither a file nor a sha256; pass a log file or its sha256")


# --- sources: the index, filled from the episodes files ------------------------------------


def _sources(workspace: Path, dataset: Path, shas: list[str]) -> dict[str, dict]:
    """Where each batch came from (sha256 → uri, cell_id, policy_version, episodes): from the
    index, else from its episodes file (then indexed); a batch with neither has uri None."""
    index = _read_index(workspace)
    missing = [sha for sha in dict.fromkeys(shas) if sha not in index]
    found = _read_sources(dataset, missing)
    if found:
        _append_index(workspace, list(found.values()))
        index.update(found)
    return {sha: index.get(sha) or {"sha256": sha, "uri": None, "episodes": 0} for sha in shas}


def _read_sources(dataset: Path, shas: list[str]) -> dict[str, dict]:
    """The provenance columns of these sources' episodes files, in one Parquet scan (the
    first row of each source: every episode of one file shares them)."""
    paths = {sha: Path(dataset) / "episodes" / f"{sha}.parquet" for sha in shas}
    paths = {sha: path for sha, path in paths.items() if path.is_file()}
    if not paths:
        return {}
    import pyarrow.dataset as ds

    found: dict[str, dict] = {}
    try:
        schema = pq.read_schema(next(iter(paths.values())))
        table = ds.dataset([str(p) for p in paths.values()], schema=schema, format="parquet")
        rows = table.to_table(columns=list(SOURCE_COLUMNS)).to_pydict()
    except Exception:  # an odd file among them (another schema): one by one below
        rows = {column: [] for column in SOURCE_COLUMNS}
    for sha, uri, cell, policy in zip(*(rows[c] for c in SOURCE_COLUMNS), strict=True):
        if sha in found:
            found[sha]["episodes"] += 1
        elif sha in paths:
            found[sha] = _entry(sha, uri, cell, policy, 1)
    for sha in paths.keys() - found.keys():  # no rows, or rows that name another source
        found[sha] = _read_source(sha, paths[sha])
    return found


def _read_source(sha: str, episodes: Path) -> dict:
    table = pq.read_table(episodes, columns=["source_uri", "cell_id", "policy_version"])
    first = table.slice(0, 1).to_pylist()[0] if table.num_rows else {}
    return _entry(
        sha,
        first.get("source_uri"),
        first.get("cell_id"),
        first.get("policy_version"),
        table.num_rows,
    )


def _entry(sha: str, uri, cell, policy, episodes: int) -> dict:
    return {
        "sha256": sha,
        "uri": uri,
        "cell_id": cell,
        "policy_version": policy,
        "episodes": episodes,
    }


def _read_index(workspace: Path) -> dict[str, dict]:
    index = {}
    try:
        lines = (Path(workspace) / SOURCE_INDEX).read_text().splitlines()
    except FileNotFoundError:
        return index
    for line in lines:
        try:
            entry = json.loads(line)
            index[entry["sha256"]] = entry
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash
    return index


def _append_index(workspace: Path, entries: list[dict]) -> None:
    """Append under a lock, whole lines at once; an index that cannot be written (a
    read-only workspace) only costs the next call the same scan."""
    path = Path(workspace) / SOURCE_INDEX
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                handle.write("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    except OSError:
        pass
