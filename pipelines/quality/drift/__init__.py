"""Drift: the data that trained the production model against the data the line sent since,
and the retraining trigger (`report` says what is compared; docs/drift.md)."""

from pipelines.quality.drift.features import compare, extract_features
from pipelines.quality.drift.measures import (
    PSI_FLOOR,
    category_counts,
    describe_measures,
    jensen_shannon,
    kolmogorov_smirnov,
    novel_share,
    population_stability_index,
)
from pipelines.quality.drift.report import (
    REPORT_FILE,
    detect_drift,
    drift_report,
    plot_feature,
    retraining_trigger,
)

__all__ = [
    "PSI_FLOOR",
    "REPORT_FILE",
    "category_counts",
    "compare",
    "describe_measures",
    "detect_drift",
    "drift_report",
    "extract_features",
    "jensen_shannon",
    "kolmogorov_smirnov",
    "novel_share",
    "plot_feature",
    "population_stability_index",
    "retraining_trigger",
]
