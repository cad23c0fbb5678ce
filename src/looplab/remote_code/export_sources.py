"""A variant's own export code (docs/extending.md#bring-your-export-code).

A registered variant names, as its `export_source`, a module: one self-contained file (torch and the standard library
only) that defines what the exported code calls for its axis (`HOOKS`). `convert to-hf` copies that file into the
folder as `looplab_variant_<axis>_<name>.py` and writes `looplab_variants.py`, the table the remote code imports:

    modeling_looplab.py:    from .looplab_variants import VARIANTS          (a static relative import: transformers'
    looplab_variants.py:    from .looplab_variant_state_update_gru import StateUpdate as ...   dynamic-module loader
                            VARIANTS = {"state_update": {"gru": ...}}                           copies what it names)

A folder with no such variant ships an empty table. config.json records what was shipped (`looplab_variants`: the
file and the variant's full options, which the remote code hands to it as `self.options`).

Who runs that code: transformers, only under `trust_remote_code=True` (the user saying so). looplab never runs a
folder's files: `LoopedLM.from_pretrained` reads config.json and the weights, and looplab's own copy of the exported
code (`looplab.remote_code.modeling_looplab`, `convert.load_remote_code(trust_remote_code=False)`) imports
looplab.remote_code.looplab_variants, which takes each variant's export code from its registered class
(`RegisteredVariants`), under the registry's trust rules, never from the folder.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.machinery
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from looplab.models.registry import (REGISTRIES, ConfigError, UntrustedVariantError, _import_variant_module, names_from,
                                     options_of)

TABLE = "looplab_variants"  # the module modeling_looplab.py imports (written into every folder)
# the axes whose exported code a variant may bring, and the class its export_source defines for it
HOOKS = {"state_update": "StateUpdate"}
# what that class must define: the methods the remote code calls (the same that looplab's own class has)
METHODS = {"state_update": ("build_update", "update")}
ALLOWED_IMPORTS = frozenset(sys.stdlib_module_names) | {"torch"}
DOCS = "docs/extending.md#bring-your-export-code"


class ExportSourceError(ConfigError):
    """A variant's export_source cannot be shipped; the message names the variant, the module and the fix."""


@dataclass(frozen=True)
class ExportSource:
    axis: str  # a key of HOOKS
    name: str  # the variant's registered name, as the config selects it
    module: str  # its export_source
    path: Path  # the file that is shipped
    options: dict  # the variant's options, defaults included

    @property
    def file_name(self) -> str:
        """The file's name in the folder: a Python identifier made of the axis and the variant's name."""
        return f"looplab_variant_{self.axis}_{re.sub(r'[^0-9A-Za-z_]', '_', self.name)}.py"


def _selected(cfg) -> dict[str, str]:
    """{axis: the name the config selects} for the axes that take export code."""
    return {"state_update": cfg.state_update}


def export_sources(cfg) -> list[ExportSource]:
    """The export code this model's variants bring, each checked (`check_source`); ExportSourceError naming the
    variant otherwise. A variant of another axis that names an export_source, and a researcher's state update that
    declares export=True without one, are refused too: the exported code would not run them."""
    out = []
    selected = _selected(cfg)
    for where, cls in cfg.variants():
        module = getattr(cls, "export_source", None)
        axis = next((a for a, n in selected.items() if REGISTRIES[a].get(n) is cls), None)
        if module is not None and axis is None:
            raise ExportSourceError(
                f"{where}: export_source={module!r}, but the exported code takes export code for {sorted(HOOKS)} "
                f"only ({DOCS} says why the other axes cannot bring theirs)")
        if axis is None:
            continue
        if module is None:
            if cls.supports.export is True and not cls.__module__.startswith("looplab."):
                raise ExportSourceError(
                    f"{where}: declares export=True but names no export_source, and the exported code computes "
                    f"looplab's own {axis.replace('_', ' ')}s only; give {cls.__qualname__} an export_source ({DOCS})")
            continue
        opts = options_of(cls, cfg.options.get(axis))
        source = ExportSource(axis, selected[axis], module, _source_file(where, module),
                              dataclasses.asdict(opts) if opts is not None else {})
        check_source(where, source)
        out.append(source)
    return out


def refusal(cfg) -> str | None:
    """Why this model's export code cannot be shipped, or None (`remote_code.unsupported`)."""
    try:
        export_sources(cfg)
    except ExportSourceError as e:
        return str(e)
    return None


def _search_path() -> list[str]:
    """sys.path without the working directory that `python -m` puts first (as the registry imports variants)."""
    explicit = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    cwd = os.getcwd()
    return [p for p in sys.path
            if not ((p in ("", ".") or os.path.abspath(p) == cwd) and os.path.abspath(p or ".") not in explicit)]


def _source_file(where: str, module: str) -> Path:
    """The file of `module`, found without running it (its parent package is the variant's own, imported already)."""
    if not isinstance(module, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module):
        raise ExportSourceError(f"{where}: export_source={module!r} must be a module's dotted name (my_pkg.gru_export)")
    parent, _, _ = module.rpartition(".")
    try:
        path = getattr(_import_variant_module(parent), "__path__", None) if parent else _search_path()
        spec = importlib.machinery.PathFinder.find_spec(module, path) if path is not None else None
    except ImportError as e:
        spec, why = None, f" ({type(e).__name__}: {e})"
    else:
        why = ""
    origin = getattr(spec, "origin", None)
    if origin is None or not origin.endswith(".py") or not os.path.isfile(origin):
        raise ExportSourceError(f"{where}: export_source={module!r} was not found as a .py file on the import path"
                                f"{why} (PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}; the working directory is "
                                "not searched); put it beside the variant's module")
    return Path(origin)


def check_source(where: str, source: ExportSource) -> None:
    """The file parses, imports only torch and the standard library (the folder runs where looplab is not
    installed, and transformers fetches no other file for it), and defines the axis' class with its methods."""
    what = f"{where}: export_source={source.module!r} ({source.path})"
    try:
        tree = ast.parse(source.path.read_text(encoding="utf-8"), str(source.path))
    except SyntaxError as e:
        raise ExportSourceError(f"{what} does not parse: line {e.lineno}: {e.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise ExportSourceError(f"{what} has a relative import on line {node.lineno}: the file is shipped alone; "
                                    "import torch and the standard library only")
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) else [])
        bad = [n for n in names if n.split(".")[0] not in ALLOWED_IMPORTS]
        if bad:
            raise ExportSourceError(f"{what} imports {bad[0]!r} on line {node.lineno}: the exported folder runs where "
                                    "only torch and transformers are installed; import torch and the standard library "
                                    "only")
    cls = HOOKS[source.axis]
    body = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if body is None:
        raise ExportSourceError(f"{what} defines no class {cls!r} at its top level, which the exported code mixes into "
                                f"its {source.axis.replace('_', ' ')} ({DOCS})")
    defined = {n.name for n in body.body if isinstance(n, ast.FunctionDef)}
    missing = [m for m in METHODS[source.axis] if m not in defined]
    if missing:
        raise ExportSourceError(f"{what}: class {cls} does not define {', '.join(missing)} ({DOCS})")


def table_source(sources: list[ExportSource]) -> str:
    """looplab_variants.py for a folder: one static relative import per shipped file (transformers copies exactly
    the files that the modeling file's relative imports name, recursively) and the VARIANTS table."""
    lines = ['"""The variants\' own export code in this folder, written by looplab\'s `convert to-hf` (each file '
             'imports torch\nand the standard library only). modeling_looplab.py imports VARIANTS."""', ""]
    table: dict[str, list[str]] = {}
    for i, s in enumerate(sources):
        alias = f"_{s.axis}_{i}"
        lines.append(f"from .{s.file_name[:-3]} import {HOOKS[s.axis]} as {alias}")
        table.setdefault(s.axis, []).append(f"{s.name!r}: {alias}")
    lines += ["", "VARIANTS = {" + ", ".join(f"{a!r}: {{{', '.join(e)}}}" for a, e in table.items()) + "}", ""]
    return "\n".join(lines)


def write_sources(cfg, out: Path, ship: bool = True) -> dict:
    """Copy the model's export code into the folder `out` (ship=False: none) and write its looplab_variants.py;
    returns config.json's `looplab_variants` record ({axis: {name, file, options}})."""
    sources = export_sources(cfg) if ship else []
    for s in sources:
        (out / s.file_name).write_bytes(s.path.read_bytes())
    (out / f"{TABLE}.py").write_text(table_source(sources), encoding="utf-8")
    return {s.axis: {"name": s.name, "file": s.file_name, "options": s.options} for s in sources}


class RegisteredVariants:
    """VARIANTS for looplab's own copy of the exported code: {axis: {name: class}} read off the registered variants'
    export_source modules (looplab's import path, the registry's trust rules), never off a folder."""

    def get(self, axis: str, default=None):
        return _RegisteredAxis(axis) if axis in HOOKS else default


@dataclass(frozen=True)
class _RegisteredAxis:
    axis: str

    def get(self, name: str, default=None):
        with names_from("an exported folder's config.json"):
            try:
                cls = REGISTRIES[self.axis].get(name)
            except UntrustedVariantError:
                raise  # says which package to trust
            except ConfigError:
                return default  # unknown: the exported code refuses the name itself
        module = getattr(cls, "export_source", None)
        return default if module is None else getattr(_import_variant_module(module), HOOKS[self.axis])
