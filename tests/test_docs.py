"""The README stays a five-minute read and every page it or the site's nav names exists.

The site itself is built with warnings as errors by ``.ci/docs.sh`` (broken links and anchors
fail there); this test keeps the README's side honest without mkdocs installed.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250


def _readme_links() -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())


def test_readme_is_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_every_local_readme_link_exists():
    links = [link for link in _readme_links() if "://" not in link]
    assert links, "the README links to its documentation pages"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert missing == []


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    docs = ROOT / "docs"
    assert [page for page in nav if not (docs / page).exists()] == []
    pages = sorted(str(p.relative_to(docs)) for p in docs.rglob("*.md"))
    assert pages == sorted(nav)


def test_readme_keeps_the_set_up_commands():
    """The set-up lines themselves are run by CI (tests/test_readme.py, .ci/readme.sh)."""
    text = README.read_text()
    assert "pip install torch==2.13.0 --index-url " in text and "pip install -e '.[test]'" in text
    assert "prefix-sharing demo" in text
    test_line = "python -m pytest -q        # the tests (CPU only; CI runs exactly this: .ci/run)"
    assert test_line in text.splitlines()
