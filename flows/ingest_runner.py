"""Where ingest's per-file tasks run: the flow's bounded thread pool, or a Dask cluster.

`ingest.cluster` in params.yaml chooses:

    null (default)        the flow's own thread pool, `ingest.workers` files at a time
    local                 a Dask LocalCluster started for the run and stopped after it: one
                          single-threaded worker process per core (at most `ingest.workers`)
    local:N               the same with N worker processes
    tcp://host:8786       an existing Dask cluster, by its scheduler's address
                          (`dask scheduler`, then `dask worker tcp://host:8786` per machine)

The tasks go through prefect-dask's `DaskTaskRunner`, so each file is still one Prefect task
run (named, logged, visible in the UI), run in a worker process: decoding is CPU-bound Python
and numpy, so separate processes use separate cores where threads share one interpreter lock.
Only the per-file tasks go there; listing, downloads and versioning stay in the flow's
process. Workers write the dataset themselves, through the same file locks threads use, so:

- a remote cluster's workers must see the workspace at the same path (a shared filesystem)
  and run the same realloop version (Dask sends the task by reference: module and name);
- their task runs report to PREFECT_API_URL, which must name a server they can reach. A
  LocalCluster's workers are told the URL of the flow's own API, also the ephemeral one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

LOCAL = "local"


class ClusterError(ValueError):
    """`ingest.cluster` names no cluster that can be used."""


def is_local(cluster: str) -> bool:
    return cluster == LOCAL or cluster.startswith(f"{LOCAL}:")  # not "localhost:8786"


def local_workers(cluster: str, workers: int) -> int:
    """Worker processes for `local` / `local:N`."""
    if cluster == LOCAL:
        return max(1, min(workers, os.cpu_count() or 1))
    count = cluster.removeprefix(f"{LOCAL}:")
    if not count.isdigit() or int(count) < 1:
        raise ClusterError(
            f"ingest.cluster: {cluster!r} is not `local`, `local:N` (N >= 1) or a "
            "scheduler address such as tcp://host:8786; fix params.yaml"
        )
    return int(count)


def describe(cluster: str | None, workers: int) -> str:
    """The runner in words, for logs and the bench."""
    if not cluster:
        return f"thread pool ({workers} at a time)"
    if is_local(cluster):
        return f"Dask LocalCluster ({local_workers(cluster, workers)} worker processes)"
    return f"Dask cluster at {cluster}"


@contextmanager
def per_file_runner(cluster: str | None, workers: int) -> Iterator[object | None]:
    """A started DaskTaskRunner for `cluster`, or None for the flow's own thread pool.
    Call inside a flow run (a LocalCluster's workers report to its API)."""
    if not cluster:
        yield None
        return
    from prefect_dask import DaskTaskRunner

    if is_local(cluster):
        runner = DaskTaskRunner(cluster_kwargs=_local_cluster(local_workers(cluster, workers)))
    else:
        runner = DaskTaskRunner(address=cluster)
    with runner:
        yield runner


def capacity(runner) -> int:
    """Tasks the cluster runs at once (threads over all workers), at least 1."""
    return max(1, sum(runner.client.nthreads().values()))


def _local_cluster(processes: int) -> dict:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        api = str(client.api_url)
    return {
        "n_workers": processes,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": ":0",  # any free port: never fails on a busy 8787
        # Dask's own warnings (a worker slow to stop on a loaded machine) are not the user's
        # to act on; a cluster that cannot start still raises.
        "silence_logs": logging.ERROR,
        # The flow's API, also the ephemeral one this process started: a worker left to
        # itself would start its own server on the same database.
        "env": {"PREFECT_API_URL": api},
    }
