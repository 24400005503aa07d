"""The README's and docs/ pages' relative links lead somewhere: every linked file exists and
every ``#anchor`` names a heading of its page (GitHub's slugs). No network, no rendering."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^#{1,6} ", line):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


def test_the_readme_links_the_docs_pages():
    linked = {(ROOT / t.split("#")[0]).resolve() for t in _links(ROOT / "README.md") if t.startswith("docs/")}
    assert len(linked) >= 5, linked
    assert all(p.is_file() for p in linked), [str(p) for p in linked if not p.is_file()]


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_slugs_are_githubs():
    assert _slug(" Backends: CUDA, C++ and Triton") == "backends-cuda-c-and-triton"
    assert _slug(" `stream` settings") == "stream-settings"
