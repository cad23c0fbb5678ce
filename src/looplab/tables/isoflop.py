"""Iso-FLOP helper: the N⊗R pairs whose forward FLOPs per token match a target.

FLOPs come from `LoopedLM.flops_per_token` (which counts every loop: a looped
model's parameter count undercounts its compute R-fold), evaluated on models built
on the meta device, so even the 1.4B presets cost no memory. For a fixed N the
count is R·(layers + state branch) + head, so one meta model with the most layers gives every N⊗R.

    python -m looplab.tables isoflop --like 24x1 --backbone mamba2_140m
    python -m looplab.tables isoflop --target-flops 3.1e8 --backbone llama_410m --tolerance 0.02
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from looplab.tables.spec import CONF


@dataclass(frozen=True)
class Pair:
    layers: int
    loops: int
    flops: int  # forward FLOPs per token
    rel_error: float  # (flops - target) / target
    params: int | None = None

    @property
    def name(self) -> str:
        return f"{self.layers}x{self.loops}"


def model_config(backbone: str = "llama_tiny", state_mode: str = "vanilla", layers: int = 1, loops: int = 1,
                 vocab_size: int | None = None, overrides: list[str] | None = None):
    """The LoopedLMConfig that `python -m looplab.train backbone=... state_mode=...` would build."""
    from hydra import compose, initialize_config_dir

    from looplab.training.compose import model_config_from_cfg

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose("train", overrides=[f"backbone={backbone}", f"state_mode={state_mode}", f"loop_depth.layers={layers}",
                                          f"loop_depth.loops={loops}", *(overrides or [])])
    if cfg.backbone.get("vocab_size") is None and vocab_size is None:
        vocab_size = 4096  # the embedded corpus' BPE; tiny presets take the vocabulary from the dataset
    if vocab_size is not None:
        cfg.backbone.vocab_size = vocab_size
    return model_config_from_cfg(cfg)


def _meta_model(cfg):
    import torch

    from looplab.models import LoopedLM

    with torch.device("meta"):
        return LoopedLM(cfg)


def flops_table(base, seq_len: int, max_layers: int, max_loops: int, with_params: bool = False) -> dict[tuple[int, int], tuple[int, int | None]]:
    """{(N, R): (forward FLOPs/token, params)} for N ≤ max_layers, R ≤ max_loops.

    One meta model with max_layers layers gives every N: the block of an N-layer model is the
    first N layers of it (hybrid patterns tile from layer 0). The split into per-layer, state
    and head terms is checked against LoopedLM.flops_per_token of real (meta) N⊗R models.
    """
    big = _meta_model(replace(base, n_layers=max_layers, n_loops=1))
    layer_f = [layer.flops_per_token(seq_len) for layer in big.block]
    layer_p = [sum(p.numel() for p in layer.parameters()) for layer in big.block]
    state_f = big.state.flops_per_token(seq_len) if big.state is not None else 0
    head_f = big.flops_per_token(seq_len) - sum(layer_f) - state_f
    total_p = big.num_parameters()["total"]
    out = {}
    for n in range(1, max_layers + 1):
        per_loop = sum(layer_f[:n]) + state_f
        params = total_p - sum(layer_p[n:]) if with_params else None  # looping adds no parameters
        for r in range(1, max_loops + 1):
            out[(n, r)] = (head_f + r * per_loop, params)
    for n, r in {(1, max_loops), (max_layers, 2)}:
        real = _meta_model(replace(base, n_layers=n, n_loops=r)).flops_per_token(seq_len)
        if real != out[(n, r)][0]:
            raise RuntimeError(f"FLOPs of {n}x{r} do not decompose as R·(layers + state) + head ({real} vs {out[(n, r)][0]}); "
                               "LoopedLM.flops_per_token changed: update looplab.tables.isoflop")
    return out


def matching_pairs(target_flops: float | None = None, like: str | None = None, *, backbone: str = "llama_tiny",
                   state_mode: str = "vanilla", seq_len: int | None = None, tolerance: float = 0.01,
                   max_layers: int | None = None, max_loops: int = 12, vocab_size: int | None = None,
                   overrides: list[str] | None = None) -> tuple[float, list[Pair]]:
    """(target, pairs within `tolerance` relative FLOPs, closest first). `like='24x1'` takes that model's FLOPs as target."""
    if (target_flops is None) == (like is None):
        raise ValueError("give exactly one of target_flops (a number) or like (N x R, e.g. '24x1')")
    base = model_config(backbone, state_mode, vocab_size=vocab_size, overrides=overrides)
    seq_len = int(seq_len or base.max_seq_len)
    if like is not None:
        try:
            n0, r0 = (int(x) for x in like.lower().replace("⊗", "x").split("x"))
        except ValueError:
            raise ValueError(f"like={like!r} must look like NxR, e.g. 24x1") from None
        target_flops = _meta_model(replace(base, n_layers=n0, n_loops=r0)).flops_per_token(seq_len)
        max_layers = max_layers or max(n0 * r0, n0)
    max_layers = max_layers or 48
    table = flops_table(base, seq_len, max_layers, max_loops, with_params=True)
    pairs = [Pair(n, r, f, (f - target_flops) / target_flops, p) for (n, r), (f, p) in table.items()
             if abs(f - target_flops) <= tolerance * target_flops]
    pairs.sort(key=lambda p: (abs(p.rel_error), p.loops))
    return float(target_flops), pairs


def format_pairs(target: float, pairs: list[Pair], backbone: str, seq_len: int | None) -> str:
    lines = [f"target {target:.4g} forward FLOPs/token ({backbone}, seq_len {seq_len or 'preset max_seq_len'})",
             f"{'N⊗R':>8} {'loop_depth':>10} {'FLOPs/token':>14} {'rel. error':>10} {'params':>14}"]
    for p in pairs:
        lines.append(f"{p.layers:>4}⊗{p.loops:<3} {p.name:>10} {p.flops:>14.4g} {100 * p.rel_error:>9.2f}% {p.params or 0:>14,}")
    if not pairs:
        lines.append("(no pair within the tolerance; raise --tolerance or --max-layers/--max-loops)")
    return "\n".join(lines)
