"""The conformance kit: looplab's contract tests, run on any registered variant (docs/extending.md#the-conformance-kit).

A researcher points it at their own variant, registered in their own module:

    from looplab.testing.conformance import parametrize_checks

    @parametrize_checks(("state_update", "my_pkg.gru"), ("exit_rule", "my_pkg.rules.margin"))
    def test_my_variants(check):
        assert check() > 0  # how many comparisons and refusals it verified

and looplab's own tests run every built-in variant through the same checks (tests/test_conformance.py:
`parametrize_checks(*builtin_variants())`), so a built-in is tested exactly as a user's would be.

Each check builds tiny one-thread models that put the variant in the contexts its axis calls for (every
state update with an exit gate, prelude/coda and GQA, on a hybrid block, with a mixer; ...), and checks,
against what the variant DECLARES (models/registry.py Supports):

    init_equivalence   an untrained state update / mixer / injection computes the model without it (W_o = 0)
    no_look_ahead      an exit rule's decision after loop t does not change when loops t+1..R change
    cached_decoding    greedy decoding from the caches equals full forwards over each row alone, in a left-padded
                       batch, plain and with the exit read-out (a gate, or the rule under test)
    prefill            a prefill and single steps give every loop's logits (and exit distribution) of a forward
    test_time_depth    R′ = R − 1 and R + 1 decode as forwards at R′ do
    skip:<handling>    exits that skip compute equal their reference (exit_compute.forward_with_exits), for each
                       skip handling that can fill the model's cache entries
    speculation        greedy self-speculative decoding gives plain decoding's tokens
    serving            the engine's lockstep and depth-wise schedules give each request its solo tokens
    checkpoint         a checkpoint and a hub folder load back with the same logits and architecture hash
    export             the transformers remote-code folder gives looplab's logits
    compile            a compiled decoding step (Dynamo, eager backend) gives plain decoding's tokens
    parallel_loops     under loop_schedule=parallel it decodes as its forward
    routing            under a depth router it decodes as its causal forward

A failing check names the contract it checks and where a variant usually breaks it (`CONTRACTS`), as
scikit-learn's check_estimator does. A capability the variant declares unsupported is checked as a refusal instead:
the entry point must refuse it, naming the variant. A capability refused by another part of the context is not this
variant's business and is skipped. Nothing here needs pytest except `parametrize_checks`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from looplab.models.registry import EXIT_RULES, HANDLINGS, REGISTRIES, STATE_UPDATES

V = 61
ATOL, RTOL = 3e-5, 1e-4
TINY = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=3, max_seq_len=64, d_state=8, headdim=16,
            chunk_size=4, kernel="torch", hybrid_pattern="MA")
AXES = ("backbone", "layer", "state_update", "state_mixer", "exit_gate", "injection", "exit_rule", "handling",
        "depth_router", "loop_schedule")


# ------------------------------------------------------------------ contexts
@dataclass
class Context:
    """One model that exercises the variant: its config kwargs, and the exit rule / handling under test."""

    name: str
    config: dict[str, Any]
    rule: str | None = None  # the exit rule the exit checks use (None: the gate, when the model has one)
    handling: str | None = None  # the handling under test (axis handling), else every applicable one

    def build(self, seed: int = 0, damp: float | None = None):
        """The model, with every part made to matter: small random perturbations of every parameter (W_o, the
        injection and the gate are neutral at init), the gate spread so that tokens exit at mixed depths."""
        from looplab.models import LoopedLM, LoopedLMConfig

        torch.manual_seed(seed)
        model = LoopedLM(LoopedLMConfig(**self.config)).eval()
        g = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
                if damp is not None and name.startswith("block.") and name.endswith(("out_proj.weight",
                                                                                     "down_proj.weight")):
                    p.mul_(damp)
            # sharper logits: drafts agree often but not always, and a rule on the next-token distribution (entropy,
            # KL) sees it vary from token to token (a random model's is near-uniform everywhere)
            model.head.weight.mul_(4)
            if model.exit_gate is not None:  # logits of std ≈ 1 around −0.3: mixed exit depths at q = 0.5
                proj = model.exit_gate.proj
                proj.weight.normal_(0, 1 / model.config.d_model ** 0.5, generator=g)
                proj.bias.fill_(-0.3)
        return model

    @property
    def gated(self) -> bool:
        return self.config.get("exit_gate", "none") != "none" or self.rule is not None


def _with(base: dict, **kw) -> dict:
    return {**TINY, **base, **kw}


def variant_config(axis: str, name: str) -> dict[str, Any]:
    """The config kwargs that select variant `name` on `axis`."""
    if axis == "backbone":
        return {"backbone": name}
    if axis == "layer":
        return {"backbone": "hybrid", "hybrid_pattern": name if name == "A" else f"{name}A"}
    if axis == "state_update":
        return {"state_mode": name}
    if axis == "state_mixer":
        return {"state_mode": "stateloop", "state_mixer": name}
    if axis == "exit_gate":
        return {"exit_gate": name}
    if axis == "injection":
        return {"injection": name}
    if axis == "depth_router":
        return {"depth_router": name}
    if axis == "loop_schedule":
        return {"loop_schedule": name}
    if axis in ("exit_rule", "handling"):
        return {}
    raise ValueError(f"axis={axis!r} is unknown; choose one of {AXES}")


def contexts(axis: str, name: str) -> list[Context]:
    """The models that exercise a variant: the first one runs every check, the others the decoding checks."""
    v = variant_config(axis, name)
    gate = {"exit_gate": "ouro"}
    if axis == "state_update":
        cls = STATE_UPDATES.get(name)
        out = [Context("llama+gate+prelude+coda+gqa", _with(v, **gate, prelude_layers=1, coda_layers=1, n_kv_heads=2)),
               Context("hybrid+gate", _with(v, **gate, backbone="hybrid"))]
        if cls.builds_state:
            out.append(Context("llama+attn-mixer", _with(v, state_mixer="attn")))
        return out
    if axis == "state_mixer":
        return [Context("llama+gate", _with(v, **gate)), Context("hybrid+gate", _with(v, **gate, backbone="hybrid"))]
    if axis in ("backbone", "layer"):
        return [Context("gate", _with(v, **gate)),
                Context("stateloop+prelude+coda", _with(v, state_mode="stateloop", prelude_layers=1, coda_layers=1))]
    if axis == "exit_gate":
        return [Context("llama+stateloop", _with(v, state_mode="stateloop")), Context("hybrid", _with(v, backbone="hybrid"))]
    if axis == "injection":
        return [Context("llama+stateloop+gate", _with(v, state_mode="stateloop", **gate)),
                Context("mamba2", _with(v, backbone="mamba2"))]
    if axis == "exit_rule":
        rule = EXIT_RULES.get(name)
        g = gate if rule.reads == "exit_probs" else {}
        return [Context("llama", _with(g), rule=name), Context("hybrid+stateloop", _with(g, backbone="hybrid",
                                                                                      state_mode="stateloop"), rule=name)]
    if axis == "handling":
        fills = HANDLINGS.get(name).fills
        out = [Context("llama+stateloop+gate", _with({}, state_mode="stateloop", **gate), handling=name)]
        if "ssm" in fills:
            out.append(Context("hybrid+gate", _with({}, backbone="hybrid", **gate), handling=name))
        return out
    if axis == "depth_router":
        return [Context("llama", _with(v)), Context("llama+stateloop", _with(v, state_mode="stateloop"))]
    if axis == "loop_schedule":
        return [Context("llama", _with(v)), Context("llama+prelude+coda", _with(v, prelude_layers=1, coda_layers=1))]
    raise ValueError(f"axis={axis!r} is unknown; choose one of {AXES}")


# ------------------------------------------------------------------ helpers
def left_padded(lengths=(3, 7, 5), seed: int = 3):
    """(ids (B, T) left-padded with 0, mask (B, T), the prompts)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(T - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    return ids, mask, prompts


def _forward_kwargs(model) -> dict:
    """What a cache-free forward needs to compute what decoding computes: a router routes each token on its own."""
    return {"depths": "inference"} if getattr(model, "router", None) is not None else {}


def example_threshold(model, rule: str, prompt: torch.Tensor, min_loops: int = 1) -> float:
    """The rule's example threshold (ExitRule.example_thresholds) at which the prompt's exits are most mixed."""
    from looplab.models.exit_rules import first_exit, get_rule

    cls = get_rule(rule)
    candidates = tuple(getattr(cls, "example_thresholds", ()) or ())
    if not candidates:
        raise AssertionError(f"exit rule {rule!r} declares no example_thresholds: the kit cannot pick one that makes "
                             "tokens exit at mixed depths")
    with torch.no_grad():
        out = model(prompt, return_all_loops=True)
    R = out.loop_logits.shape[0]
    best, score = candidates[0], -1.0
    for q in candidates:
        steps = first_exit(rule, q, R, min_loops=min_loops, logits=out.loop_logits, hidden=out.loop_hidden,
                           exit_probs=out.exit_probs)
        early = float((steps < R).float().mean())
        s = min(early, 1 - early) + 0.1 * len(steps.unique())
        if s > score:
            best, score = q, s
    return best


def _exits(ctx: Context, model, prompt, skip=None):
    from looplab.models.exits import ExitPolicy

    if not ctx.gated:
        return None
    rule = ctx.rule
    q = example_threshold(model, rule or "gate", prompt)
    return ExitPolicy(threshold=q, rule=rule, skip=skip)


def _refused(feature: str, variant_cls, cfg) -> str | None:
    """The variant's own refusal of `feature` ("where: reason"); "other" when only other parts of the model refuse it;
    None when the model supports it."""
    own = None
    for where, cls in cfg.variants():
        reason = cls.capabilities(cfg).why_not(feature)
        if reason and cls is variant_cls:
            own = f"{where}: {reason}"
    if own is not None:
        return own
    return "other" if cfg.unsupported(feature) else None


class Skip(Exception):
    """This check does not apply to this variant in this context (pytest reports it as skipped)."""


# How many comparisons and refusals the running check verified: Check() returns it, so a check that passes having
# compared nothing (an early return in a kit function) shows as 0 rather than as a pass.
_verified = [0]


def _require(ok, msg=None) -> None:
    """The kit's assertion (counted; unlike `assert`, not stripped by python -O)."""
    _verified[0] += 1
    if not ok:
        raise AssertionError(msg if msg is not None else "conformance check failed")


def _close(got, want, **tolerance) -> None:
    """torch.testing.assert_close, counted."""
    _verified[0] += 1
    torch.testing.assert_close(got, want, **tolerance)


def _expect_refusal(fn: Callable, where: str, exc=(ValueError,)) -> None:
    """fn must raise, naming the variant (the `where` label of LoopedLMConfig.variants())."""
    try:
        fn()
    except exc as e:
        _require(where.split(":")[0] in str(e), f"refused, but without naming {where.split(':')[0]!r}: {e}")
        return
    raise AssertionError(f"expected a refusal naming {where.split(':')[0]!r}; nothing was refused")


# ------------------------------------------------------------------ the checks
@torch.no_grad()
def check_init_equivalence(ctx: Context, variant) -> None:
    """An untrained state update, mixer or injection computes the model without it (W_o = 0, the identity injection),
    and a checkpoint of the model without it loads with strict=False, missing exactly the variant's parameters."""
    from looplab.models import LoopedLM, LoopedLMConfig

    axis, name = variant
    neutral, prefix = NEUTRAL[axis]
    ids, mask, _ = left_padded()
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(**ctx.config)).eval()
    torch.manual_seed(1)
    base = LoopedLM(LoopedLMConfig(**{**ctx.config, **neutral})).eval()
    # a checkpoint without the variant warm-starts it: the missing keys are exactly the variant's own parameters
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    _require(not unexpected, f"the model without {axis}={name} has parameters this one lacks: {unexpected}")
    _require(missing and all(k.startswith(prefix) for k in missing), (prefix, missing))
    got = model(ids, attention_mask=mask, return_all_loops=True)
    want = base(ids, attention_mask=mask, return_all_loops=True)
    _close(got.loop_logits, want.loop_logits, atol=1e-5, rtol=1e-5)


# the axes whose variants start out computing the model without them: (the neutral choice, the state-dict prefix of
# the variant's own parameters)
NEUTRAL = {"state_update": ({"state_mode": "vanilla", "state_mixer": None}, "state."),
           "state_mixer": ({"state_mixer": "none"}, ("state.mixer.", "state.mixer_norm.")),
           "injection": ({"injection": "none"}, "inject.")}


def _recompute(model, prompt: torch.Tensor, tokens: torch.Tensor, exits=None, n_loops=None) -> torch.Tensor:
    """Reference: logits (n, V) of a full forward over the prefix before each of `tokens`, for one prompt (1, T)."""
    seq = torch.cat([prompt, tokens[None, :-1]], 1)
    out = model(seq, exits=exits, n_loops=n_loops, **_forward_kwargs(model))
    return out.logits[0, prompt.shape[1] - 1:]


@torch.no_grad()
def check_cached_decoding(ctx: Context, variant, n_loops: int | None = None) -> None:
    """Greedy decoding from the caches equals a full forward over each row's prefix, in a left-padded batch; with an
    exit (the gate or the rule under test) read out at each token's depth too."""
    from looplab.models.exits import ExitPolicy
    from looplab.models.generation import generate

    model = ctx.build()
    ids, mask, prompts = left_padded()
    T, n = ids.shape[1], 5
    policies = [None]
    if ctx.gated and model.config.unsupported("exits") is None:
        ex = _exits(ctx, model, ids)
        policies.append(ExitPolicy(threshold=ex.threshold, rule=ex.rule))
    for exits in policies:
        out = generate(model, ids, n, attention_mask=mask, return_logits=True, exits=exits, n_loops=n_loops)
        for i, p in enumerate(prompts):
            new = out.sequences[i, T:]
            want = _recompute(model, p[None], new, exits=exits, n_loops=n_loops)
            _close(out.logits[i], want, atol=ATOL, rtol=RTOL)
            _require(torch.equal(new, want.argmax(-1)), f"row {i}: cached tokens differ from the recomputed argmax")


@torch.no_grad()
def check_prefill(ctx: Context, variant) -> None:
    """A prefill of T tokens and k single steps give every loop's logits (and the exit distribution) of one forward."""
    model = ctx.build()
    if not model.schedule.sequential:
        raise Skip("a non-sequential schedule reads the last loop only from a cache")
    T, k = 9, 4  # T > chunk_size: the chunked SSD prefill crosses chunk boundaries
    ids = torch.randint(0, V, (2, T + k), generator=torch.Generator().manual_seed(2))
    kw = _forward_kwargs(model)
    full = model(ids, return_all_loops=True, **kw)
    cache = model.allocate_cache(2, T + k)
    pre = model(ids[:, :T], cache=cache, return_all_loops=True)
    _close(pre.loop_logits, full.loop_logits[:, :, :T], atol=ATOL, rtol=RTOL)
    for i in range(k):
        step = model(ids[:, T + i:T + i + 1], cache=cache, return_all_loops=True)
        _close(step.loop_logits[:, :, 0], full.loop_logits[:, :, T + i], atol=ATOL, rtol=RTOL)
        if full.exit_probs is not None:
            _close(step.exit_probs[:, 0], full.exit_probs[:, T + i], atol=ATOL, rtol=RTOL)
    _require(cache.lengths.tolist() == [T + k] * 2)


def check_test_time_depth(ctx: Context, variant) -> None:
    """R′ = R − 1 and R + 1: cached decoding equals forwards at R′."""
    cfg = ctx.build().config
    where = _refused("test_depth", _variant_cls(variant), cfg)
    if where == "other":
        raise Skip("another part of the model refuses test-time depth")
    if where is not None:
        _expect_refusal(lambda: ctx.build()(torch.zeros(1, 3, dtype=torch.long), n_loops=cfg.n_loops + 1), where)
        return
    for r in (cfg.n_loops - 1, cfg.n_loops + 1):
        check_cached_decoding(ctx, variant, n_loops=r)
    model = ctx.build()
    ids = torch.randint(1, V, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # and it really is another depth
        _require(not torch.allclose(model(ids, **_forward_kwargs(model)).logits,
                                    model(ids, n_loops=cfg.n_loops + 1, **_forward_kwargs(model)).logits, atol=1e-4))


def _applicable_handlings(cfg) -> list[str]:
    kinds = cfg.cache_kinds()
    return [h for h in HANDLINGS.names() if kinds <= HANDLINGS.get(h).fills]


@torch.no_grad()
def check_skip(ctx: Context, variant, handling: str) -> None:
    """Exits that skip compute equal the frozen-input reference at the exits decoding chose, in a left-padded batch."""
    from looplab.models.generation import generate

    model = ctx.build(seed=1)
    cfg, R = model.config, model.config.n_loops
    if not ctx.gated:
        raise Skip("no exit gate and no exit rule under test")
    ids, mask, _ = left_padded()
    where = cfg.unsupported("exits")
    if where is not None:
        raise Skip(f"exits refused here ({where})")
    exits = _exits(ctx, model, ids, skip=handling)
    out = generate(model, ids, 8, attention_mask=mask, return_logits=True, exits=exits)
    _require(bool((out.exit_steps < R).any()) and len(out.exit_steps.unique()) > 1,
             f"exits were meant to be mixed (threshold {exits.threshold}): {out.exit_steps.tolist()}")
    _, want = skip_reference(model, out, ids, mask, exits)
    _close(out.logits, want, atol=ATOL, rtol=RTOL)


def skip_reference(model, out, prompt, mask, exits):
    """What the cache-free reference (forward_with_exits) gives for the tokens that `generate(exits=exits)` with a
    skip handling produced → (its output, the logits at each generated position (B, n, V)). The prompt's tokens stop
    at their exits as the prefill decides them (online, from their own loops); each generated token at the exit step
    decoding chose (given, so a decision within rounding of the threshold cannot flip between the two)."""
    from looplab.models.exit_compute import forward_with_exits
    from looplab.models.exit_gate import logits_at_depth

    B, T = prompt.shape
    n = out.logits.shape[1]
    online = forward_with_exits(model, prompt, None, exits.skip, attention_mask=mask, rule=exits.rule_name,
                                threshold=exits.threshold, min_loops=exits.min_loops)
    prompt_steps = online.exit_steps
    _require(torch.equal(prompt_steps[:, -1], out.exit_steps[:, 0]),
             f"the prompt's last token exits at {out.exit_steps[:, 0].tolist()} in the prefill, at "
             f"{prompt_steps[:, -1].tolist()} in the reference")
    fed = out.sequences[:, :T + n - 1]  # the prompt, then every generated token but the last
    compute = torch.cat([prompt_steps, out.exit_steps[:, 1:]], 1)
    m = None if mask is None else torch.cat([mask, torch.ones(B, n - 1, dtype=mask.dtype)], 1)
    ref = forward_with_exits(model, fed, compute, exits.skip, attention_mask=m)
    return ref, logits_at_depth(ref.loop_logits, compute)[:, T - 1:]


@torch.no_grad()
def check_speculation(ctx: Context, variant) -> None:
    """Greedy self-speculative decoding gives plain decoding's tokens (rows keeping different numbers of drafts)."""
    from looplab.models.generation import Speculation, generate

    model = ctx.build(damp=0.3)
    where = _refused("speculation", _variant_cls(variant), model.config)
    if where == "other":
        raise Skip("another part of the model refuses speculation")
    ids, mask, _ = left_padded()
    spec = Speculation(loops=1, draft_tokens=2)
    if where is not None:
        _expect_refusal(lambda: generate(model, ids, 4, attention_mask=mask, speculation=spec), where)
        return
    plain = generate(model, ids, 8, attention_mask=mask, return_logits=True)
    accepted = 0
    for spec in (Speculation(loops=1, draft_tokens=2), Speculation(loops=model.config.n_loops - 1, draft_tokens="auto")):
        out = generate(model, ids, 8, attention_mask=mask, speculation=spec, return_logits=True)
        _require(torch.equal(out.sequences, plain.sequences), f"{spec} changed the greedy tokens")
        _close(out.logits, plain.logits, atol=ATOL, rtol=RTOL)
        accepted += out.speculation.accepted
        alone = generate(model, ids[1:2], 8, speculation=spec)  # batch 1: the longest prompt, no padding
        _require(torch.equal(alone, plain.sequences[1:2]))
    _require(accepted > 0, "no draft token was ever accepted: the accepting paths went untested")


@torch.no_grad()
def check_serving(ctx: Context, variant) -> None:
    """The engine's lockstep and depth-wise schedules give each request (joining and leaving mid-run) its solo tokens."""
    from looplab.serve import Engine, solo_agreement

    model = ctx.build()
    _, _, prompts = left_padded()
    for schedule in ("lockstep", "depthwise"):
        exits = _exits(ctx, model, torch.stack([prompts[1]]))
        if schedule == "depthwise" and exits is not None:
            handlings = _applicable_handlings(model.config)
            exits = None if not handlings else _exits(ctx, model, prompts[1][None], skip=handlings[0])
        if exits is not None and model.config.unsupported("exits") is not None:
            exits = None
        make = lambda: Engine(model, max_batch=2, max_len=32, exits=exits, schedule=schedule)  # noqa: E731
        if schedule == "depthwise":
            where = _refused("depthwise", _variant_cls(variant), model.config)
            if where is None and model.router is not None:
                where = _refused("depthwise_routed", _variant_cls(variant), model.config)
            if where == "other":
                continue
            if where is not None:
                _expect_refusal(make, where)
                continue
        engine = make()
        reqs = [engine.add(p, n) for p, n in zip(prompts, (4, 6, 5))]
        engine.run()
        agree = solo_agreement(model, reqs, exits=exits)
        _require(agree["equal"] + agree["ties"] == len(reqs), f"{schedule}: {agree['differences']}")


@torch.no_grad()
def check_checkpoint(ctx: Context, variant) -> None:
    """A checkpoint and a hub folder load back with the same logits, config and architecture hash."""
    from looplab.checkpoint import architecture_hash, load_model, looplab_meta
    from looplab.models import LoopedLM, LoopedLMConfig

    model = ctx.build()
    cfg = model.config
    _require(LoopedLMConfig.from_dict(cfg.to_dict()) == cfg)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(5))
    want = model(ids, **_forward_kwargs(model)).logits
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "last.ckpt"
        torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                    "looplab": looplab_meta(cfg, {})}, path)
        back, meta = load_model(path)
        _require(meta["architecture_hash"] == architecture_hash(back.config) == architecture_hash(cfg))
        _require(torch.equal(back.eval()(ids, **_forward_kwargs(back)).logits, want))
        model.save_pretrained(Path(tmp) / "folder")
        folder = LoopedLM.from_pretrained(str(Path(tmp) / "folder")).eval()
        _require(folder.config.architecture_dict() == cfg.architecture_dict())
        _require(torch.equal(folder(ids, **_forward_kwargs(folder)).logits, want))


@torch.no_grad()
def check_export(ctx: Context, variant) -> None:
    """The transformers remote-code folder gives looplab's logits (a folder that ships a variant's own export code:
    also in a process where looplab is not importable); an unexportable variant is refused by name."""
    from looplab import convert
    from looplab.checkpoint import looplab_meta

    model = ctx.build()
    where = _refused("export", _variant_cls(variant), model.config)
    if where == "other":
        raise Skip("another part of the model is not exported")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "last.ckpt"
        torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                    "looplab": looplab_meta(model.config, {})}, path)
        if where is not None:
            _expect_refusal(lambda: convert.to_hf(str(path), Path(tmp) / "hf", log=lambda *a: None), where,
                            exc=(convert.ConversionError, ValueError))
            return
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise Skip("transformers is not installed (looplab's eval extra)") from None
        convert.to_hf(str(path), Path(tmp) / "hf", log=lambda *a: None)
        hf = AutoModelForCausalLM.from_pretrained(str(Path(tmp) / "hf"), trust_remote_code=True).eval()
        ids, mask, _ = left_padded()
        got = hf(input_ids=ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
        real = mask.bool()
        _close(got[real], want[real], atol=1e-4, rtol=1e-4)
        if json.loads((Path(tmp) / "hf" / "config.json").read_text()).get("looplab_variants"):
            # the folder ships a variant's own export code: it must stand alone, where looplab is not importable
            from looplab.testing.without_looplab import logits_without_looplab

            got = logits_without_looplab(Path(tmp) / "hf", ids, mask)
            _close(got[real], want[real], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def check_compile(ctx: Context, variant) -> None:
    """A compiled decoding step (Dynamo with the eager backend: the graph capture, without inductor's codegen) gives
    plain decoding's tokens; an uncompilable variant is refused by name."""
    from looplab.models import generation

    model = ctx.build()
    where = _refused("compile", _variant_cls(variant), model.config)
    if where == "other":
        raise Skip("another part of the model refuses compile")
    ids = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(6))
    if where is not None:
        _expect_refusal(lambda: generation.generate(model, ids, 3, compile=True), where)
        return
    old = generation.COMPILE_BACKEND
    generation.COMPILE_BACKEND = "eager"
    try:
        got = generation.generate(model, ids, 4, compile=True)
    finally:
        generation.COMPILE_BACKEND = old
        torch._dynamo.reset()
    _require(torch.equal(got, generation.generate(model, ids, 4)))


def _in_context(feature: str, change: dict) -> Callable:
    def check(ctx: Context, variant) -> None:
        from looplab.models import LoopedLMConfig
        from looplab.models.registry import ConfigError

        cfg = LoopedLMConfig(**ctx.config)
        where = _refused(feature, _variant_cls(variant), cfg)
        new = {**ctx.config, **change, **variant_config(*variant)}  # the variant itself stays
        if where not in (None, "other"):
            _expect_refusal(lambda: LoopedLMConfig(**new), where, exc=(ConfigError,))
            return
        try:
            LoopedLMConfig(**new)
        except ConfigError as e:
            raise Skip(f"{feature} is refused by another part of this context: {e}") from None
        check_cached_decoding(Context(f"{ctx.name}+{feature}", new), variant)
    check.__doc__ = f"Under {change}, it decodes as its forward; a variant that declares no {feature} is refused by name."
    return check


@torch.no_grad()
def check_no_look_ahead(ctx: Context, variant) -> None:
    """An exit rule decides after loop t from loops 1..t only: with loops t+1..R of its input replaced by another
    model's, and with them cut off, every decision at t is the same (what the rule reads comes from a tiny model's
    forward on a left-padded batch, at each of the rule's example thresholds)."""
    from looplab.models.exit_rules import get_rule

    name = ctx.rule
    if name is None:
        raise Skip("no exit rule under test")
    cls = get_rule(name)
    ids, _, _ = left_padded()
    a, b = ctx.build(seed=0)(ids, return_all_loops=True), ctx.build(seed=7)(ids, return_all_loops=True)
    pick = {"exit_probs": lambda o: o.exit_probs, "logits": lambda o: o.loop_logits, "hidden": lambda o: o.loop_hidden}
    full, other = pick[cls.reads](a), pick[cls.reads](b)
    loops_last = cls.reads == "exit_probs"  # (..., R); the others are (R, ...)
    R = full.shape[-1] if loops_last else full.shape[0]
    for q in tuple(cls.example_thresholds) or (1.0,):
        cls.check_threshold(q)
        for t in range(1, R):
            if loops_last:
                later, cut = torch.cat([full[..., :t], other[..., t:]], -1), full[..., :t]
            else:
                later, cut = torch.cat([full[:t], other[t:]], 0), full[:t]
            want = cls.stops(t, q, full)
            for how, inputs in (("replaced by another model's", later), ("cut off", cut)):
                got = cls.stops(t, q, inputs)
                changed = int((got != want).sum())
                _require(changed == 0,
                         f"decisions after loop {t} of {R} changed for {changed} of {want.numel()} tokens when loops "
                         f"{t + 1}..{R} of its input were {how} (threshold {q}): the rule reads past loop t. "
                         f"In {cls.__qualname__}.stops(t, threshold, inputs) read loops 1..t only: "
                         + ("inputs[..., :t]" if loops_last else "inputs[:t] (inputs[t - 1] is loop t, "
                                                                  "inputs[-1] the last loop run)"))


check_parallel_loops = _in_context("parallel_loops", {"loop_schedule": "parallel", "loop_kv": "gswa", "loop_window": 4,
                                                      "exit_gate": "none", "prelude_layers": 0, "coda_layers": 0})
check_routing = _in_context("routing", {"depth_router": "token_choice", "exit_gate": "none"})


# ------------------------------------------------------------------ the suite
def _variant_cls(variant) -> type:
    axis, name = variant
    return REGISTRIES[axis].get(name)


@dataclass
class Check:
    """One check of one variant in one context: call it to run it."""

    variant: tuple[str, str]
    check: str
    context: Context
    fn: Callable = field(repr=False)
    args: tuple = ()

    @property
    def id(self) -> str:
        axis, name = self.variant
        return f"{axis}={name}-{self.check}-{self.context.name}"

    def __call__(self) -> int:
        """Run it; returns how many comparisons and refusals it verified (raises AssertionError on the first that
        fails, naming the contract and where to look; Skip when it does not apply)."""
        from looplab.models import LoopedLMConfig
        from looplab.models.registry import ConfigError

        with _one_thread():
            try:
                LoopedLMConfig(**self.context.config)
            except ConfigError as e:
                raise AssertionError(f"{self.id}: the context's model cannot be built: {e}") from e
            _verified[0] = 0
            try:
                self.fn(self.context, self.variant, *self.args)
            except AssertionError as e:
                contract, where = CONTRACTS[self.check.split(":")[0]]
                raise AssertionError(f"{self.id}: broke the contract '{contract}' (look at {where}): {e}") from e
            return _verified[0]


# each check's contract, and where a variant that breaks it usually goes wrong (a failure names both)
CONTRACTS = {
    "init_equivalence": ("an untrained variant computes the model without it",
                         "its output projection / gate initialisation (zero W_o, identity injection) in __init__"),
    "no_look_ahead": ("an exit rule decides after loop t from loops 1..t only",
                      "the rule's stops(t, threshold, inputs)"),
    "cached_decoding": ("decoding from the caches equals full forwards over each row alone",
                        "the variant's cached path: what it writes to and reads from its cache entry per step"),
    "prefill": ("a prefill and single steps give one forward's logits at every loop",
                "the variant's cached path over T > 1 tokens (prefill) against T = 1 (steps)"),
    "test_time_depth": ("R′ = R ± 1 decodes as a forward at R′", "anything in the variant sized by n_loops"),
    "skip": ("exits that skip compute equal the frozen-input reference",
             "what the variant leaves in a deeper loop's cache entry for an exited token (models/exit_compute.py)"),
    "speculation": ("greedy self-speculative decoding gives plain decoding's tokens",
                    "cache rollback: the variant's entry after rejected draft tokens"),
    "serving": ("the engine's schedules give each request its solo tokens",
                "per-row cache state: select_rows / reset_rows on the variant's entry"),
    "checkpoint": ("a checkpoint and a hub folder load back with the same logits",
                   "the variant's parameters and buffers (state_dict names, persistent=False buffers)"),
    "export": ("the transformers remote-code folder gives looplab's logits",
               "the variant's export (docs/interop.md#transformers-with-remote-code), or declare export=False"),
    "compile": ("a compiled decoding step gives plain decoding's tokens",
                "host syncs or Python branches on tensor values in the variant's step"),
    "parallel_loops": ("under loop_schedule=parallel it decodes as its forward",
                       "state carried along a token's loops, which the parallel schedule puts at different steps"),
    "routing": ("under a depth router it decodes as its causal forward",
                "the variant's handling of rows that skip a loop (restrict/merge of its cache entry)"),
}


@contextlib.contextmanager
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# the checks of the axes that are not parts of the model: an exit rule or a skip handling is exercised by decoding
AXIS_CHECKS = {"exit_rule": ("no_look_ahead", "cached_decoding", "serving", "skip"), "handling": ("serving", "skip")}
FIRST_ONLY = ("init_equivalence", "no_look_ahead", "test_time_depth", "speculation", "serving", "checkpoint", "export",
              "compile", "parallel_loops", "routing")


def checks(axis: str, name: str, only: tuple[str, ...] | None = None) -> list[Check]:
    """Every check of variant (axis, name) (the registry imports it if it must); `only` keeps the named ones."""
    if axis not in REGISTRIES:
        raise ValueError(f"axis={axis!r} is unknown; choose one of {sorted(REGISTRIES)}")
    REGISTRIES[axis].get(name)  # unknown names fail here, naming them
    v = (axis, name)
    out: list[Check] = []
    table = {"init_equivalence": check_init_equivalence, "no_look_ahead": check_no_look_ahead,
             "cached_decoding": check_cached_decoding,
             "prefill": check_prefill, "test_time_depth": check_test_time_depth, "speculation": check_speculation,
             "serving": check_serving, "checkpoint": check_checkpoint, "export": check_export,
             "compile": check_compile, "parallel_loops": check_parallel_loops, "routing": check_routing}
    for i, ctx in enumerate(contexts(axis, name)):
        for cname, fn in table.items():
            if i > 0 and cname in FIRST_ONLY:
                continue
            if cname == "init_equivalence" and not (axis in NEUTRAL and name not in ("vanilla", "none")):
                continue
            if cname == "no_look_ahead" and axis != "exit_rule":
                continue
            if (cname, axis) in (("parallel_loops", "loop_schedule"), ("routing", "depth_router")):
                continue  # a schedule is not put under another schedule, nor a router under another router
            out.append(Check(v, cname, ctx, fn))
        from looplab.models import LoopedLMConfig

        try:
            cfg = LoopedLMConfig(**ctx.config)
        except Exception:  # the Check itself reports it
            continue
        handlings = [ctx.handling] if ctx.handling else _applicable_handlings(cfg)
        if ctx.gated or ctx.handling:
            for h in handlings:
                out.append(Check(v, f"skip:{h}", ctx, check_skip, (h,)))
    keep = only if only is not None else AXIS_CHECKS.get(axis)
    if keep is not None:
        out = [c for c in out if c.check in keep or c.check.split(":")[0] in keep]
    return out


def builtin_variants() -> list[tuple[str, str]]:
    """(axis, name) of every variant registered inside looplab (the built-ins)."""
    out = []
    for axis, reg in REGISTRIES.items():
        for name in reg.names():
            cls = reg.get(name)
            if cls.__module__.startswith("looplab."):
                out.append((axis, name))
    return out


def parametrize_checks(*variants: tuple[str, str], only: tuple[str, ...] | None = None):
    """A pytest parametrization over every check of the given (axis, name) variants: `@parametrize_checks(...)` on a
    test taking `check` (call it). A check that does not apply is reported as skipped, with the reason."""
    import pytest

    params = []
    for axis, name in variants:
        for c in checks(axis, name, only):
            params.append(pytest.param(_Runner(c), id=c.id))
    return pytest.mark.parametrize("check", params)


class _Runner:
    """What the test receives: call it to run the check (a Skip becomes pytest's skip)."""

    def __init__(self, check: Check):
        self.check = check

    def __call__(self) -> int:
        import pytest

        try:
            return self.check()
        except Skip as e:
            pytest.skip(str(e))

    def __repr__(self) -> str:
        return self.check.id
