"""A dataset version's report and Data Docs, laid out as a GX Data Docs site so that every
link of GX's pages (Home, the suite, the logo) resolves, offline:

<validation>/<dataset_version>/report.json        every batch, admissions applied
<validation>/<dataset_version>/index.html         the index: every batch, its verdict, its pages
<validation>/<dataset_version>/validations/<suite>/<run_name>/<run_time>/<batch>.html
                                                  GX's page of one suite over one batch
<validation>/<dataset_version>/expectations/<suite>.html   GX's page of each suite
<validation>/<dataset_version>/static/images/     GX's logo and favicon

GX's own SiteBuilder (`context.build_data_docs`) would render every result of its store again
for each site, starting GX even when every result is stored. Here each page is rendered once,
when GX validates the batch (or, for a suite, under a new suite fingerprint), stored with the
batch, and hard-linked into each version's site at the path GX's SiteBuilder would give it, so
a version whose batches are all stored is written without GX. Run names say what was
validated: the dataset version the batch was first validated in, and the batch.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import replace
from datetime import UTC, datetime
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import quote

from pipelines.quality.validate.offline import CSS, offline_page
from pipelines.quality.validate.results import ValidationReport
from pipelines.quality.validate.stored import (
    SUITES,
    batch_folder,
    suite_name,
    suite_pages_folder,
    write_atomically,
)

VALIDATIONS_ROOT = "../../../../"  # from validations/<suite>/<run_name>/<run_time>/<batch>.html
SUITE_ROOT = "../"  # from expectations/<suite>.html
STATIC_IMAGES = ("favicon.ico", "logo-long.png")  # what GX's pages show from static/images


def run_identity(dataset_version: str, batch: str) -> dict[str, str]:
    """GX's run id of a batch's validation: a name saying what was validated, and when."""
    version = dataset_version if len(dataset_version) <= 16 else dataset_version[:12]
    return {
        "run_name": f"dataset-{version}_batch-{batch[:12]}",
        "run_time": datetime.now(UTC).isoformat(),
    }


def site_page(table: str, run: dict, batch: str) -> str:
    """Where GX's SiteBuilder puts a validation result's page, relative to the site root."""
    run_time = datetime.fromisoformat(run["run_time"]).astimezone(UTC)
    return "/".join(
        (
            "validations",
            suite_name(table),
            run["run_name"],
            run_time.strftime("%Y%m%dT%H%M%S.%fZ"),  # RunIdentifier.to_tuple()'s format
            f"{batch}.html",
        )
    )


def render_pages(gx_results: dict) -> dict[str, str]:
    """GX's own Data Docs page (HTML) for each suite's validation result (its meta names the
    run: `run_identity`)."""
    from great_expectations.core.expectation_validation_result import (
        expectationSuiteValidationResultSchema,
    )
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    renderer, view = ValidationResultsPageRenderer(), DefaultJinjaPageView()
    pages = {}
    for table, result in gx_results.items():
        loaded = expectationSuiteValidationResultSchema.load(json.loads(json.dumps(result)))
        # No how-to buttons: their walkthrough needs GX's online assets.
        page = view.render(renderer.render(loaded), show_how_to_buttons=False)
        pages[table] = offline_page(page, VALIDATIONS_ROOT)
    return pages


def render_suite_pages(suites: dict) -> dict[str, str]:
    """GX's page of each expectation suite (`suites`: table -> GX ExpectationSuite)."""
    from great_expectations.render.renderer import ExpectationSuitePageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    renderer, view = ExpectationSuitePageRenderer(), DefaultJinjaPageView()
    return {
        table: offline_page(
            view.render(renderer.render(suite), show_how_to_buttons=False), SUITE_ROOT
        )
        for table, suite in suites.items()
    }


def write_version(
    dataset: Path, folder: Path, report: ValidationReport, fingerprint: str
) -> ValidationReport:
    """report.json and the Data Docs site of one dataset version; each stored page is linked
    into the site, so that the folder stands on its own."""
    links = _link_site(dataset, folder, report, fingerprint)
    report = replace(
        report, results=str(folder / "report.json"), data_docs=str(folder / "index.html")
    )
    summary = report.as_dict() | {
        # Relative to this folder, like every link in it: the workspace may move.
        "results": "report.json",
        "data_docs": "index.html",
        "suites": fingerprint,
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "suite_pages": {
            suite_name(t): f"expectations/{suite_name(t)}.html"
            for t in SUITES
            if (folder / "expectations" / f"{suite_name(t)}.html").is_file()
        },
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


def _link_site(
    dataset: Path, folder: Path, report: ValidationReport, fingerprint: str
) -> dict[str, dict[str, str]]:
    """Link the stored pages into the site at GX's paths; return each batch's, by table.
    Pages of earlier runs (a batch validated again under new suites) are removed."""
    links: dict[str, dict[str, str]] = {}
    for result in report.batches:
        run = result.details.get("gx_run")
        for table in SUITES if run else ():
            source = batch_folder(dataset, result.batch, fingerprint) / f"{table}.html"
            if source.is_file():
                path = site_page(table, run, result.batch)
                _link(source, folder / path)
                links.setdefault(result.batch, {})[table] = path
    wanted = {folder / p for pages in links.values() for p in pages.values()}
    for page in (folder / "validations").rglob("*.html"):
        if page not in wanted:
            page.unlink(missing_ok=True)
    for table in SUITES:
        source = suite_pages_folder(dataset, fingerprint) / f"{suite_name(table)}.html"
        if source.is_file():
            _link(source, folder / "expectations" / source.name)
    static = Path(find_spec("great_expectations").submodule_search_locations[0])
    for image in STATIC_IMAGES:  # found without importing GX (seconds)
        _link(static / "render/view/static/images" / image, folder / "static/images" / image)
    return links


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
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
        docs = " ".join(f'<a href="{esc(quote(p))}">{esc(t)}</a>' for t, p in b["pages"].items())
        if b.get("gx_run"):
            docs += f"<br><small>run {esc(b['gx_run']['run_name'])}</small>"
        rows.append(
            f"<tr><td><code title='{esc(b['batch'])}'>{esc(b['batch'][:12])}</code><br>"
            f"<small>{esc(str(b.get('source_uri') or ''))}</small></td>"
            f"<td style='color:{status[1]}'><b>{status[0]}</b></td>"
            f"<td>{b.get('episodes', '')}</td><td>{b.get('steps', '')}</td>"
            f"<td><ul>{''.join(notes)}</ul></td><td>{docs}</td></tr>"
        )
    excluded, version = len(summary["excluded_from_training"]), esc(str(summary["dataset_version"]))
    suites = ", ".join(
        f'<a href="{esc(quote(p))}">{esc(name)}</a>' for name, p in summary["suite_pages"].items()
    )
    # GX's navigation bar and the stylesheet its pages get offline, so that the site reads as one.
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>realloop validation {version}</title>
<link rel="shortcut icon" href="static/images/favicon.ico" type="image/x-icon">
<style>{CSS}</style><style>ul{{margin:0;padding-left:1.2em}}.critical{{color:#c53030}}
.warning{{color:#b7791f}}main{{padding:1rem 2rem}}</style></head><body>
<nav class="navbar sticky-top"><a href="index.html"><img src="static/images/logo-long.png"
alt="Great Expectations"></a><ol class="breadcrumb"><li class="breadcrumb-item">
<a href="index.html">Home</a></li><li class="breadcrumb-item">Dataset {version}</li></ol></nav>
<main><h3>Validation of dataset {version}</h3>
<p>{summary["batches"]} batches: {summary["passed"]} passed every critical expectation,
{excluded} excluded from training, {len(summary["admitted"])} re-admitted,
{len(summary["warnings"])} with warnings. Suites {esc(summary["suites"])},
written {esc(summary["written_at"])}. Machine-readable: <a href="report.json">report.json</a>.
Each batch links to Great Expectations' Data Docs page of every suite; the suites: {suites}.</p>
<table class="table"><tr><th>batch</th><th>status</th><th>episodes</th><th>steps</th>
<th>critical failures and warnings</th><th>Data Docs</th></tr>
{"".join(rows)}
</table></main></body></html>
"""
