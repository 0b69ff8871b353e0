"""A reference cell as a separate process (`realloop cell run`): its edge box follows the
channel, it records production shifts and uploads closed logs to the landing zone, and it runs
hardware trials on request. docs/operations.md ("The cell contract") is what it implements."""

from refcell.process.cell_process import CellProcess, CellRunConfig, log_to_stderr

__all__ = ["CellProcess", "CellRunConfig", "log_to_stderr"]
