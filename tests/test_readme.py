"""Every README figure is filled in from a committed result file by scripts/readme_figures.py, and
the README says nothing its tree contradicts."""

from __future__ import annotations

import re

import pytest

from scripts import readme_figures
from tests.conftest import REPO


def test_readme_figures_equal_their_result_files():
    text = readme_figures.README.read_text(encoding="utf-8")
    assert readme_figures.render(text) == text, "run python scripts/readme_figures.py"


def test_every_renderer_has_a_block_and_every_block_a_renderer():
    text = readme_figures.README.read_text(encoding="utf-8")
    assert sorted(m["name"] for m in readme_figures.BLOCK.finditer(text)) == sorted(readme_figures.RENDERERS)


def test_an_edited_figure_is_caught():
    text = readme_figures.README.read_text(encoding="utf-8")
    block = next(readme_figures.BLOCK.finditer(text))
    edited = text[: block.end() - 20] + "9" + text[block.end() - 20 :]
    assert readme_figures.render(edited) != edited


def test_a_block_without_renderer_is_refused():
    with pytest.raises(SystemExit, match="no renderer"):
        readme_figures.render("<!-- figures: nothing -->\nx\n<!-- /figures -->\n")


def test_every_path_the_readme_names_exists():
    text = readme_figures.README.read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:tasks|flows|ortforge|tests|benchmarks|scripts)/[\w/]+\.(?:py|json|md|png))`", text))
    assert named and [p for p in sorted(named) if not (REPO / p).exists()] == []
