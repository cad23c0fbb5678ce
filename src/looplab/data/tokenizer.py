"""Tokenizers for language modelling, rebuilt from one string (the spec).

A spec is stored in the dataset config, and that config inside every
checkpoint, so `load_tokenizer(spec)` must give back exactly the tokenizer a
run was trained with:

    "shakespeare-bpe-4096"      byte-level BPE shipped in looplab/assets/ (no network)
    "/path/to/tokenizer.json"   any `tokenizers` JSON file
    "/path/to/folder"           its tokenizer.json, e.g. a converted model's folder
                                (python -m looplab.convert from-hf); eos from its tokenizer_config.json
    "EleutherAI/gpt-neox-20b"   a Hugging Face hub tokenizer (paper runs; needs the
                                network once, then the hub cache; HF_HUB_OFFLINE=1 works)

The embedded tokenizer was trained by `train_bpe` on the training documents of
the embedded corpus (`python -m looplab.data.tokenizer`); it is committed, not
retrained on the fly, because BPE merges tie-break on counts and a retrained
file is not guaranteed to match the one a checkpoint saw. `LMTokenizer.hash`
(sha256 of the serialised tokenizer) keys every token cache, so a changed
tokenizer can never reuse tokens made by another.
"""

from __future__ import annotations

import hashlib
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
EMBEDDED_DEFAULT = "shakespeare-bpe-4096"


class LMTokenizer:
    """A `tokenizers.Tokenizer` plus what the data and eval code need: spec, hash, eos."""

    def __init__(self, tok: Tokenizer, spec: str, eos_token: str | None = None):
        self.tok = tok
        self.spec = spec
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        names = (eos_token,) if eos_token else EOS_CANDIDATES
        ids = [tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids) if i is not None]
        if not found:
            raise ValueError(f"tokenizer {spec!r} has none of the end-of-text tokens {names}; name one with eos_token=...")
        self.eos_token, self.eos_id = found[0]
        self.hash = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
        self.identity = tokenizer_identity(tok)


    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"LMTokenizer(spec={self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, hash={self.hash})"


def tokenizer_identity(tok: Tokenizer) -> str:
    """Which id each token has: sha256 of the vocabulary (added tokens included) and the BPE merges, 16 hex digits.
    Unlike `hash` (the whole serialisation, which keys token caches) it does not change with how a `tokenizers`
    release writes the file. Recorded by every run (dataset `_tokenizer_identity`) and checked on resume=,
    init_from=, eval, generate and the lm-eval adapter: a tokenizer with the same size but other ids is refused."""
    import json

    model = json.loads(tok.to_str()).get("model") or {}
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges") or []]
    blob = json.dumps([sorted(tok.get_vocab(with_added_tokens=True).items()), merges], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class TokenizerMismatchError(ValueError):
    """The tokenizer found now gives other ids than the one a model was trained with."""


def check_identity(recorded: str | None, found: str | None, spec, source: str) -> None:
    """Refuse a tokenizer whose identity differs from the one recorded (a record without one is an older run)."""
    if recorded and found and recorded != found:
        raise TokenizerMismatchError(
            f"{source} was trained with tokenizer identity {recorded}, but tokenizer {spec!r} now has identity {found} "
            "(other token ids, even if the vocabulary size is the same); use the tokenizer the model was trained with")


def load_tokenizer(spec: str | dict, eos_token: str | None = None) -> LMTokenizer:
    """Spec → tokenizer. A dict is a dataset config (its `tokenizer` and `eos_token` keys are used, and a recorded
    `_tokenizer_identity` is checked against the tokenizer found)."""
    recorded = None
    if isinstance(spec, dict) or hasattr(spec, "get"):  # dict or OmegaConf DictConfig
        eos_token = eos_token or spec.get("eos_token")
        recorded = spec.get("_tokenizer_identity")
        spec = spec.get("tokenizer")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tokenizer spec {spec!r} must be a non-empty string (an asset name, a tokenizer.json path or a hub name)")
    tok = _load(spec, eos_token)
    check_identity(recorded, tok.identity, spec, "the model")
    return tok


@lru_cache(maxsize=8)
def _load(spec: str, eos_token: str | None) -> LMTokenizer:
    asset = ASSETS / f"{spec}.json"
    if asset.is_file():
        return LMTokenizer(Tokenizer.from_file(str(asset)), spec, eos_token)
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer folder {spec!r} has no tokenizer.json")
        return LMTokenizer(Tokenizer.from_file(str(path / "tokenizer.json")), spec, eos_token or folder_eos_token(path))
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {spec!r} does not exist (known assets: {available_assets()})")
        return LMTokenizer(Tokenizer.from_file(str(path)), spec, eos_token)
    return LMTokenizer(_from_hub(spec), spec, eos_token)


def folder_eos_token(folder: str | os.PathLike) -> str | None:
    """The end-of-text token named by a transformers folder's tokenizer_config.json, if any."""
    import json

    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return None
    eos = json.loads(path.read_text()).get("eos_token")
    if isinstance(eos, dict):  # an AddedToken written out
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _from_hub(name: str) -> Tokenizer:
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as first:  # repos with only the slow-tokenizer files: let transformers convert them
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name).backend_tokenizer
        except Exception as second:
            raise ValueError(
                f"tokenizer {name!r} is neither a looplab asset ({available_assets()}), a tokenizer.json file, "
                f"nor loadable from the Hugging Face hub ({first}; {second}). Offline, download it once with "
                f"network access or pass a local tokenizer.json"
            ) from second


def available_assets() -> list[str]:
    return sorted(p.stem for p in ASSETS.glob("*.json")) if ASSETS.is_dir() else []


def clear_cache() -> None:
    """Forget loaded tokenizers (after a tokenizer file was rewritten in place)."""
    _load.cache_clear()


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str = "<|endoftext|>") -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation): every byte string is encodable, no <unk>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main(vocab_size: int = 4096) -> None:
    """Retrain the embedded tokenizer on the training documents of the embedded corpus."""
    from looplab.data import corpus

    docs = corpus.documents()
    val = corpus.held_out([n for n, _ in docs], 0.05)
    texts = [t for n, t in docs if n not in val]
    t0 = time.perf_counter()
    tok = train_bpe(texts, vocab_size)
    dt = time.perf_counter() - t0
    out = ASSETS / f"shakespeare-bpe-{vocab_size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    n = sum(len(tok.encode(t).ids) for t in texts)
    chars = sum(len(t) for t in texts)
    print(f"trained {out.name}: vocab {tok.get_vocab_size()}, {dt:.1f} s, {chars} chars -> {n} tokens ({chars / n:.2f} chars/token)")


if __name__ == "__main__":
    import sys

    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
