"""Every relative link in the README, CONTRIBUTING.md and the pages under docs/ leads somewhere: the file (or
folder) exists, and a `#section` names a heading of the Markdown page it points into."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def prose(text: str) -> str:
    """The page without its code blocks and code spans: their brackets are code, not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", prose(page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_pages_have_links_to_check():
    """The README links to the docs pages, and the link pattern finds those links."""
    assert len(PAGES) > 1 and any(t.startswith("docs/") for t in relative_links(ROOT / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no {path} beside {page.relative_to(ROOT)})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading of {file.relative_to(ROOT)} has the anchor #{anchor})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
