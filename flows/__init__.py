"""Prefect flows and the `realloop` command line: thin wiring around pipelines/."""
