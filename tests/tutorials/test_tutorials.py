"""The tutorials under docs/tutorials run as written: each page's ```python blocks in order, in one namespace, from
the repository root. A block that raises fails its page's test with the block's number and text. They load the
embedded models and run small studies (minutes), so they are a step of their own in `.ci/run`
(``MECHDIFF_TUTORIALS=1 python -m pytest tests/tutorials``) and the README's test command skips them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("MECHDIFF_TUTORIALS") != "1",
    reason="the tutorials are a step of their own: MECHDIFF_TUTORIALS=1 python -m pytest tests/tutorials",
)

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    """The page's ```python blocks, in order."""
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def test_each_page_has_blocks_to_run():
    assert PAGES and all(python_blocks(p) for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_tutorial_runs(page, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": f"tutorial_{page.stem}"}
    for i, block in enumerate(python_blocks(page), 1):
        try:
            exec(compile(block, f"{page.name}, block {i}", "exec"), namespace)  # noqa: S102 - the page's own code
        except Exception as err:
            raise AssertionError(f"{page.name}, block {i} failed: {err!r}\n{block}") from err
