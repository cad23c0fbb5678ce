"""`looplab_tiny`: a zero-shot suite a tiny Shakespeare model can score above chance on (docs/evaluation.md#tiny-suite).

The paper's 8-task hub suite needs a model that has read the web; a few hundred
steps on the embedded corpus leave any model at chance there. This suite asks
questions about the **held-out plays of `lm_tiny`** (the works
`corpus.held_out(names, LM_TINY_VAL_FRACTION)` keeps out of training), so a
model is tested on text it has never seen, in the style it has learnt.

Three multiple-choice tasks, four choices each (chance 1/4), scored by lm-eval
as Σ log p(choice | context):

    looplab_tiny_cloze      the last word of a line, after the speaker's name and up to
                            two earlier lines of the speech; distractors are other
                            line-final words of the held-out plays with the same
                            BPE length, the same capitalisation and the same
                            frequency band (⌊log2 count⌋ in the held-out plays),
                            drawn per occurrence.
    looplab_tiny_next_line  the line that follows up to three lines of a speech, where
                            the line before ends mid-sentence (in a letter, no
                            punctuation); distractors are lines of other speeches
                            of the same play that also follow such a break, with
                            the same BPE length.
    looplab_tiny_speaker    who speaks next, after (the last two lines of) up to
                            three earlier speeches of the scene; choices are the
                            speaker and three other leading speakers of the play
                            (the 8 with most speeches), drawn in proportion to
                            their number of speeches.

The distractors are drawn from the same distribution as the gold answers (per
occurrence, matched in length), so any scorer that ignores the context — word
frequency, length — is at chance in expectation; `unigram_baseline` measures
how far from it a unigram model of the training split really gets.

No item uses training text: every scored line (the cloze line, each next-line
choice) and every context is checked not to occur, whitespace-normalised, as a
substring of the training split.

Regenerate (deterministic: fixed seed, pinned corpus and tokenizer) and check:

    python -m looplab.eval.tiny_suite              # rewrite the shipped jsonl files
    python -m looplab.eval.tiny_suite --check      # exit 1 if they differ from a fresh generation
    python -m looplab.eval.tiny_suite --baseline   # unigram (training-split) baseline per task
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from looplab.data import corpus

LM_TINY_VAL_FRACTION = 0.05  # conf/dataset/lm_tiny.yaml val_fraction (a test keeps them equal)
TOKENIZER = "shakespeare-bpe-4096"  # lm_tiny's tokenizer: lengths are matched in its tokens
SEED = 14
GROUP = "looplab_tiny"
SIZES = {"cloze": 300, "next_line": 300, "speaker": 300}
TASKS = [f"{GROUP}_{k}" for k in SIZES]
N_CHOICES = 4
TASK_DIR = Path(__file__).resolve().parent / "tasks" / GROUP
DELIMITERS = {"cloze": " ", "next_line": "\n", "speaker": "\n\n"}  # lm-eval target_delimiter per task

_HEADER = re.compile(r"([A-Z][A-Z .'\-]*[A-Z])\.(\s*\[.*\])?")
_NOT_SPEAKERS = ("ACT ", "SCENE ", "PROLOGUE", "EPILOGUE", "INDUCTION")
_LAST_WORD = re.compile(r"^(.*\S) ([A-Za-z]{3,})([.,;:!?'\"\-]*)$")
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def norm(s: str) -> str:
    return " ".join(s.split())


@dataclass
class Speech:
    play: str
    scene: int
    speaker: str
    lines: list[str] = field(default_factory=list)


def parse_play(name: str, text: str) -> list[Speech]:
    """Speeches from ACT I on: a block (blank-line separated) opening with `NAME.` starts one; stage
    directions (lines with brackets) are dropped; a block with no name continues the last speech."""
    start = text.find("ACT I.")
    text = text[start if start >= 0 else 0:]
    speeches: list[Speech] = []
    scene = 0
    for block in re.split(r"\n\s*\n", text):
        lines = [norm(l) for l in block.split("\n")]
        lines = [l for l in lines if l]
        if not lines:
            continue
        head = lines[0]
        if head.startswith(_NOT_SPEAKERS):
            if head.startswith("SCENE") or head.startswith("ACT"):
                scene += 1
            continue
        m = _HEADER.fullmatch(head)
        body = [l for l in lines[1:] if "[" not in l and "]" not in l] if m else [l for l in lines if "[" not in l and "]" not in l]
        if m:
            speeches.append(Speech(name, scene, m.group(1), body))
        elif body and speeches and speeches[-1].scene == scene:
            speeches[-1].lines += body
    return [s for s in speeches if s.lines]


def held_out_names() -> list[str]:
    names = [n for n, _ in corpus.documents()]
    return sorted(corpus.held_out(names, LM_TINY_VAL_FRACTION))


@lru_cache(maxsize=1)
def training_text() -> str:
    """The training split, whitespace-normalised line by line (one line per line)."""
    held = set(held_out_names())
    return "\n".join(norm(l) for n, t in corpus.documents() if n not in held for l in t.split("\n"))


class _Fresh:
    """Memoised 'does not occur in the training split' (a substring search, ~1 ms each)."""

    def __init__(self):
        self.train = training_text()
        self.memo: dict[str, bool] = {}

    def __call__(self, s: str) -> bool:
        if s not in self.memo:
            self.memo[s] = s not in self.train
        return self.memo[s]


def _tokenizer():
    from looplab.data.tokenizer import load_tokenizer

    return load_tokenizer(TOKENIZER)


def _item(rng: random.Random, kind: str, idx: int, play: str, context: str, gold: str, distractors: list[str]) -> dict[str, Any]:
    choices = [gold] + distractors
    rng.shuffle(choices)
    return {"id": f"{kind}-{idx:04d}", "play": play, "context": context, "choices": choices, "answer": choices.index(gold)}


def _speech_context(sp: Speech, upto: int, keep: int) -> str:
    return "\n".join([f"{sp.speaker}."] + sp.lines[max(0, upto - keep):upto])


# ------------------------------------------------------------------- tasks
def make_cloze(speeches: list[Speech], n: int, rng: random.Random, fresh: _Fresh, tok) -> list[dict]:
    words = Counter(w.lower() for s in speeches for l in s.lines for w in _WORD.findall(l))
    cands = []  # (speech, line index, head, word)
    for s in speeches:
        for i, l in enumerate(s.lines):
            m = _LAST_WORD.match(l)
            if m and len(l.split()) >= 5:
                cands.append((s, i, m.group(1), m.group(2)))
    ntok = {w: len(tok.encode(" " + w)) for w in {c[3] for c in cands}}

    def key(w: str, band_slack: int = 0):
        return (ntok[w], w[0].isupper(), int(math.log2(words[w.lower()])) // (1 + band_slack))

    pool: dict[tuple, list[str]] = {}
    for slack in (0, 1):
        for c in cands:
            pool.setdefault((slack,) + key(c[3], slack), []).append(c[3])
    order = list(range(len(cands)))
    rng.shuffle(order)
    items = []
    for j in order:
        if len(items) == n:
            break
        s, i, head, word = cands[j]
        if not fresh(s.lines[i]):
            continue
        for slack in (0, 1):  # the exact band first, else a band twice as wide
            group = pool[(slack,) + key(word, slack)]
            picked: list[str] = []
            for _ in range(200):
                w = group[rng.randrange(len(group))]
                if w.lower() != word.lower() and all(w.lower() != p.lower() for p in picked):
                    picked.append(w)
                    if len(picked) == N_CHOICES - 1:
                        break
            if len(picked) == N_CHOICES - 1:
                break
        else:
            continue
        context = _speech_context(s, i, 2) + "\n" + head
        items.append(_item(rng, "cloze", len(items), s.play, context, word, picked))
    return items


def make_next_line(speeches: list[Speech], n: int, rng: random.Random, fresh: _Fresh, tok) -> list[dict]:
    # lines that continue a sentence: the line before ends in a letter (no punctuation), so the
    # break falls inside a clause and the first words of the true line are constrained by the last ones
    cands = [(k, i) for k, s in enumerate(speeches) for i in range(1, len(s.lines))
             if len(s.lines[i].split()) >= 4 and s.lines[i - 1][-1].isalpha()]
    ntok = {(k, i): len(tok.encode("\n" + speeches[k].lines[i])) for k, i in cands}
    by_play: dict[str, list[tuple[int, int]]] = {}
    for c in cands:
        by_play.setdefault(speeches[c[0]].play, []).append(c)
    order = list(range(len(cands)))
    rng.shuffle(order)
    items = []
    for j in order:
        if len(items) == n:
            break
        k, i = cands[j]
        s, gold, t = speeches[k], speeches[k].lines[i], ntok[cands[j]]
        if not fresh(gold):
            continue
        group = [c for c in by_play[s.play] if c[0] != k and ntok[c] == t]
        picked: list[str] = []
        for _ in range(200):
            if not group:
                break
            c = group[rng.randrange(len(group))]
            line = speeches[c[0]].lines[c[1]]
            if line != gold and line not in picked and fresh(line):
                picked.append(line)
                if len(picked) == N_CHOICES - 1:
                    break
        if len(picked) < N_CHOICES - 1:
            continue
        items.append(_item(rng, "next_line", len(items), s.play, _speech_context(s, i, 3), gold, picked))
    return items


def make_speaker(speeches: list[Speech], n: int, rng: random.Random, fresh: _Fresh, top: int = 8) -> list[dict]:
    counts: dict[str, Counter] = {}
    for s in speeches:
        counts.setdefault(s.play, Counter())[s.speaker] += 1
    leading = {p: dict(c.most_common(top)) for p, c in counts.items()}
    cands = [k for k in range(3, len(speeches))
             if speeches[k].speaker in leading[speeches[k].play]
             and all(speeches[k - d].scene == speeches[k].scene and speeches[k - d].play == speeches[k].play for d in (1, 2, 3))]
    order = list(range(len(cands)))
    rng.shuffle(order)
    items = []
    for j in order:
        if len(items) == n:
            break
        k = cands[j]
        s = speeches[k]
        context = "\n\n".join(_speech_context(p, len(p.lines), 2) for p in speeches[k - 3:k])
        if not fresh(context):
            continue
        names, weights = zip(*sorted(leading[s.play].items()))
        picked: list[str] = []
        while len(picked) < N_CHOICES - 1:
            name = rng.choices(names, weights)[0]
            if name != s.speaker and name not in picked:
                picked.append(name)
        items.append(_item(rng, "speaker", len(items), s.play, context, f"{s.speaker}.", [f"{p}." for p in picked]))
    return items


def generate(seed: int = SEED, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """{task name: items}; a pure function of (seed, sizes, the corpus, the tokenizer)."""
    sizes = dict(SIZES if sizes is None else sizes)
    docs = dict(corpus.documents())
    speeches = [sp for name in held_out_names() for sp in parse_play(name, docs[name])]
    fresh, tok = _Fresh(), _tokenizer()
    out = {
        f"{GROUP}_cloze": make_cloze(speeches, sizes["cloze"], random.Random(f"{seed}:cloze"), fresh, tok),
        f"{GROUP}_next_line": make_next_line(speeches, sizes["next_line"], random.Random(f"{seed}:next_line"), fresh, tok),
        f"{GROUP}_speaker": make_speaker(speeches, sizes["speaker"], random.Random(f"{seed}:speaker"), fresh),
    }
    for task, items in out.items():
        short = task[len(GROUP) + 1:]
        if len(items) < sizes[short]:
            raise RuntimeError(f"{task}: only {len(items)} of {sizes[short]} items could be made from the held-out plays")
    return out


def dumps(items: list[dict]) -> str:
    return "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items)


def write(suite: dict[str, list[dict]], folder: Path = TASK_DIR) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for task, items in suite.items():
        p = folder / f"{task}.jsonl"
        p.write_text(dumps(items), encoding="utf-8")
        paths.append(p)
    return paths


def load(folder: Path = TASK_DIR) -> dict[str, list[dict]]:
    """The shipped items."""
    return {t: [json.loads(l) for l in (folder / f"{t}.jsonl").read_text(encoding="utf-8").splitlines()] for t in TASKS}


def chance(task: str, folder: Path = TASK_DIR) -> float | None:
    """Expected accuracy of a uniform guess on a shipped task (None: not a looplab_tiny task)."""
    p = folder / f"{task}.jsonl"
    if not p.exists():
        return None
    items = [json.loads(l) for l in p.read_text(encoding="utf-8").splitlines()]
    return sum(1 / len(it["choices"]) for it in items) / len(items)


# ---------------------------------------------------------------- baseline
def unigram_baseline(suite: dict[str, list[dict]] | None = None, alpha: float = 1.0) -> dict[str, dict[str, float]]:
    """Accuracy of a context-free unigram LM (add-alpha token counts of the training split) scoring each
    choice as lm-eval does (tokens of the continuation, delimiter included): how much length and
    frequency alone give. acc = Σ log p; acc_norm = Σ log p / characters (lm-eval's acc_norm)."""
    import numpy as np

    tok = _tokenizer()
    counts = np.full(tok.vocab_size, alpha)
    for ids in tok.encode_batch([l for l in training_text().split("\n") if l]):
        np.add.at(counts, ids, 1)
    logp = np.log(counts / counts.sum())
    suite = suite or load()
    out = {}
    for task, items in suite.items():
        delim = DELIMITERS[task[len(GROUP) + 1:]]
        acc = acc_norm = 0
        for it in items:
            ctx_ids = tok.encode(it["context"])
            scores = []
            for c in it["choices"]:
                cont = tok.encode(it["context"] + delim + c)[len(ctx_ids):]
                lp = float(logp[cont].sum())
                scores.append((lp, lp / len(delim + c)))
            acc += int(max(range(len(scores)), key=lambda i: scores[i][0]) == it["answer"])
            acc_norm += int(max(range(len(scores)), key=lambda i: scores[i][1]) == it["answer"])
        out[task] = {"acc": acc / len(items), "acc_norm": acc_norm / len(items), "n": len(items),
                     "chance": sum(1 / len(it["choices"]) for it in items) / len(items)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m looplab.eval.tiny_suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare a fresh generation with the shipped files")
    ap.add_argument("--baseline", action="store_true", help="unigram baseline of the shipped items")
    ap.add_argument("--out", type=Path, default=TASK_DIR)
    a = ap.parse_args(argv)
    if a.baseline:
        for task, r in unigram_baseline(load(a.out)).items():
            print(f"{task}: n={r['n']} chance={r['chance']:.3f} unigram acc={r['acc']:.3f} acc_norm={r['acc_norm']:.3f}")
        return 0
    suite = generate()
    if a.check:
        bad = [t for t, items in suite.items() if not (a.out / f"{t}.jsonl").exists()
               or (a.out / f"{t}.jsonl").read_text(encoding="utf-8") != dumps(items)]
        print("up to date" if not bad else f"differ from a fresh generation: {bad}")
        return 1 if bad else 0
    for p in write(suite, a.out):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
