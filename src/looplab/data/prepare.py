"""Text → packed token files: `python -m looplab.data.prepare dataset=lm_tiny`.

Every document is tokenised (`datasets.map`, batched, `num_proc` workers),
followed by one EOS token, and the splits are written as flat uint16 (vocab ≤
65536) or uint32 arrays read back as numpy memmaps. Next to each `<split>.bin`
a `<split>.json` manifest records what produced it:

    version, split, source, source_fingerprint, tokenizer, tokenizer_hash,
    vocab_size, eos_id, dtype, num_tokens, num_docs, sha256, seconds, tokens_per_s

The cache folder is named by a hash of (format version, source fingerprint,
tokenizer hash, split settings), so a changed tokenizer or a changed source
lands in a new folder and never reuses old tokens; loading re-checks the
manifest against what is expected, and the file size against num_tokens ×
itemsize (a truncated copy), and the checksum (a corrupted one) for files up to
`CHECKSUM_LIMIT`. Files are written under temporary names and renamed, the
manifest last, so an interrupted run leaves no folder that looks finished.

Sources (`source` field of the dataset config):
    "shakespeare"                         the embedded corpus (looplab.data.corpus)
    "json" | "text" | "parquet" | "csv"   local files given by `data_files`
    any other string                      a Hugging Face hub dataset (e.g. the Pile),
                                          optionally `streaming: true`
Local files are fingerprinted by content; a hub dataset by name, subset,
revision and — when downloaded — the fingerprint `datasets` gives its cache.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from looplab.data import corpus
from looplab.data.tokenizer import LMTokenizer, load_tokenizer

FORMAT_VERSION = 1
LOCAL_BUILDERS = ("json", "text", "parquet", "csv")
CHECKSUM_LIMIT = 256 * 2**20  # bytes; larger files are checked by size only (hashing the Pile takes minutes)
SPLITS = ("train", "validation")


class TokenCacheError(RuntimeError, ValueError):
    """A prepared token file that cannot be trusted; the message names the file and the fix. A ValueError too:
    bad input, reported by the CLIs in one line (looplab/cli_errors.py)."""


class DataFileError(ValueError):
    """A corpus file, or a document in it, that cannot be read as text; the message names the file and line (or
    the row). Its own class, so that the CLIs report it in one line even when a `datasets` worker raised it."""


@dataclass
class TokenFile:
    path: Path  # <dir>/<split>.bin
    manifest: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    def open(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.dtype(self.manifest["dtype"]), mode="r", shape=(self.num_tokens,))


@dataclass
class SourceConfig:
    source: str = corpus.EMBEDDED_NAME
    data_files: Any = None  # str | list | {split: str | list}, for local builders (or to pick hub files)
    subset: str | None = None  # hub config name, e.g. a language or a Pile subset
    text_field: str = "text"
    train_split: str = "train"
    val_split: str | None = None  # None: hold out val_fraction of the training documents
    val_fraction: float = 0.05
    streaming: bool = False
    revision: str | None = None
    max_train_tokens: int | None = None  # stop packing after this many tokens (streaming Pile: required in practice)
    max_val_tokens: int | None = None

    @property
    def is_embedded(self) -> bool:
        return self.source == corpus.EMBEDDED_NAME

    @property
    def is_local(self) -> bool:
        return self.source in LOCAL_BUILDERS

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


# ----------------------------------------------------------------- sources
def _local_files(data_files: Any) -> list[Path]:
    if data_files is None:
        raise ValueError("a local source (json/text/parquet/csv) needs data_files=<path or glob>")
    specs = []
    if isinstance(data_files, dict):
        for v in data_files.values():
            specs += [v] if isinstance(v, str) else list(v)
    else:
        specs = [data_files] if isinstance(data_files, str) else list(data_files)
    files = []
    for spec in specs:
        matched = sorted(glob.glob(os.path.expanduser(str(spec))))
        if not matched:
            raise FileNotFoundError(f"data file {str(spec)!r} does not exist (cwd {os.getcwd()!r})")
        for m in matched:
            p = Path(m)
            if p.stat().st_size == 0:
                raise ValueError(f"data file {str(p)!r} is empty")
            files.append(p)
    return files


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _hold_out_indices(n: int, fraction: float) -> np.ndarray:
    """A fixed pseudo-random ceil(fraction·n) of document indices (independent of the run seed)."""
    if not 0 < fraction < 1:
        raise ValueError(f"val_fraction={fraction} must lie in (0, 1) when the source has no validation split")
    k = max(1, math.ceil(fraction * n))
    if k >= n:
        raise ValueError(f"val_fraction={fraction} would hold out all {n} documents; the source needs more documents")
    return np.sort(np.random.default_rng(20240601).permutation(n)[:k])


def source_fingerprint(src: SourceConfig) -> str | None:
    """What identifies the source's content, computed without reading it through `datasets`
    (so a prepared cache opens offline); None for a downloaded hub dataset, whose fingerprint
    comes from its `datasets` cache (load_source)."""
    if src.is_embedded:
        return "shakespeare:" + corpus.fingerprint(corpus.documents()) + f":val={src.val_fraction}"
    if src.is_local:
        fp = hashlib.sha256()
        for p in _local_files(src.data_files):
            fp.update(f"{p.resolve()}:{_file_digest(p)}\n".encode())
        out = f"local:{src.source}:{fp.hexdigest()}"
    elif src.streaming:
        out = f"hub:{src.source}:{src.subset}:{src.revision}"
    else:
        return None
    return out + (f":val={src.val_fraction}" if src.val_split is None else "")


def load_source(src: SourceConfig) -> tuple[dict[str, Any], str]:
    """{split: datasets.Dataset | IterableDataset} with a `text` column, plus the source fingerprint."""
    import datasets

    fingerprint = source_fingerprint(src)
    if src.is_embedded:
        docs = corpus.documents()
        val = corpus.held_out([n for n, _ in docs], src.val_fraction)
        by_split = {
            "train": [(n, t) for n, t in docs if n not in val],
            "validation": [(n, t) for n, t in docs if n in val],
        }
        out = {s: datasets.Dataset.from_dict({"name": [n for n, _ in d], "text": [t for _, t in d]}) for s, d in by_split.items()}
        return out, fingerprint

    if src.is_local:
        data_files = src.data_files
        if isinstance(data_files, str):
            data_files = os.path.expanduser(data_files)
        try:
            raw = datasets.load_dataset(src.source, data_files=data_files)
        except Exception as e:
            root = _root_cause(e)
            cause = f" ({type(root).__name__}: {root})" if root is not e else ""
            raise DataFileError(_first_bad_line(src) or f"cannot read {src.source} files {src.data_files!r}: {e}{cause}") from e
    else:
        kw = dict(name=src.subset, revision=src.revision, streaming=src.streaming)
        if src.data_files is not None:
            kw["data_files"] = src.data_files
        raw = datasets.load_dataset(src.source, **kw)
        if fingerprint is None:
            fingerprint = f"hub:{src.source}:{src.subset}:{src.revision}:" + ",".join(f"{k}={v._fingerprint}" for k, v in sorted(raw.items()))
            fingerprint += f":val={src.val_fraction}" if src.val_split is None else ""

    if src.train_split not in raw:
        raise ValueError(f"source {src.source!r} has no split {src.train_split!r} (splits: {list(raw)}); set train_split")
    for split in dict.fromkeys(s for s in (src.train_split, src.val_split) if s is not None and s in raw):
        _check_text_column(raw[split], split, src)
    train = raw[src.train_split]
    if src.val_split is not None:
        if src.val_split not in raw:
            raise ValueError(f"source {src.source!r} has no split {src.val_split!r} (splits: {list(raw)}); set val_split or null")
        val = raw[src.val_split]
    elif src.streaming:
        raise ValueError("streaming sources need a val_split (e.g. 'validation'): held-out documents cannot be drawn from a stream")
    else:
        held = _hold_out_indices(len(train), src.val_fraction)
        keep = np.setdiff1d(np.arange(len(train)), held)
        train, val = train.select(keep), train.select(held)
    for name, ds in (("train", train), ("validation", val)):
        cols = ds.column_names if ds.column_names is not None else list(ds.features or {})
        if cols and src.text_field not in cols:
            raise ValueError(f"{name} split of {src.source!r} has no column {src.text_field!r} (columns: {cols}); set text_field")
    return {"train": train, "validation": val}, fingerprint


def _root_cause(e: BaseException) -> BaseException:
    """The innermost exception of e's cause chain (datasets wraps a parse error in DatasetGenerationError)."""
    seen = {id(e)}
    while (nxt := e.__cause__ or e.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        e = nxt
    return e


def _first_bad_line(src: SourceConfig) -> str | None:
    """'data file F line N ...': the first line of the local files that cannot be a document (not UTF-8; for json,
    not a JSON object, or its text field missing, null or not a string), or None when every line reads. Read only
    when `datasets` failed on the files or found a document without text."""
    field = src.text_field
    if src.source not in ("json", "text", "csv"):
        return None
    for path in _local_files(src.data_files):
        where = f"data file {str(path)!r}"
        lines_are_records, records = src.source == "json", 0
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return (f"{where} line {n} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                            "re-encode the file as UTF-8")
                if not lines_are_records or not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    if not records:  # the first line: a JSON document over several lines (an array), not JSON Lines
                        lines_are_records = False
                        continue
                    return (f"{where} line {n} is not valid JSON ({e.msg}, column {e.colno}); each line of a "
                            "JSON Lines file must be one JSON object")
                records += 1
                if not isinstance(record, dict):
                    return f"{where} line {n} is a JSON {type(record).__name__}, not an object with a {field!r} field"
                value = record.get(field)
                if not isinstance(value, str):
                    what = "missing" if field not in record else "null" if value is None else f"{value!r} ({type(value).__name__})"
                    return f"{where} line {n}: its {field!r} field is {what}, not text; fix or drop that line"
        if src.source == "json" and not lines_are_records:
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                return f"{where} line {e.lineno} is not valid JSON ({e.msg}, column {e.colno})"
    return None


def _check_text_column(ds, split: str, src: SourceConfig) -> None:
    """Every document's text must be a string: a null (a JSON null, an empty csv cell) or a number is refused here,
    naming the file and line (local files) or the row, instead of failing inside the tokenizer."""
    import datasets

    if not isinstance(ds, datasets.Dataset) or src.text_field not in (ds.column_names or []):
        return
    import pyarrow as pa
    import pyarrow.compute as pc

    col = ds.data.column(src.text_field)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        try:  # pyarrow's JSON reader keeps bytes that are not UTF-8 (decoding them fails later, in the tokenizer);
            if src.is_local:  # hub datasets were written from Python strings (and may be large: not read again)
                col.validate(full=True)
        except pa.ArrowInvalid as e:
            raise DataFileError(_first_bad_line(src) or f"{src.source} files {src.data_files!r} hold text that is not "
                                f"UTF-8 ({e})") from None
        if col.null_count == 0:
            return
        row, what = pc.index(pc.is_null(col), True).as_py(), "null"
    else:
        row, what = 0, f"of type {col.type}"
    found = _first_bad_line(src) if src.is_local else None
    raise DataFileError(found or f"row {row} of the {split!r} split of {src.source!r}: its {src.text_field!r} field is "
                                 f"{what}, not text; drop such documents or set text_field")


# ---------------------------------------------------------------- packing
def cache_key(src: SourceConfig, source_fingerprint: str, tok: LMTokenizer) -> str:
    blob = json.dumps(
        {
            "version": FORMAT_VERSION,
            "source": source_fingerprint,
            "text_field": src.text_field,
            "tokenizer": tok.hash,
            "eos": tok.eos_id,
            "max_train_tokens": src.max_train_tokens,
            "max_val_tokens": src.max_val_tokens,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_folder(cache_dir: str | os.PathLike, src: SourceConfig, source_fingerprint: str, tok: LMTokenizer) -> Path:
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in src.source.split("/")[-1])[:40]
    return Path(os.path.expanduser(str(cache_dir))) / f"{slug}-{cache_key(src, source_fingerprint, tok)}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _token_batches(ds, tok: LMTokenizer, text_field: str, num_proc: int, batch_docs: int) -> Iterator[np.ndarray]:
    """Yield flat arrays of token ids (each document followed by EOS)."""
    import datasets

    eos = tok.eos_id

    def encode(batch):
        texts = batch[text_field]
        bad = next((t for t in texts if not isinstance(t, str)), "")
        if not isinstance(bad, str):  # a streamed source (a local one is checked when loaded: _check_text_column)
            raise DataFileError(f"a document's {text_field!r} field is {bad!r} ({type(bad).__name__}), not text; "
                                "drop such documents from the source or set text_field")
        return {"ids": [ids + [eos] for ids in tok.encode_batch(texts)]}

    if isinstance(ds, datasets.IterableDataset):
        cols = list(ds.features) if ds.features is not None else None
        for batch in ds.map(encode, batched=True, batch_size=batch_docs, remove_columns=cols).iter(batch_size=batch_docs):
            if batch["ids"]:
                yield np.fromiter((i for ids in batch["ids"] for i in ids), dtype=np.int64)
        return
    if len(ds) == 0:
        return
    nproc = max(1, min(num_proc, len(ds)))
    tokenized = ds.map(
        encode, batched=True, batch_size=batch_docs, num_proc=nproc if nproc > 1 else None,
        remove_columns=ds.column_names, desc=f"tokenize ({nproc} proc)",
    )
    for table in tokenized.with_format("arrow").iter(batch_size=1024):
        yield table["ids"].combine_chunks().flatten().to_numpy()


def _write_split(ds, split: str, folder: Path, tok: LMTokenizer, src: SourceConfig, fingerprint: str,
                 num_proc: int, batch_docs: int, max_tokens: int | None) -> TokenFile:
    dtype = token_dtype(tok.vocab_size)
    tmp = folder / _temp_name(f"{split}.bin")
    try:
        return _write_split_to(tmp, ds, split, folder, tok, src, fingerprint, num_proc, batch_docs, max_tokens, dtype)
    except BaseException:  # a failed tokenisation (or a full disk) leaves no temporary file behind
        tmp.unlink(missing_ok=True)
        raise


def _write_split_to(tmp: Path, ds, split: str, folder: Path, tok: LMTokenizer, src: SourceConfig, fingerprint: str,
                    num_proc: int, batch_docs: int, max_tokens: int | None, dtype: np.dtype) -> TokenFile:
    sha, n, n_docs, n_text = hashlib.sha256(), 0, 0, 0
    t0 = time.perf_counter()
    with open(tmp, "wb") as f:
        for arr in _token_batches(ds, tok, src.text_field, num_proc, batch_docs):
            if max_tokens is not None:
                arr = arr[: max_tokens - n]
            if arr.size and int(arr.max()) >= tok.vocab_size:
                raise ValueError(f"token id {int(arr.max())} >= vocab_size {tok.vocab_size} from tokenizer {tok.spec!r}")
            n_docs += int((arr == tok.eos_id).sum())
            n_text += int((arr != tok.eos_id).sum())
            b = arr.astype(dtype).tobytes()
            f.write(b)
            sha.update(b)
            n += arr.size
            if max_tokens is not None and n >= max_tokens:
                break
    seconds = time.perf_counter() - t0
    if n_text == 0:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"the {split} split of source {src.source!r} ({src.data_files or ''}) contains no text; nothing to train or evaluate on")
    manifest = {
        "version": FORMAT_VERSION,
        "split": split,
        "source": src.describe(),
        "source_fingerprint": fingerprint,
        "tokenizer": tok.spec,
        "tokenizer_hash": tok.hash,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype.name,
        "num_tokens": n,
        "num_docs": n_docs,
        "sha256": sha.hexdigest(),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(n / max(seconds, 1e-9)),
    }
    os.replace(tmp, folder / f"{split}.bin")
    mtmp = folder / _temp_name(f"{split}.json")
    try:
        mtmp.write_text(json.dumps(manifest, indent=1))
        os.replace(mtmp, folder / f"{split}.json")
    except BaseException:
        mtmp.unlink(missing_ok=True)
        raise
    return TokenFile(folder / f"{split}.bin", manifest)


# `.<split>.bin.tmp<PID>@<host>`: the writer's PID and host, so that a sweep removes only the temporary files of
# writers that are gone (a cache shared by the nodes of a cluster is written from several hosts at once);
# `.<split>.bin.tmp<PID>` (no host): older code's, taken as this host's
TEMP_FILE = re.compile(r"^\.(?:" + "|".join(SPLITS) + r")\.(?:bin|json)\.tmp(?P<pid>\d+)(?:@(?P<host>.+))?$")


def _temp_name(name: str) -> str:
    return f".{name}.tmp{os.getpid()}@{socket.gethostname()}"


def sweep_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary token files in a cache folder left by writers that died (kill -9, a lost node) on this
    host; the removed. A live writer's (another run preparing the same cache now) are left alone."""
    from looplab.training.run_folder import remove_orphans

    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    here = socket.gethostname()
    candidates = []
    for p in entries:
        m = TEMP_FILE.match(p.name)
        if m and (m["host"] is None or m["host"] == here):
            candidates.append((p, int(m["pid"])))
    return remove_orphans(candidates, locked=False)


def load_split(folder: str | os.PathLike, split: str, *, source_fingerprint: str | None = None,
               tokenizer_hash: str | None = None, verify_checksum: bool | None = None) -> TokenFile:
    """Open a prepared split, refusing anything that does not match its manifest or what the caller expects."""
    folder = Path(folder)
    mpath, bpath = folder / f"{split}.json", folder / f"{split}.bin"
    if not mpath.is_file():
        raise FileNotFoundError(f"no manifest {str(mpath)!r}: split {split!r} was never prepared (run python -m looplab.data.prepare)")
    try:
        m = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise TokenCacheError(f"manifest {str(mpath)!r} is corrupt ({e}); delete {str(folder)!r} and prepare again") from e
    if m.get("version") != FORMAT_VERSION:
        raise TokenCacheError(f"manifest {str(mpath)!r} has format version {m.get('version')}, expected {FORMAT_VERSION}; delete {str(folder)!r} and prepare again")
    for key, want in (("source_fingerprint", source_fingerprint), ("tokenizer_hash", tokenizer_hash)):
        if want is not None and m.get(key) != want:
            raise TokenCacheError(f"{str(mpath)!r} was made with {key}={m.get(key)!r}, but {want!r} is expected: "
                                  f"these tokens belong to another {key.split('_')[0]}; delete {str(folder)!r} and prepare again")
    if not bpath.is_file():
        raise TokenCacheError(f"token file {str(bpath)!r} is missing although its manifest exists; delete {str(folder)!r} and prepare again")
    itemsize = np.dtype(m["dtype"]).itemsize
    size, want = bpath.stat().st_size, int(m["num_tokens"]) * itemsize
    if size != want:
        raise TokenCacheError(f"token file {str(bpath)!r} has {size} bytes but its manifest promises {m['num_tokens']} tokens × {itemsize} B = {want} B "
                              f"(truncated or overwritten); delete {str(folder)!r} and prepare again")
    if verify_checksum is None:
        verify_checksum = size <= CHECKSUM_LIMIT
    if verify_checksum and _file_digest(bpath) != m["sha256"]:
        raise TokenCacheError(f"token file {str(bpath)!r} does not match the checksum in its manifest (corrupted); delete {str(folder)!r} and prepare again")
    return TokenFile(bpath, m)


def prepare(src: SourceConfig, tokenizer: str | LMTokenizer, cache_dir: str | os.PathLike = "data_cache", *,
            num_proc: int = 1, batch_docs: int = 64, eos_token: str | None = None, verbose: bool = True) -> dict[str, TokenFile]:
    """Prepare (or reuse) the train and validation token files of a source; returns {split: TokenFile}."""
    tok = tokenizer if isinstance(tokenizer, LMTokenizer) else load_tokenizer(tokenizer, eos_token)
    splits, fingerprint = None, source_fingerprint(src)
    if fingerprint is None:  # a downloaded hub dataset: its fingerprint comes from the datasets cache
        splits, fingerprint = load_source(src)
    folder = cache_folder(cache_dir, src, fingerprint, tok)
    limits = {"train": src.max_train_tokens, "validation": src.max_val_tokens}
    for orphan in sweep_temp_files(folder):
        if verbose:
            print(f"[looplab.prepare] removed {orphan}, left by a writer that is gone")
    out = {}
    for split in SPLITS:
        if (folder / f"{split}.json").is_file():
            out[split] = load_split(folder, split, source_fingerprint=fingerprint, tokenizer_hash=tok.hash)
            continue
        if splits is None:
            splits, fingerprint2 = load_source(src)
            assert fingerprint2 == fingerprint, (fingerprint2, fingerprint)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError as e:  # a broken symlink or a file where a folder of the path should be
            raise FileExistsError(f"cannot create the data cache folder {folder}: {e.filename} exists and is not a "
                                  f"folder (a broken symlink?); fix it or set dataset.cache_dir / LOOPLAB_CACHE") from None
        out[split] = tf = _write_split(splits[split], split, folder, tok, src, fingerprint, num_proc, batch_docs, limits[split])
        if verbose:
            m = tf.manifest
            print(f"[looplab.prepare] {split}: {m['num_docs']} docs -> {m['num_tokens']:,} tokens ({m['dtype']}) "
                  f"in {m['seconds']:.1f} s = {m['tokens_per_s']:,} tokens/s -> {tf.path}")
    return out


# ------------------------------------------------------------------- CLI
def _main() -> None:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="../../../conf", config_name="prepare")
    def main(cfg: DictConfig) -> None:
        dm = hydra.utils.instantiate(cfg.dataset)
        if not hasattr(dm, "prepare"):
            print(f"dataset {cfg.dataset.get('name', '?')!r} is generated on the fly; nothing to prepare")
            return
        for split, tf in dm.prepare().items():
            m = tf.manifest
            print(f"{split}: {m['num_tokens']:,} tokens, {m['num_docs']} docs, {m['dtype']}, tokenizer {m['tokenizer']} ({m['tokenizer_hash']}) -> {tf.path}")

    main()


if __name__ == "__main__":
    _main()
