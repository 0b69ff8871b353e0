"""Great Expectations, started once per process: its context, data source and suites.

GX takes seconds to import and start, so it is imported lazily, once per process, in a
background thread while the first batch is read.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from dataclasses import dataclass
from functools import cache

from pipelines.quality.expectations import captures, episodes, steps
from pipelines.quality.validate.stored import suite_name


@dataclass(frozen=True)
class Runtime:
    batch_definitions: dict  # table -> GX BatchDefinition over a dataframe asset
    suites: dict  # table -> GX ExpectationSuite


# Held while the runtime is built and while a batch is validated: GX's context is not
# documented as thread-safe, and Prefect may run tasks in threads.
GX_LOCK = threading.RLock()


def warm_up_in_background() -> None:
    """Start GX while the caller reads and prepares batches: GX's import is Python code
    (holding the GIL) while Parquet reads and pyarrow kernels release it, so they overlap."""
    global _WARMING
    with _WARMING_LOCK:
        if _WARMING is not None:
            return

        def run() -> None:
            # Only the import and the context: a dry run here would stand in the caller's way
            # (it waits for the lock), where its first real run pays the same once.
            with contextlib.suppress(Exception), GX_LOCK:  # the caller's GX call raises it
                runtime()

        _WARMING = threading.Thread(target=run, name="gx-warm-up", daemon=True)
        _WARMING.start()


_WARMING: threading.Thread | None = None
_WARMING_LOCK = threading.Lock()


@cache
def runtime() -> Runtime:  # called with GX_LOCK held
    """GX context, data source and suites: built once per process (GX starts slowly)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("realloop")
    batch_definitions, built = {}, {}
    for table, expectations in suites().items():
        asset = source.add_dataframe_asset(table)
        batch_definitions[table] = asset.add_batch_definition_whole_dataframe(table)
        suite = gx.ExpectationSuite(name=suite_name(table))
        for expectation in expectations:
            suite.add_expectation(expectation)
        built[table] = context.suites.add(suite)
    # GX's import leaves millions of long-lived objects. Freezing them keeps the cyclic
    # garbage collector from walking them again in every later full collection, including
    # the one at interpreter exit, which otherwise takes about 2 s. Frozen objects are still
    # freed by reference counting; only cycles among them would outlive the process.
    gc.freeze()
    return Runtime(batch_definitions, built)


def suites() -> dict[str, list]:
    """Every suite's expectations, by table name (imports GX: seconds)."""
    return {
        "episodes": episodes.expectations(),
        "steps": steps.expectations(),
        "captures": captures.expectations(),
    }
