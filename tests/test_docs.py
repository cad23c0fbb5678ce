"""The README and docs/ say only what exists: links, anchors, make targets, commands and file names.

A doc that names a target, module or file that was renamed keeps reading as true; these tests make it fail
instead. The source cites docs sections (`docs/decoding.md#caches`) instead of documents that do not ship
(a spec, issues), and those citations must resolve too.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
README_MAX_LINES = 200

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
DOC_CITATION = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")
MAKE = re.compile(r"(?:`|^)make ([a-z][\w-]*)", re.M)  # in backticks or at the start of a code line
PYTHON_M = re.compile(r"python -m (looplab(?:\.\w+)*)")
PATH = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|yaml|md|ipynb|json|toml|txt))`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(text):
        s = slug(title)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))
    tables = re.search(r"^TABLES\s*:=\s*(.*)$", text, re.M).group(1).split()
    return targets | {f"table{n}{suffix}" for n in tables for suffix in ("", "-report", "-plan")}


def test_readme_is_an_entry_point():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    for page in DOCS:
        assert f"docs/{page.name}" in (ROOT / "README.md").read_text(), f"README.md does not point to docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page):
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_shown_exist(page):
    text = page.read_text()
    targets = make_targets()
    missing = [f"make {t}" for t in MAKE.findall(text) if t.replace("tableN", "table1") not in targets]
    for module in set(PYTHON_M.findall(text)):
        if importlib.util.find_spec(module) is None:
            missing.append(f"python -m {module}")
    assert not missing, f"{page.name} shows commands that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_file_names_shown_exist(page):
    """A backticked file name exists under the repo root, src/looplab/ or tests/ (module lists go stale)."""
    bases = [ROOT, ROOT / "src", ROOT / "src" / "looplab", ROOT / "src" / "looplab" / "models",
             ROOT / "src" / "looplab" / "remote_code", ROOT / "tests"]
    missing = [p for p in set(PATH.findall(page.read_text()))
               if not any((b / p).exists() for b in bases) and not p.startswith(("outputs/", "bench/", "RUN/"))
               and p not in {"results.json", "eval.json", "gpu-check.json", "findings.json", "config.json",
                             "tokenizer_config.json", "generation_config.json", "runner.json", "attempts.json", "zeroshot.json", "meta.pt",
                             "sequential.json", "alpha_ledger.json"}]
    assert not missing, f"{page.name} names files that do not exist: {sorted(missing)}"


def test_source_cites_only_docs_that_exist():
    bad = []
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.yaml"), *(ROOT / "conf").rglob("*.yaml")]:
        for name, anchor in DOC_CITATION.findall(path.read_text()):
            page = ROOT / "docs" / name
            if not page.exists() or (anchor and anchor not in anchors(page)):
                bad.append(f"{path.relative_to(ROOT)}: docs/{name}{'#' + anchor if anchor else ''}")
    assert not bad, "citations of docs sections that do not exist: " + "; ".join(bad)


def test_source_cites_no_unshipped_documents():
    """Neither the design spec nor the issue tracker ships with the project: say what a thing is instead."""
    pattern = re.compile(r"SPEC ?§|\b[Ii]ssues? ?#?\d+")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.yaml"),
                                                  *(ROOT / "conf").rglob("*.yaml"), *(ROOT / "tests").rglob("*.py")]
            if p.name != "test_docs.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, f"cites the spec or an issue: {hits}"
