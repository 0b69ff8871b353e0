"""A dataset version's Data Docs stand on their own: every local link of every page resolves
inside the version's folder (also once the folder is moved), no page needs the network to be
read, and every run is named after what was validated."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pipelines.quality.validate import validation_root
from tests.pipelines.test_validate import BAD, GOOD, validated  # noqa: F401 (a fixture)

# What a browser fetches to show a page; an <a> to a web site is only a link to follow.
RESOURCE_TAGS = {"link", "script", "img", "iframe", "embed", "source", "object"}


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str]] = []  # (tag, url)
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(found["id"])
        for name in ("href", "src"):
            if found.get(name):
                self.refs.append((tag, found[name]))


def _parse(page: Path) -> _Refs:
    parser = _Refs()
    parser.feed(page.read_text())
    return parser


def broken_links(site: Path) -> list[str]:
    """`page: url (why)` for each local link that does not resolve inside `site`, and each
    resource a page would fetch from the network."""
    broken, site = [], site.resolve()
    for page in sorted(site.rglob("*.html")):
        for tag, url in _parse(page).refs:
            parts = urlsplit(url)
            where = f"{page.relative_to(site)}: {url}"
            if parts.scheme in ("http", "https") or url.startswith("//"):
                if tag in RESOURCE_TAGS:
                    broken.append(f"{where} (needs the network)")
                continue
            if parts.scheme:  # mailto:, javascript:, data:
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not target.is_relative_to(site):
                broken.append(f"{where} (outside the site)")
            elif not target.is_file():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and parts.fragment not in _parse(target).ids:
                broken.append(f"{where} (no such anchor)")
    return broken


def test_every_link_of_the_data_docs_resolves_offline(validated, tmp_path):  # noqa: F811
    dataset, report = validated
    site = validation_root(dataset) / "unversioned"
    assert report.data_docs == str(site / "index.html")
    moved = shutil.copytree(site, tmp_path / "moved")  # the workspace may move
    pages = sorted(moved.rglob("*.html"))
    # The index, 3 suites x 2 batches, and the page of each suite.
    assert len(pages) == 1 + 6 + 3, [str(p.relative_to(moved)) for p in pages]
    assert broken_links(moved) == []

    index = _parse(moved / "index.html")
    linked = {unquote(url) for _, url in index.refs}
    assert {f"expectations/realloop-{t}.html" for t in ("episodes", "steps", "captures")} <= linked
    stored = json.loads((moved / "report.json").read_text())
    failing = moved / stored["batch_results"][1]["pages"]["steps"]
    assert failing.parts[-5:-3] == ("validations", "realloop-steps")  # GX's site layout
    assert failing.name == f"{BAD}.html" and failing.parent.parent.name.endswith(BAD[:12])
    text = failing.read_text()
    assert "[critical] within an episode, time_s strictly increases" in text
    assert "Data asset: steps" in " ".join(re.sub(r"<[^>]+>", " ", text).split())
    # GX's own links of a suite page: Home and the suite.
    refs = {url for _, url in _parse(failing).refs}
    assert {"../../../../index.html", "../../../../expectations/realloop-steps.html"} <= refs
    for page in pages:
        assert "__none__" not in page.read_text(), page
    for written in (p for p in moved.rglob("*") if p.suffix in (".html", ".json")):
        assert str(dataset.parent) not in written.read_text(), f"{written}: an absolute path"
    for batch in (GOOD, BAD):
        page = moved / stored["batch_results"][batch == BAD]["pages"]["episodes"]
        assert f"dataset-unversioned_batch-{batch[:12]}" in page.read_text()


def test_the_link_check_finds_what_is_broken(tmp_path):
    (tmp_path / "static").mkdir()
    (tmp_path / "static" / "a.css").write_text("")
    (tmp_path / "index.html").write_text(
        '<link rel="stylesheet" href="static/a.css"><a id="top" href="#top">top</a>'
        '<a href="https://greatexpectations.io">GX</a>'  # a link to follow: fine
        '<script src="https://cdn.example/x.js"></script><img src="missing.png">'
        '<a href="../outside.html">up</a><a href="index.html#nowhere">x</a>'
    )
    assert broken_links(tmp_path) == [
        "index.html: https://cdn.example/x.js (needs the network)",
        "index.html: missing.png (no such file)",
        "index.html: ../outside.html (outside the site)",
        "index.html: index.html#nowhere (no such anchor)",
    ]
