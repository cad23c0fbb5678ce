"""The fourteen paper tables as yaml specs: `specs/tableN.yaml` is the source of `tables.spec.TABLES[N]`.

    python -m looplab.tables.paper_specs check    # every file loads and is in canonical form (exit 1 if not)
    python -m looplab.tables.paper_specs write    # rewrite every file in canonical form (after a hand edit)

A file holds everything a `TableSpec` and its `Finding`s hold. Where a concept is the one of a researcher's own
spec (tables/own.py, docs/extending.md "Compare your arms") it has the same name: `metric`, `claim: {sign, delta}`
and `require`. A finding:

    - label: StateLoop − Vanilla Looped          # what is compared (arm A − arm B)
      paper: StateLoop lowers Pile perplexity …  # what the paper reports (Finding.claim)
      metric: perplexity
      a: {arm: stateloop}                        # arm filters on the runs' facets (tables/load.py)
      b: {arm: looped}
      per: [size]                                # optional: per, match, minus: [A′, B′], contrast: ratio, by_construction
      claim:                                     # the paper's sign of A − B, its size, δ and why (as code had them)
        sign: -1
        size: -0.18
        delta: 0.44
        delta_why: half the paper's effect …
        scaling: 4.8673                          # the paper's effect in this setting's units, and why
        scaling_why: the same share of the perplexity …
      require: [LM_LEARNED]                      # a precondition by name (claims.PRECONDITIONS), as an own
                                                 # spec writes it ('accuracy>=0.6': every arm), or inline:
                                                 # {metric, op, threshold, arms, why}

`claim` also takes kind (sign | at_most | near), tolerance and effect (a number, or {stratum: number}); a sign
claim's effect defaults to its size. Every finding is built by `claims.finding`, so a file is held to the same
rules as code was (a δ needs its reason, the sign is ±1, ...); an error names the file, the finding and the field.

The canonical form is `dump`'s output: `load` then `dump` gives a file's text back byte for byte (tests/test_paper_specs.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from looplab.tables.catalog import TableSpec
from looplab.tables.claims import PRECONDITIONS, Finding, Precondition, finding
from looplab.tables.sweeps import SCALES, Sweep

SPEC_DIR = Path(__file__).resolve().parents[1] / "specs"
NUMBERS = tuple(range(1, 15))

TABLE_KEYS = ("number", "title", "kind", "metric", "sweeps", "notes", "findings")
SWEEP_KEYS = ("experiment", "params", "fixed", "name", "init_from", "per_seed")
FINDING_KEYS = ("label", "paper", "metric", "a", "b", "per", "match", "minus", "contrast", "claim", "require",
                "by_construction")
CLAIM_KEYS = ("sign", "kind", "size", "tolerance", "delta", "delta_why", "effect", "scaling", "scaling_why")
PRECONDITION_KEYS = ("metric", "op", "threshold", "arms", "why")

# An own spec's `require` (tables/own.py: 'accuracy>=0.6') also names a precondition here: every arm, no reason given.
# Its grammar is compare.Requirement's (not imported: compare sits above the tables' specs; tests/test_paper_specs.py
# checks the two read alike). Its unigram bar is the results.json figure; a Precondition's is the word 'unigram'.
_OWN_FORM = re.compile(r"^\s*([\w./-]+)\s*(<=|>=|<|>)\s*([\w./+-]+)\s*$")
OWN_UNIGRAM = "unigram_perplexity"

HEADER = ("# Paper table {n}: the source of looplab.tables.spec.TABLES[{n}] (docs/tables.md, section Table {n}).\n"
          "# Keys: looplab/tables/paper_specs/__init__.py. After an edit, `python -m looplab.tables.paper_specs write`\n"
          "# puts the file in canonical form and `... check` tests it; comments are not kept.\n")


def path_of(number: int) -> Path:
    return SPEC_DIR / f"table{number}.yaml"


# ----------------------------------------------------------------------------- dump
class _Flow(dict):
    """A mapping written on one line ({arm: stateloop}): filters, params, effect per stratum."""


class _FlowList(list):
    """A list written on one line ([size], [trainer.max_steps=1600])."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v.items(), flow_style=True))
_Dumper.add_representer(_FlowList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
# mappings in the order the module builds them (the keys' order above), not sorted
_Dumper.add_representer(dict, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v.items(), flow_style=False))


def _sweep_dict(sw: Sweep) -> dict[str, Any]:
    out: dict[str, Any] = {"experiment": sw.experiment}
    if sw.params:
        out["params"] = _Flow((k, _FlowList(vs)) for k, vs in sw.params)
    if sw.fixed:
        out["fixed"] = _FlowList(sw.fixed)
    if sw.name is not None:
        out["name"] = sw.name
    if sw.init_from is not None:
        out["init_from"] = {"sweep": sw.init_from[0], "job": _Flow(sw.init_from[1])}
    if sw.per_seed:
        out["per_seed"] = True
    return out


def _precondition(p: Precondition) -> str | dict[str, Any]:
    for name, named in PRECONDITIONS.items():
        if p == named:
            return name
    if p.arms == "each" and not p.why:  # what an own spec's `require` string says: write it that way
        t = OWN_UNIGRAM if p.threshold == "unigram" else repr(p.threshold)
        return f"{p.metric}{p.op}{t}"
    return {"metric": p.metric, "op": p.op, "threshold": p.threshold, "arms": p.arms, "why": p.why}


def _finding_dict(fd: Finding) -> dict[str, Any]:
    out: dict[str, Any] = {"label": fd.label, "paper": fd.claim, "metric": fd.metric, "a": _Flow(fd.a), "b": _Flow(fd.b)}
    if fd.per:
        out["per"] = _FlowList(fd.per)
    if fd.match:
        out["match"] = _FlowList(fd.match)
    if fd.minus is not None:
        out["minus"] = [_Flow(m) for m in fd.minus]
    if fd.contrast != "diff":
        out["contrast"] = fd.contrast
    claim: dict[str, Any] = {"sign": fd.sign}
    if fd.kind != "sign":
        claim["kind"] = fd.kind
    for k in ("size", "tolerance", "delta"):
        if getattr(fd, k) is not None:
            claim[k] = getattr(fd, k)
    if fd.delta_why:
        claim["delta_why"] = fd.delta_why
    default_effect = fd.size if fd.kind == "sign" else None  # finding() fills a sign claim's effect from its size
    if fd.effect != default_effect:
        claim["effect"] = _Flow(fd.effect) if isinstance(fd.effect, tuple) else fd.effect
    if fd.scaling != 1.0:
        claim["scaling"] = fd.scaling
    if fd.scaling_why:
        claim["scaling_why"] = fd.scaling_why
    out["claim"] = claim
    if fd.requires:
        req = [_precondition(p) for p in fd.requires]
        out["require"] = _FlowList(req) if all(isinstance(r, str) for r in req) else req
    if fd.by_construction:
        out["by_construction"] = True
    return out


def dump(table: TableSpec) -> str:
    """The table's canonical yaml text."""
    data: dict[str, Any] = {"number": table.number, "title": table.title, "kind": table.kind, "metric": table.metric,
                            "sweeps": {s: [_sweep_dict(sw) for sw in table.sweeps[s]] for s in table.sweeps}}
    if table.notes:
        data["notes"] = dict(table.notes)
    if table.findings:
        data["findings"] = [_finding_dict(fd) for fd in table.findings]
    body = yaml.dump(data, Dumper=_Dumper, allow_unicode=True, sort_keys=False, width=120)
    return HEADER.format(n=table.number) + body


# ----------------------------------------------------------------------------- load
class SpecError(ValueError):
    """A paper-table spec that cannot be read: the message names the file and the field."""


def _mapping(v: Any, where: str, keys: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise SpecError(f"{where}: must be a mapping with keys {list(keys)}, not {v!r}")
    unknown = [k for k in v if k not in keys]
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {unknown}; the keys are {list(keys)}")
    missing = [k for k in required if k not in v]
    if missing:
        raise SpecError(f"{where}: missing {missing}")
    return v


def _word(v: Any, where: str) -> str:
    """A string field; a number is taken as its text (a facet value such as R: 4), a bool is refused (yaml's yes/no)."""
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise SpecError(f"{where}={v!r} must be a string (quote it in the yaml)")
    return str(v)


def _words(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise SpecError(f"{where}={v!r} must be a list")
    return tuple(_word(x, f"{where}[{i}]") for i, x in enumerate(v))


def _filter(v: Any, where: str) -> dict[str, str]:
    if not isinstance(v, dict) or not v:
        raise SpecError(f"{where}={v!r} must be a non-empty mapping of facet: value (e.g. {{arm: stateloop}})")
    return {_word(k, where): _word(x, f"{where}.{k}") for k, x in v.items()}


def _flag(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise SpecError(f"{where}={v!r} must be true or false")
    return v


def _load_sweep(v: Any, where: str) -> Sweep:
    d = _mapping(v, where, SWEEP_KEYS, ("experiment",))
    params = d.get("params") or {}
    if not isinstance(params, dict):
        raise SpecError(f"{where}.params={params!r} must map an override to its list of values")
    init = d.get("init_from")
    if init is not None:
        init = _mapping(init, f"{where}.init_from", ("sweep", "job"), ("sweep", "job"))
        init = (_word(init["sweep"], f"{where}.init_from.sweep"),
                tuple(_filter(init["job"], f"{where}.init_from.job").items()))
    return Sweep(experiment=_word(d["experiment"], f"{where}.experiment"),
                 params=tuple((_word(k, f"{where}.params"), _words(vs, f"{where}.params.{k}")) for k, vs in params.items()),
                 fixed=_words(d.get("fixed", []), f"{where}.fixed"),
                 name=None if d.get("name") is None else _word(d["name"], f"{where}.name"), init_from=init,
                 per_seed=_flag(d.get("per_seed", False), f"{where}.per_seed"))


def _load_precondition(v: Any, where: str) -> Precondition:
    if isinstance(v, str):
        if v in PRECONDITIONS:
            return PRECONDITIONS[v]
        m = _OWN_FORM.match(v)
        if not m:
            raise SpecError(f"{where}={v!r} is not a known precondition; name one of {sorted(PRECONDITIONS)}, or write "
                            f"it as an own spec does ('accuracy>=0.6', 'perplexity<unigram_perplexity') or as "
                            f"{{metric, op, threshold, arms, why}}")
        metric, op, bar = m.groups()
        try:
            threshold: float | str = float(bar)
        except ValueError:
            threshold = "unigram" if bar == OWN_UNIGRAM else bar
        try:
            return Precondition(metric, op, threshold)
        except ValueError as e:
            raise SpecError(f"{where}={v!r}: {e}") from None
    d = _mapping(v, where, PRECONDITION_KEYS, ("metric", "op", "threshold"))
    try:
        return Precondition(**d)
    except (TypeError, ValueError) as e:
        raise SpecError(f"{where}: {e}") from None


def _load_finding(v: Any, where: str) -> Finding:
    d = _mapping(v, where, FINDING_KEYS, ("label", "paper", "metric", "a", "b", "claim"))
    where = f"{where} ({d['label']!r})"
    c = _mapping(d["claim"], f"{where}.claim", CLAIM_KEYS, ("sign",))
    if isinstance(c["sign"], bool) or c["sign"] not in (-1, 1):
        raise SpecError(f"{where}.claim.sign={c['sign']!r} must be +1 or -1 (the sign the paper reports for A − B)")
    minus = d.get("minus")
    if minus is not None:
        if not isinstance(minus, list) or len(minus) != 2:
            raise SpecError(f"{where}.minus={minus!r} must be two filters [A′, B′]: (A − B) − (A′ − B′)")
        minus = (_filter(minus[0], f"{where}.minus[0]"), _filter(minus[1], f"{where}.minus[1]"))
    effect = c.get("effect")
    if isinstance(effect, dict):
        effect = {_word(k, f"{where}.claim.effect"): x for k, x in effect.items()}
    requires = d.get("require", [])
    if not isinstance(requires, list):
        raise SpecError(f"{where}.require={requires!r} must be a list of preconditions")
    try:
        return finding(
            _word(d["label"], f"{where}.label"), _word(d["paper"], f"{where}.paper"), _word(d["metric"], f"{where}.metric"),
            _filter(d["a"], f"{where}.a"), _filter(d["b"], f"{where}.b"), c["sign"],
            per=_words(d.get("per", []), f"{where}.per"), match=_words(d.get("match", []), f"{where}.match"),
            minus=minus, contrast=d.get("contrast", "diff"), kind=c.get("kind", "sign"), size=c.get("size"),
            tolerance=c.get("tolerance"),
            requires=tuple(_load_precondition(p, f"{where}.require[{i}]") for i, p in enumerate(requires)),
            delta=c.get("delta"), delta_why=c.get("delta_why", ""), effect=effect, scaling=c.get("scaling", 1.0),
            scaling_why=c.get("scaling_why", ""), by_construction=_flag(d.get("by_construction", False),
                                                                        f"{where}.by_construction"))
    except SpecError:
        raise
    except (TypeError, ValueError) as e:  # finding()'s own rules: δ without its reason, contrast, kind, ...
        own = f"finding {d['label']!r}: "  # finding() names the finding; `where` already does
        raise SpecError(f"{where}: {str(e).removeprefix(own)}") from None


def load(path: str | Path) -> TableSpec:
    """A paper table from its yaml spec, its findings built and checked by `claims.finding`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"paper-table spec {str(path)!r} does not exist")
    where = str(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise SpecError(f"{where}: not valid yaml: {e}") from None
    d = _mapping(raw, where, TABLE_KEYS, ("number", "title", "kind", "metric", "sweeps"))
    number = d["number"]
    if isinstance(number, bool) or not isinstance(number, int):
        raise SpecError(f"{where}: number={number!r} must be the table's number, an integer")
    if path.name.startswith("table") and path.stem != f"table{number}":
        raise SpecError(f"{where}: number={number!r} does not match the file name; table N lives in tableN.yaml")
    sweeps = _mapping(d["sweeps"], f"{where}: sweeps", SCALES, SCALES)
    notes = _mapping(d.get("notes") or {}, f"{where}: notes", SCALES)
    findings = d.get("findings") or []
    if not isinstance(findings, list):
        raise SpecError(f"{where}: findings={findings!r} must be a list")
    for s, sws in sweeps.items():
        if not isinstance(sws, list):
            raise SpecError(f"{where}: sweeps.{s}={sws!r} must be a list of sweeps ([] for none)")
    return TableSpec(
        number=number, title=_word(d["title"], f"{where}: title"), kind=_word(d["kind"], f"{where}: kind"),
        sweeps={s: tuple(_load_sweep(sw, f"{where}: sweeps.{s}[{i}]") for i, sw in enumerate(sweeps[s])) for s in sweeps},
        metric=_word(d["metric"], f"{where}: metric"),
        notes={s: _word(t, f"{where}: notes.{s}") for s, t in notes.items()},
        findings=tuple(_load_finding(fd, f"{where}: findings[{i}]") for i, fd in enumerate(findings)))


def load_all(folder: Path = SPEC_DIR) -> dict[int, TableSpec]:
    """The fourteen tables, by number."""
    missing = [str(path_of(n)) for n in NUMBERS if not (folder / path_of(n).name).is_file()]
    if missing:
        raise FileNotFoundError(f"paper-table specs missing: {missing} (the package data of looplab/tables/specs/)")
    return {n: load(folder / path_of(n).name) for n in NUMBERS}


# ----------------------------------------------------------------------------- CLI
def out_of_sync(folder: Path = SPEC_DIR) -> list[str]:
    """Why each file that is not in canonical form is not (empty: all fourteen are)."""
    problems = []
    for n in NUMBERS:
        p = folder / path_of(n).name
        try:
            if dump(load(p)) != p.read_text(encoding="utf-8"):
                problems.append(f"{p}: not in canonical form (run `python -m looplab.tables.paper_specs write`)")
        except (OSError, ValueError) as e:
            problems.append(str(e))
    return problems


def write(folder: Path = SPEC_DIR, tables: dict[int, TableSpec] | None = None) -> list[Path]:
    """Write each table's canonical text (default: the tables the files hold, i.e. canonicalize them)."""
    tables = load_all(folder) if tables is None else tables
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for n, t in sorted(tables.items()):
        p = folder / path_of(n).name
        p.write_text(dump(t), encoding="utf-8")
        out.append(p)
    return out
