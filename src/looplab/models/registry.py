"""Registries of variants: one per axis, each entry a class that declares what it supports (docs/extending.md).

    backbone          the block's layer pattern (llama, mamba2, hybrid)     BACKBONES
    layer             one kind of block layer, by its pattern letter (A, M) LAYERS
    state_mode        the StateLoop update rule (vanilla, stateloop, ...)   STATE_UPDATES
    state_mixer       the state's cross-token mixer (none, attn, mamba2)    STATE_MIXERS
    exit_gate         the learned exit gate (none, ouro)                    EXIT_GATES
    injection         the embedding's re-entry (none, add, concat, diag)    INJECTIONS
    exit rule         when a token stops (gate, kl, entropy, ...)           EXIT_RULES
    skip handling     what an exited token leaves deeper (kv_copy, ...)     HANDLINGS
    depth_router      which tokens run each loop (none, expert_choice, ...) DEPTH_ROUTERS
    loop_schedule     how the loops are driven (sequential, parallel)      LOOP_SCHEDULES

A researcher adds a variant from their own module, with nothing edited inside looplab:

    from looplab.models.registry import STATE_UPDATES
    from looplab.models.state import StateBranch

    @STATE_UPDATES.register("my_pkg.gru")
    class GRUState(StateBranch): ...

and selects it by name (`state_mode=my_pkg.gru`): a dotted name that is not registered yet is imported
(`my_pkg.gru`, then `my_pkg`) until its module has registered it. `module:Class` names a class directly (Hydra's
`_target_` style), and the `looplab.variants` entry-point group lists modules to import for names found nowhere else.

Who may make looplab import a module (docs/training.md#what-looplab-trusts): importing runs the module's code, so
a name is imported only when the user typed it (a Hydra override, `LoopedLMConfig(...)` in their own code). A name
read from a model (a checkpoint's config, a folder's config.json: `LoopedLMConfig.from_dict`, under `names_from`)
imports nothing unless its package is trusted: `--trust-variants PKG` / `trust_variants(PKG)`, the environment
variable LOOPLAB_TRUST_VARIANTS=PKG,..., or an installed package that registers it through the entry points.
Imports of variant modules never search the working directory (`python -m` puts it first on sys.path, so a
`.py` shipped beside a model would otherwise run): put your code on PYTHONPATH or install it.

What a variant supports is declared, never tested by name elsewhere: `Supports` (a capability is True, or the
reason it is not supported), read by the config's validation, the decoders, the serving engine, the export and
the docs' table of what combines with what (`unsupported(config, feature)`). Built-in variants are registered
by their module path (`lazy`), so nothing is imported before it is used.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import importlib
import os
import pkgutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

# what a capability means, for messages and the docs' table (docs/extending.md#registries-and-capabilities)
FEATURES = {
    "compile": "compiled decoding over a static cache (generate(compile=...))",
    "compile_training": "the block compiled for training (compile=true, LoopedLM.compile_block)",
    "speculation": "self-speculative decoding (generate(speculation=Speculation(...)))",
    "exits": "exits that read a shallower loop of the same token (ExitPolicy)",
    "depthwise": "depth-wise batching (serve.Engine(schedule='depthwise'))",
    "depthwise_routed": "depth-wise batching under a depth router",
    "parallel_loops": "parallel loops (loop_schedule=parallel)",
    "routing": "a depth router (depth_router=...)",
    "depth_sampling": "randomized training depth and truncated backprop (loop_depth.sampler, backprop_loops)",
    "test_depth": "a test-time depth R′ ≠ R (model(ids, n_loops=R′), loop_depth.eval_loops)",
    "export": "the transformers remote-code export (python -m looplab.convert to-hf)",
}


class ConfigError(ValueError):
    """An impossible configuration; the message names the field and the fix."""


@dataclass(frozen=True)
class Supports:
    """What a variant works with. A capability is True, or a string saying why not (False: not declared).

    cache: the decoding cache entry it keeps per loop — None, "kv" (key/values: attention) or "ssm" (a conv
    history and a recurrent state: Mamba-2). Skip handlings declare which kinds they can fill."""

    cache: str | None = None
    compile: bool | str = True
    compile_training: bool | str = True
    speculation: bool | str = True
    exits: bool | str = True
    depthwise: bool | str = True
    depthwise_routed: bool | str = True
    parallel_loops: bool | str = False
    routing: bool | str = True
    depth_sampling: bool | str = True
    test_depth: bool | str = True
    export: bool | str = False

    def why_not(self, feature: str) -> str | None:
        """None when the feature is supported, else the reason (one not declared: what declaring it takes)."""
        if feature not in FEATURES:
            raise KeyError(f"unknown capability {feature!r}; known: {sorted(FEATURES)}")
        value = getattr(self, feature)
        if value is True:
            return None
        if isinstance(value, str) and value:
            return value
        return (f"does not declare support for {FEATURES[feature]}; declare {feature}=True in the class's own "
                f"`supports`{_DECLARE_WHEN[feature]} (docs/extending.md#registries-and-capabilities)")


# when a variant may declare a capability that is off by default (`Supports.why_not`)
_DECLARE_WHEN = {f: "" for f in FEATURES} | {
    "export": " only when the exported code (looplab/remote_code/modeling_looplab.py) computes it as looplab does",
    "parallel_loops": " only when it computes the same under loop_schedule=parallel (the conformance kit checks it)",
}
# the capabilities a variant has only where its own class declares them (Variant.__init_subclass__)
OPT_IN = tuple(f.name for f in dataclasses.fields(Supports) if f.name in FEATURES and f.default is not True)


class Variant:
    """The base of every registered variant: its name (set at registration), what it supports and its options.

    `supports`: what the class declares. A capability that is off by default (`OPT_IN`: export, parallel_loops)
    holds only for the class whose own body declares it; a subclass that declares no `supports` of its own keeps
    the rest of its base's and has those two off, until it declares them.

    `Options`: a dataclass of the variant's own hyperparameters (None: it has none). They are set in the config's
    `options[axis]` (Hydra: the variant's yaml keys) and enter the architecture hash only where they differ from
    their defaults."""

    name: str = ""
    supports: Supports = Supports()
    Options: type | None = None
    # the module (dotted name) of the self-contained file an exported folder ships for this variant: torch and the
    # standard library only, defining what the remote code calls for its axis (docs/extending.md#bring-your-export-code)
    export_source: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A capability that is off by default (OPT_IN: export, parallel_loops) is claimed by the class that declares
        # it, never inherited: a subclass computes something else, which the exported code or the parallel schedule
        # does not know (an out-of-tree Injection once claimed export=True through its base, until the export failed)
        if "supports" not in cls.__dict__:
            claimed = {f: False for f in OPT_IN if getattr(cls.supports, f) is True}
            if claimed:
                cls.supports = dataclasses.replace(cls.supports, **claimed)

    @classmethod
    def capabilities(cls, config) -> Supports:
        """What this variant supports in this configuration (a variant whose support depends on its own options
        overrides it)."""
        return cls.supports


class Registry(Generic[T]):
    """Names → variant classes of one axis. `field` is the config field (or option) that selects one."""

    def __init__(self, axis: str, field: str, key: str | None = None):
        self.axis, self.field = axis, field
        self.named = f"{field} ({key})" if key else field  # how errors name it: the field and the Hydra key
        self._classes: dict[str, type] = {}
        self._lazy: dict[str, str] = {}  # name → "module:Class", imported on first use
        self._order: list[str] = []  # names in the order they were first registered (lazily or not)
        self._aliases: dict[str, Any] = {}

    # ---------------------------------------------------------- registration
    def register(self, name: str | None = None, *, override: bool = False) -> Callable[[type], type]:
        """Class decorator: `@REGISTRY.register("my_pkg.name")` (default: the class's `name`)."""
        def deco(cls: type) -> type:
            key = name or getattr(cls, "name", "") or cls.__name__
            old = self._classes.get(key)
            if old is not None and old is not cls and not override and not _same_class(old, cls):
                raise ValueError(f"{self.field}={key!r} is already registered ({old.__module__}.{old.__qualname__}); "
                                 "pick another name or register(..., override=True)")
            if "name" not in cls.__dict__ or not cls.__dict__["name"]:
                cls.name = key
            self._classes[key] = cls
            self._lazy.pop(key, None)
            if key not in self._order:
                self._order.append(key)
            return cls
        return deco

    def lazy(self, name: str, target: str) -> None:
        """A built-in registered by its module path ("package.module:Class"): imported when first used."""
        self._lazy[name] = target
        if name not in self._order:
            self._order.append(name)

    def alias(self, name: str, value: Any) -> None:
        """Another name for a registered choice (what `value` means is the axis' business: a state mode alias
        names an update rule and a mixer)."""
        self._aliases[name] = value

    # ---------------------------------------------------------------- lookup
    def aliases(self) -> dict[str, Any]:
        return dict(self._aliases)

    def names(self) -> tuple[str, ...]:
        """The registered names (built-ins first, in registration order), without aliases."""
        return tuple(self._order)

    def choices(self) -> tuple[str, ...]:
        return (*self.names(), *self._aliases)

    def __contains__(self, name: object) -> bool:
        try:
            self.get(name)  # type: ignore[arg-type]
        except (ConfigError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> Iterator[tuple[str, type]]:
        """(name, class) of every registered variant (imports the built-ins)."""
        for name in self.names():
            yield name, self.get(name)

    def get(self, name: str) -> type:
        """The class registered under `name`, importing its module when needed; ConfigError naming the field,
        the value and the choices otherwise."""
        if not isinstance(name, str):
            raise ConfigError(f"{self.named}={name!r} must be a name (a string); choose one of {self.choices()}")
        cls = self._classes.get(name)
        if cls is not None:
            return cls
        if name in self._lazy:
            module, _, attr = self._lazy[name].partition(":")
            cls = getattr(importlib.import_module(module), attr)
            self.register(name)(cls)
            return cls
        cls = self._find_outside(name)
        if cls is not None:
            return cls
        raise self._unknown(name)

    def _unknown(self, name: str, imported: tuple[str, ...] = ()) -> ConfigError:
        """The error for a name nothing registers: the closest registered names, the choices, how to register. The
        modules named like it in the packages imported for it (the user's, trusted: they typed its name) are
        imported first, so `my_pkg.mingur` finds `my_pkg.mingru` where my_pkg/__init__.py does not import it."""
        for module in imported:
            path = getattr(sys.modules.get(module), "__path__", None)
            subs = [f"{module}.{m.name}" for m in pkgutil.iter_modules(path)] if path is not None else []
            for sub in close_matches(name, subs, n=3):
                try:
                    _import_variant_module(sub)
                except Exception:  # noqa: BLE001 - only a suggestion; the name itself is refused either way
                    pass
        seen = f"; {' and '.join(imported)} imported, registering no {name!r}" if imported else ""
        return ConfigError(f"{self.named}={name!r} is unknown{did_you_mean(name, self.choices())}{seen}; choose one of "
                           f"{self.choices()}, or register your own (a module that registers {name!r} with "
                           f"looplab.models.registry.{_registry_name(self)}; docs/extending.md)")

    def _find_outside(self, name: str) -> type | None:
        """A researcher's variant: `module:Class`, or a dotted name whose module (or a parent package) registers it
        on import, or a module listed in the `looplab.variants` entry-point group. A name read from a model imports
        nothing unless its package is trusted (`names_from`). A dotted name typed by the user that is not found says
        why: no module of it on the path, its module raising ImportError (VariantImportError, the error its cause),
        or its modules registering no such name (the closest names)."""
        source = _UNTRUSTED_SOURCE.get()
        package = name.partition(":")[0].split(".")[0]
        if source is not None and package not in trusted_packages():
            _load_entry_points()  # installed packages are the user's choice
            if name in self._classes:
                return self._classes[name]
            if (":" in name or "." in name) and package != "looplab":
                raise UntrustedVariantError(
                    f"{self.field}={name!r} in {source} is not registered, and looplab does not import package "
                    f"{package!r} for it: a model someone else made could ship that module. If you trust it: "
                    f"--trust-variants {package} (or LOOPLAB_TRUST_VARIANTS={package}), or install the package "
                    "that registers it (entry-point group looplab.variants; docs/extending.md)")
            return None
        if package != "looplab":
            # the user typed this name: their package is trusted for the rest of the process, so a checkpoint they
            # trained with it (its other variants included) loads without --trust-variants
            _TRUSTED.add(package)
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                found = _import_variant_module(module)
            except ImportError as e:
                if not _is_missing(module, e):
                    raise VariantImportError(self._raised(name, _raising_module(module, e), e)) from e
                raise VariantImportError(self._not_found(name, module)) from e
            if not hasattr(found, attr):
                raise ConfigError(f"{self.named}={name!r}: cannot import {attr!r} from {module!r}: the module has no "
                                  f"such name{did_you_mean(attr, [a for a in vars(found) if not a.startswith('_')])}")
            return self._classes.get(name) or self.register(name)(getattr(found, attr))
        parts = name.split(".")
        imported: list[str] = []
        if len(parts) > 1 and parts[0] != "looplab":
            for i in range(len(parts), 0, -1):
                module = ".".join(parts[:i])
                try:
                    _import_variant_module(module)
                except ImportError as e:
                    if _is_missing(module, e):
                        continue  # this prefix is not a module: try a shorter one
                    # the module exists and failed inside: its own import error, in one line (the traceback goes to
                    # the log: cli_errors), not "unknown"
                    raise VariantImportError(self._raised(name, _raising_module(module, e), e)) from e
                imported.append(module)
                if name in self._classes:
                    return self._classes[name]
        _load_entry_points()
        if name in self._classes:
            return self._classes[name]
        if len(parts) > 1 and parts[0] != "looplab":
            if not imported:
                raise VariantImportError(self._not_found(name, parts[0]))
            raise self._unknown(name, tuple(imported))
        return None

    def _not_found(self, name: str, module: str) -> str:
        top = module.split(".")[0]
        path = os.environ.get("PYTHONPATH")
        where = f"PYTHONPATH={path}" if path else "PYTHONPATH is not set"
        return (f"{self.named}={name!r}: module not found: no module named {top!r} on the import path ({where}; the "
                f"working directory is not searched); put the folder that holds {top}/ on PYTHONPATH or install the "
                "package (docs/extending.md#from-the-command-line)")

    def _raised(self, name: str, module: str, e: ImportError) -> str:
        return (f"{self.named}={name!r}: module {module!r} was found but raised {type(e).__name__} while importing: "
                f"{e}; install what it imports or fix its import")


class UntrustedVariantError(ConfigError):
    """A variant name read from a model names a package that is not trusted; nothing was imported."""


class VariantImportError(ConfigError):
    """A variant's module could not be imported: not found on the import path, or found but raising while importing
    (the original ImportError is the cause)."""


def refuse_as_config_error(check: Callable, *args) -> None:
    """Run a variant's input check (`validate`, `check_threshold`): a ValueError it raises refuses the input, as a
    ConfigError with its message, wherever the variant's module lives. A researcher's check that raises a plain
    ValueError is then reported as bad input in one line (looplab/cli_errors.py), not as a bug."""
    try:
        check(*args)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _raising_module(module: str, e: BaseException) -> str:
    """Which of `module` and the packages above it was executing when `e` was raised (importing a.b.c runs a, a.b,
    then a.b.c): the deepest frame of the traceback that belongs to one of them."""
    prefixes = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    found, tb = module, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") in prefixes:
            found = tb.tb_frame.f_globals["__name__"]
        tb = tb.tb_next
    return found


def _is_missing(module: str, e: ImportError) -> bool:
    """Whether `module` (or a package above it) is itself what cannot be found, rather than something it imports."""
    return (isinstance(e, ModuleNotFoundError) and e.name is not None
            and (module == e.name or module.startswith(e.name + ".")))


class UnknownOptionError(ConfigError):
    """Options a variant does not declare: `where` (the variant, as the config names it), `unknown` (the keys given),
    `known` (its Options' fields) and `axis` (the config's options axis, once LoopedLMConfig knows it), so a front
    end can name the keys as its user typed them."""

    def __init__(self, where: str, unknown: list[str], known: list[str], axis: str | None = None):
        if known:
            text = f"{where}: unknown option(s) {unknown}; its options: {known}{did_you_mean(unknown, known)}"
        else:
            text = f"{where} takes no options, got {unknown}"
        super().__init__(text)
        self.where, self.unknown, self.known, self.axis = where, unknown, known, axis


# ------------------------------------------------------------------ trust (docs/training.md#what-looplab-trusts)
TRUST_ENV = "LOOPLAB_TRUST_VARIANTS"
_TRUSTED: set[str] = set()
# where the names being resolved come from, when it is a model (None: the user typed them)
_UNTRUSTED_SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("looplab_names_from", default=None)


def trust_variants(*packages: str) -> None:
    """Let names read from models import these top-level packages (`--trust-variants PKG`)."""
    for p in packages:
        for name in str(p).split(","):
            if name.strip():
                _TRUSTED.add(name.strip())


def trusted_packages() -> set[str]:
    """The packages trusted in this process: trust_variants(...) and LOOPLAB_TRUST_VARIANTS."""
    env = {p.strip() for p in os.environ.get(TRUST_ENV, "").split(",") if p.strip()}
    return _TRUSTED | env


@contextlib.contextmanager
def names_from(source: str):
    """Resolve variant names as read from a model (`source` names it in refusals): no module is imported for them
    unless its package is trusted. Nested uses keep the outermost source."""
    token = _UNTRUSTED_SOURCE.set(_UNTRUSTED_SOURCE.get() or source)
    try:
        yield
    finally:
        _UNTRUSTED_SOURCE.reset(token)


def _import_variant_module(module: str):
    """importlib.import_module without the working directory on sys.path: `python -m` puts it first, and a model's
    folder is often where one works (a `.py` shipped beside the model would be imported as the variant)."""
    if module in sys.modules:
        return sys.modules[module]
    from_env = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    cwd = os.getcwd()
    implicit = [p for p in sys.path if (p in ("", ".") or os.path.abspath(p) == cwd) and os.path.abspath(p or ".") not in from_env]
    if not implicit:
        return importlib.import_module(module)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in implicit]
    try:
        importlib.invalidate_caches()
        return importlib.import_module(module)
    finally:
        # keep whatever the import added (a .pth, a plugin) and put the implicit entries back where they were
        added = [p for p in sys.path if p not in saved]
        sys.path[:] = saved + added


def import_variant_modules(*modules: str) -> None:
    """Import modules that register variants, as a dotted variant name's module is imported (the user named them:
    their packages are trusted for the process), then the `looplab.variants` entry points. A module that cannot be
    imported is refused in one line: not found, or found but raising ImportError."""
    for module in modules:
        _TRUSTED.add(module.split(".")[0])
        try:
            _import_variant_module(module)
        except ImportError as e:
            what = ("module not found" if _is_missing(module, e)
                    else f"found but raised {type(e).__name__} while importing")
            raise VariantImportError(f"--import {module}: {what}: {e} (PYTHONPATH="
                                     f"{os.environ.get('PYTHONPATH', '')!r}; the working directory is not searched)"
                                     ) from e
    _load_entry_points()


def _same_class(a: type, b: type) -> bool:
    """A module imported twice (e.g. as a script and as a module) registers an equal class twice."""
    return a.__module__ == b.__module__ and a.__qualname__ == b.__qualname__


_ENTRY_POINTS_LOADED = False


def _load_entry_points() -> None:
    """Import every module of the `looplab.variants` entry-point group once (each registers its variants)."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points

    for ep in entry_points(group="looplab.variants"):
        ep.load()


def _registry_name(reg: Registry) -> str:
    for name, value in globals().items():
        if value is reg:
            return name
    return "Registry"


def named_option(key: str, value) -> str:
    """An option as an error names it: a dataclass by the fields set (ExitPolicy(threshold=0.5, skip='kv_copy'))."""
    if dataclasses.is_dataclass(value):
        set_ = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None and getattr(value, f.name) != f.default]
        return f"{key}={type(value).__name__}({', '.join(set_)})"
    return f"{key}={value!r}"


def option_values(cls: type, given: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """A variant's options as given, checked against its `Options` dataclass: unknown keys are refused naming them;
    values equal to their defaults are dropped (so setting a default never changes the architecture hash)."""
    given = dict(given or {})
    opts = getattr(cls, "Options", None)
    if opts is None:
        if given:
            raise UnknownOptionError(where, sorted(given), [])
        return {}
    known = {f.name: f for f in dataclasses.fields(opts)}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UnknownOptionError(where, unknown, sorted(known))
    try:
        defaults = opts()
    except TypeError as e:
        raise ConfigError(f"{where}: its Options need defaults for every field ({e})") from None
    return {k: v for k, v in given.items() if v != getattr(defaults, k)}


def close_matches(given, choices, n: int = 1) -> list[str]:
    """The `choices` closest to each given name (a typo's fix), without repeats."""
    given = [given] if isinstance(given, str) else list(given)
    return list(dict.fromkeys(m for g in given for m in difflib.get_close_matches(g, list(choices), n=n, cutoff=0.6)))


def did_you_mean(given, choices, prefix: str = "") -> str:
    """" (did you mean x?)" naming the closest of `choices` to the given names (each after `prefix`), or ""."""
    close = close_matches(given, choices)
    return f" (did you mean {' or '.join(prefix + c for c in close)}?)" if close else ""


def options_of(cls: type, values: dict[str, Any] | None):
    """The variant's Options instance (None when it declares none)."""
    opts = getattr(cls, "Options", None)
    return None if opts is None else opts(**(values or {}))


# ------------------------------------------------------------------ the registries
BACKBONES: Registry = Registry("backbone", "backbone")
LAYERS: Registry = Registry("layer", "hybrid_pattern letter")
STATE_UPDATES: Registry = Registry("state update", "state_mode")
STATE_MIXERS: Registry = Registry("state mixer", "state_mixer")
EXIT_GATES: Registry = Registry("exit gate", "exit_gate")
INJECTIONS: Registry = Registry("injection", "injection", "loop_depth.injection")
EXIT_RULES: Registry = Registry("exit rule", "exit_rule")
HANDLINGS: Registry = Registry("skip handling", "skip_compute")
DEPTH_ROUTERS: Registry = Registry("depth router", "depth_router")
LOOP_SCHEDULES: Registry = Registry("loop schedule", "loop_schedule", "loop_depth.schedule")

REGISTRIES = {"backbone": BACKBONES, "layer": LAYERS, "state_update": STATE_UPDATES, "state_mixer": STATE_MIXERS,
              "exit_gate": EXIT_GATES, "injection": INJECTIONS, "exit_rule": EXIT_RULES, "handling": HANDLINGS,
              "depth_router": DEPTH_ROUTERS, "loop_schedule": LOOP_SCHEDULES}


# ------------------------------------------------------------------ what combines with what (docs/extending.md)
TABLE_FEATURES = ("compile", "speculation", "exits", "depthwise", "parallel_loops", "routing", "test_depth", "export")


def capability_table(builtins_only: bool = True) -> str:
    """The docs' tables of what each registered variant declares (looplab's own by default): model parts (✓, or ✗
    with the reason listed under the table), then exit rules (what they read) and skip handlings (the cache entries
    they fill)."""
    head = ["axis", "variant", "cache", *TABLE_FEATURES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for axis, reg in REGISTRIES.items():
        if reg in (EXIT_RULES, HANDLINGS):
            continue
        for name, cls in reg.items():
            if builtins_only and not cls.__module__.startswith("looplab."):
                continue
            sup = cls.supports
            cells = []
            for f in TABLE_FEATURES:
                why = sup.why_not(f)
                if why is None:
                    cells.append("✓")
                else:
                    notes.append(f"{axis} `{name}`, {f}: {why}")
                    cells.append(f"✗ [{len(notes)}]")
            lines.append(f"| {axis} | `{name}` | {sup.cache or '—'} | " + " | ".join(cells) + " |")
    lines += [""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)]
    lines += ["", "| exit rule | reads | example thresholds |", "|---|---|---|"]
    own = (lambda c: c.__module__.startswith("looplab.")) if builtins_only else (lambda c: True)
    lines += [f"| `{n}` | {c.reads} | {', '.join(f'{t:g}' for t in c.example_thresholds)} |"
              for n, c in EXIT_RULES.items() if own(c)]
    lines += ["", "| skip handling | fills the cache entries of kind |", "|---|---|"]
    lines += [f"| `{n}` | {', '.join(sorted(c.fills))} |" for n, c in HANDLINGS.items() if own(c)]
    return "\n".join(lines)


# ------------------------------------------------------------------ the built-ins, by module path
def _builtins() -> None:
    m = "looplab.models"
    for name, cls in (("llama", "Llama"), ("mamba2", "Mamba2"), ("hybrid", "Hybrid")):
        BACKBONES.lazy(name, f"{m}.backbone:{cls}")
    LAYERS.lazy("A", f"{m}.llama:AttentionLayer")
    LAYERS.lazy("M", f"{m}.mamba2:Mamba2Layer")
    for name, cls in (("vanilla", "NoState"), ("stateloop", "SelectiveState"), ("stateloop_reset", "ResetState")):
        STATE_UPDATES.lazy(name, f"{m}.state:{cls}")
    STATE_UPDATES.lazy("gru", f"{m}.state_gru:GRUState")
    # the two axes' historical names: every committed config, checkpoint and table keeps them
    STATE_UPDATES.alias("stateloop_attn", ("stateloop", "attn"))
    STATE_UPDATES.alias("stateloop_mamba2", ("stateloop", "mamba2"))
    for name, cls in (("none", "NoMixer"), ("attn", "AttentionMixer"), ("mamba2", "Mamba2StateMixer")):
        STATE_MIXERS.lazy(name, f"{m}.state:{cls}")
    EXIT_GATES.lazy("none", f"{m}.exit_gate:NoExitGate")
    EXIT_GATES.lazy("ouro", f"{m}.exit_gate:ExitGate")
    for name, cls in (("none", "NoInjection"), ("add", "AddInjection"), ("concat", "ConcatInjection"),
                      ("diag", "DiagInjection")):
        INJECTIONS.lazy(name, f"{m}.injection:{cls}")
    for name, cls in (("gate", "GateRule"), ("kl", "KLRule"), ("entropy", "EntropyRule"),
                      ("hidden_delta", "HiddenDeltaRule"), ("argmax_stable", "ArgmaxStableRule")):
        EXIT_RULES.lazy(name, f"{m}.exit_rules:{cls}")
    for name, cls in (("kv_copy", "KVCopy"), ("ssm_skip", "SSMSkip"), ("ssm_propagate", "SSMPropagate")):
        HANDLINGS.lazy(name, f"{m}.exit_compute:{cls}")
    for name, cls in (("none", "NoRouter"), ("expert_choice", "ExpertChoiceRouter"),
                      ("token_choice", "TokenChoiceRouter")):
        DEPTH_ROUTERS.lazy(name, f"{m}.router:{cls}")
    LOOP_SCHEDULES.lazy("sequential", f"{m}.schedule:Sequential")
    LOOP_SCHEDULES.lazy("parallel", f"{m}.parallel:Parallel")


_builtins()

