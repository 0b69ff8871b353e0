"""A dataset version's report and Data Docs: GX's page per suite and batch, linked into

<dataset>/../validation/<dataset_version>/report.json   every batch, admissions applied
<dataset>/../validation/<dataset_version>/index.html    the index, links to pages/
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from pipelines.quality.validate.results import ValidationReport
from pipelines.quality.validate.stored import SUITES, batch_folder, write_atomically


def render_pages(gx_results: dict) -> dict[str, str]:
    """GX's own Data Docs page (HTML) for each suite's validation result."""
    from great_expectations.core.expectation_validation_result import (
        expectationSuiteValidationResultSchema,
    )
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    renderer, view = ValidationResultsPageRenderer(), DefaultJinjaPageView()
    pages = {}
    for table, result in gx_results.items():
        loaded = expectationSuiteValidationResultSchema.load(json.loads(json.dumps(result)))
        pages[table] = view.render(renderer.render(loaded))
    return pages


def write_version(
    dataset: Path, folder: Path, report: ValidationReport, fingerprint: str
) -> ValidationReport:
    """report.json and the Data Docs index of one dataset version; each batch's pages are
    linked into `pages/` so that the folder stands on its own."""
    pages = folder / "pages"
    pages.mkdir(parents=True, exist_ok=True)
    links: dict[str, dict[str, str]] = {}
    for result in report.batches:
        for table in SUITES:
            source = batch_folder(dataset, result.batch, fingerprint) / f"{table}.html"
            if source.is_file():
                name = f"{result.batch}.{table}.html"
                _link(source, pages / name)
                links.setdefault(result.batch, {})[table] = f"pages/{name}"
    report = replace(
        report, results=str(folder / "report.json"), data_docs=str(folder / "index.html")
    )
    summary = report.as_dict() | {
        "suites": fingerprint,
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "batch_results": [
            {
                "batch": b.batch,
                "passed": b.passed,
                "trainable": b.trainable,
                "failures": b.failures,
                "warnings": b.warnings,
                "admitted": b.admitted,
                "expectations": b.expectations,
                **b.details,
                "pages": links.get(b.batch, {}),
            }
            for b in report.batches
        ],
    }
    write_atomically(folder / "report.json", json.dumps(summary, indent=1))
    write_atomically(folder / "index.html", _index_html(summary))
    return report


def _link(source: Path, target: Path) -> None:
    if target.exists() and os.path.samefile(source, target):
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # another filesystem: copy
        tmp.write_bytes(source.read_bytes())
    os.replace(tmp, target)


def _index_html(summary: dict) -> str:
    esc = html.escape
    rows = []
    for b in summary["batch_results"]:
        if not b["passed"]:
            status = ("admitted", "#b7791f") if b["admitted"] else ("EXCLUDED", "#c53030")
        else:
            status = ("passed, warnings", "#b7791f") if b["warnings"] else ("passed", "#2f855a")
        notes = [f"<li class=critical>{esc(f)}</li>" for f in b["failures"]]
        notes += [f"<li class=warning>{esc(w)}</li>" for w in b["warnings"]]
        if b["admitted"]:
            a = b["admitted"]
            notes.append(
                f"<li>admitted by {esc(str(a['by']))} at {esc(str(a['at']))}: "
                f"{esc(str(a['reason']))}</li>"
            )
        docs = " ".join(f'<a href="{esc(p)}">{esc(t)}</a>' for t, p in b["pages"].items())
        rows.append(
            f"<tr><td><code title='{esc(b['batch'])}'>{esc(b['batch'][:12])}</code><br>"
            f"<small>{esc(str(b.get('source_uri') or ''))}</small></td>"
            f"<td style='color:{status[1]}'><b>{status[0]}</b></td>"
            f"<td>{b.get('episodes', '')}</td><td>{b.get('steps', '')}</td>"
            f"<td><ul>{''.join(notes)}</ul></td><td>{docs}</td></tr>"
        )
    excluded, version = len(summary["excluded_from_training"]), esc(str(summary["dataset_version"]))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>realloop validation {version}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border-bottom:1px solid #ddd;padding:4px 8px;
vertical-align:top;text-align:left}}table{{border-collapse:collapse}}ul{{margin:0;padding-left:1.2em}}
.critical{{color:#c53030}}.warning{{color:#b7791f}}</style></head><body>
<h1>Validation of dataset {version}</h1>
<p>{summary["batches"]} batches: {summary["passed"]} passed every critical expectation,
{excluded} excluded from training, {len(summary["admitted"])} re-admitted,
{len(summary["warnings"])} with warnings. Suites {esc(summary["suites"])},
written {esc(summary["written_at"])}. Machine-readable: <a href="report.json">report.json</a>.
Each batch links to Great Expectations' Data Docs page of every suite.</p>
<table><tr><th>batch</th><th>status</th><th>episodes</th><th>steps</th>
<th>critical failures and warnings</th><th>Data Docs</th></tr>
{"".join(rows)}
</table></body></html>
"""
