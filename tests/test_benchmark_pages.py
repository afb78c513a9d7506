"""docs/benchmarks.md sums up the topic pages of docs/benchmarks/, which the harnesses write: every page
is linked from it, every link and plot of theirs resolves, and each harness's section sits on one page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "docs" / "benchmarks.md"
PAGES = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) and ![alt](target), anchors dropped


def test_the_summary_links_every_topic_page():
    linked = {(SUMMARY.parent / target).resolve() for target in LINK.findall(SUMMARY.read_text())}
    assert PAGES and not [page.name for page in PAGES if page.resolve() not in linked]


def test_every_link_and_plot_of_the_benchmark_docs_resolves():
    links = [(doc, target) for doc in [SUMMARY, *PAGES] for target in LINK.findall(doc.read_text())]
    links += [(ROOT / "README.md", t) for t in LINK.findall((ROOT / "README.md").read_text()) if "benchmarks" in t]
    broken = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc, target in links
        if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists()
    ]
    assert not broken


def test_each_written_section_is_on_one_page_and_whole():
    """write_section replaces the text between a section's markers where it finds both, else appends it:
    a section on two pages, or the summary, would be updated on one only."""
    starts = [name for doc in [SUMMARY, *PAGES] for name in re.findall(r"<!-- (\S+):start -->", doc.read_text())]
    assert starts and len(starts) == len(set(starts))
    for page in PAGES:
        text = page.read_text()
        for name in re.findall(r"<!-- (\S+):start -->", text):
            assert text.index(f"<!-- {name}:start -->") < text.index(f"<!-- {name}:end -->"), (page.name, name)
