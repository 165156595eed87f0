"""The HTML report is one self-contained page (no script, no link, nothing fetched), and in a real
headless Chromium its table and every plot render with a visible size."""

from __future__ import annotations

import re

import pytest

from tasks import report
from tasks.core.params import ReportConfig, TasksConfig
from tests.browser import evaluate, find_browser, open_page
from tests.test_report import FIGURES, fake_reports, report_outputs

WHAT_A_PERSON_SEES = """{
  title: document.title,
  rows: document.querySelector('table').querySelectorAll('tr').length,  // the variants' table
  table: (() => { const r = document.querySelector('table').getBoundingClientRect(); return [r.width, r.height]; })(),
  images: [...document.images].map(i => ({
    decoded: i.complete && i.naturalWidth > 0,
    size: [i.getBoundingClientRect().width, i.getBoundingClientRect().height],
    caption: i.alt,
  })),
}"""


@pytest.fixture
def html_report(tmp_path):
    fake_reports(tmp_path / "variants")
    paths = report_outputs(tmp_path)
    report.run("tiny", list(FIGURES), ReportConfig(), TasksConfig(), tmp_path / "variants", paths)
    return paths["html"]


def test_page_is_self_contained(html_report):
    page = html_report.read_text(encoding="utf-8")
    assert "<script" not in page and "<link" not in page
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)  # every resource is embedded
    assert page.count('src="data:image/png;base64,') == 3  # trade-off, latency, under load
    assert "<table>" in page and "<td>int4</td>" in page


def test_table_and_every_plot_are_visible_in_chromium(html_report, tmp_path):
    browser = find_browser()
    if browser is None:
        pytest.skip("no Chromium: scripts/test.sh installs Debian's chromium package where apt-get is available")
    with open_page(browser, html_report, tmp_path / "profile") as page:
        seen = evaluate(page, WHAT_A_PERSON_SEES)
    assert seen["title"] == "ortforge: tiny"
    assert seen["rows"] == 1 + len(FIGURES) + 1  # header, variants, PyTorch baseline
    assert min(seen["table"]) > 50
    assert len(seen["images"]) == 3
    for image in seen["images"]:
        assert image["decoded"] and min(image["size"]) > 200, image
