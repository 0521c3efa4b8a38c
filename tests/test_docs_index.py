"""``docs/README.md`` indexes every document: each page of ``docs/`` and each result folder is named
there (a folder may be named by a pattern such as ``results/eval-2k-*``), and every link in it leads to
a file that exists."""

import fnmatch
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
INDEX = (DOCS / "README.md").read_text()


def _named_folders() -> list[str]:
    """Every ``results/...`` name or pattern the index mentions."""
    return [m.rstrip("/") for m in re.findall(r"results/[\w*.-]+/?", INDEX)]


def test_every_page_and_result_folder_is_indexed():
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    missing_pages = [p for p in pages if f"]({p})" not in INDEX]
    named = _named_folders()
    folders = sorted(f"results/{p.name}" for p in (DOCS / "results").iterdir() if p.is_dir())
    missing = [f for f in folders if not any(fnmatch.fnmatch(f, pattern) for pattern in named)]
    assert not missing_pages and not missing, f"not in docs/README.md: {missing_pages + missing}"
    assert "LAB.md" in pages and len(folders) > 10  # the walk sees the tree


def test_every_link_of_the_index_exists():
    links = re.findall(r"\]\(([^)#]+)\)", INDEX)
    assert len(links) > 10
    broken = [link for link in links if not (DOCS / link).exists()]
    assert not broken, broken
