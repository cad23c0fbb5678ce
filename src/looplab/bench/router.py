"""Depth routing's compute saving: training tokens/s and analytic FLOPs of a
Mixture-of-Recursions model against the fixed-depth model with the same block (equal parameters,
apart from the router's d·R weights).

Arms, each a copy of one llama 1⊗R model (the same block, embedding and head weights):

- `fixed`          depth_router=none: every token runs every loop
- `expert_choice`  MoR's defaults: loop r runs the top ⌊(R − r)/R · T⌋ tokens (no capacity warm-up here:
                   the figures are those of training after it)
- `token_choice`   MoR's defaults: each token runs the depth its router picks (untrained: whatever the
                   initial router picks; the balancing loss is on)

One training step = forward, next-token cross-entropy + the router's losses, backward, AdamW step,
zero_grad. The arms are timed round-robin in one process (common.time_round_robin: warm-up steps
untimed, ABBA order, medians), on ONE torch thread whatever --threads says: the gathered matmuls are
small, and on a shared machine a second thread measures the neighbours. tokens/s and the ratios are
per second of this process's CPU time (one thread: the time it computed), the `*_wall` ones per wall
second: on a shared machine the wall clock also counts the time the process waited for a core
(measured here at nice 19 under load 4 on 2 cores: a 0.24 CPU-second decode took 10–16 wall seconds).
Ratios are paired medians over rounds (fixed time / routed time, back to back). FLOPs are
LoopedLM.flops_per_token(training=True): the routed count puts each loop at the fraction of tokens
that runs it (expert choice: capacity_r; token choice: the balanced (R − r)/R — `flops_ratio`), and
`flops_ratio_measured` at the fractions the timed steps gathered (token choice's untrained router is
not balanced; padding to the longest row counted).

Decoding: cached greedy decoding at batch 1 (models.generation.generate), a routed model with its
inference router (expert choice: sigmoid(logit) ≥ 0.5 per token; token choice: its argmax depth). The
routers are untrained, so `decode_mean_depth` (the depths the same decisions give, from a
depths='inference' forward of the decoded sequence) says how much each arm skipped; a trained router
decides otherwise.

Usage: python -m looplab.bench --only router [--quick]   (or python -m looplab.bench.router)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looplab.bench import common
from looplab.models import LoopedLM, LoopedLMConfig

FULL = dict(vocab=512, d_model=256, n_heads=4, ffn=688, n_layers=1, n_loops=3, seq_len=256, batch=8,
            prompt=16, new=48)
QUICK = dict(vocab=128, d_model=64, n_heads=4, ffn=128, n_layers=1, n_loops=3, seq_len=48, batch=2,
             prompt=4, new=8)
ARMS = {"fixed": None,
        "expert_choice": {"name": "expert_choice", "capacity_warmup_steps": 0},
        "token_choice": {"name": "token_choice"}}


def build(d: dict, router: dict | None, base: LoopedLM | None = None) -> LoopedLM:
    """The arm's model; with `base`, its block/embedding/head weights copied (the router's stay its own)."""
    torch.manual_seed(0)
    cfg = LoopedLMConfig(vocab_size=d["vocab"], d_model=d["d_model"], n_heads=d["n_heads"], ffn_hidden=d["ffn"],
                         n_layers=d["n_layers"], n_loops=d["n_loops"], max_seq_len=d["seq_len"], depth_router=router)
    model = LoopedLM(cfg)
    if base is not None:
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("router.") for k in missing), (missing, unexpected)
    return model


def make_step(model: LoopedLM, d: dict):
    """A closure running one training step on fixed random tokens; it records the fraction of the T
    tokens each loop gathered (its last call's) in `gathered`."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, d["vocab"], (d["batch"], d["seq_len"] + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    V, T = d["vocab"], d["seq_len"]
    gathered: list[float] = []

    def step() -> None:
        out = model(x)
        loss = F.cross_entropy(out.logits.view(-1, V), y.view(-1))
        if out.routing is not None:
            loss = loss + sum(out.routing.losses.values())
            gathered[:] = [1.0 if i is None else i.shape[1] / T for i in out.routing.selected]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, gathered


def run(threads: int = 1, quick: bool = False, repeats: int | None = None) -> dict:
    d = dict(QUICK if quick else FULL)
    repeats = repeats or (2 if quick else 7)
    R, T, B = d["n_loops"], d["seq_len"], d["batch"]
    before = torch.get_num_threads()
    common.set_threads(1)
    try:
        base = build(d, None)
        models = {name: build(d, router, base) for name, router in ARMS.items()}
        steps = {name: make_step(m, d) for name, m in models.items()}
        timings = common.time_round_robin({k: s for k, (s, _) in steps.items()}, repeats, warmup=1 if quick else 2,
                                          reference="fixed")
        decode = _decode(models, d, repeats)
    finally:
        torch.set_num_threads(before)
    flops = {k: m.flops_per_token(T, training=True) for k, m in models.items()}
    measured = {k: (m.flops_per_token(T, training=True, loop_fractions=steps[k][1]) if m.router is not None
                    else flops[k]) for k, m in models.items()}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    arms = {}
    for k in models:
        arms[k] = {"tokens_per_s": B * T / timings.median(k, "cpu"), "tokens_per_s_wall": B * T / timings.median(k),
                   "step_cpu_s": timings.cpu[k], "step_wall_s": timings.wall[k], "flops_per_token_train": flops[k],
                   "flops_per_token_train_measured": measured[k], "params": params[k],
                   "loop_fractions": models[k].config.depth_router.loop_fractions(R, T),
                   "gathered_fractions": steps[k][1] or [1.0] * R, **decode[k]}
        if k != "fixed":
            dec = decode["fixed"]
            arms[k].update(tokens_per_s_ratio=_paired(timings, k, "cpu"), tokens_per_s_ratio_wall=_paired(timings, k),
                           flops_ratio=flops[k] / flops["fixed"], flops_ratio_measured=measured[k] / flops["fixed"],
                           decode_tokens_per_s_ratio=decode[k]["decode_tokens_per_s"] / dec["decode_tokens_per_s"],
                           decode_tokens_per_s_ratio_wall=(decode[k]["decode_tokens_per_s_wall"]
                                                           / dec["decode_tokens_per_s_wall"]))
    out = {"config": d, "torch_threads": 1, "repeats": repeats, "clock": "process CPU time (one thread); *_wall: wall clock",
           "arms": arms}
    for k in ("expert_choice", "token_choice"):
        short = "ec" if k == "expert_choice" else "tc"
        for key in ("tokens_per_s_ratio", "tokens_per_s_ratio_wall", "flops_ratio", "flops_ratio_measured",
                    "decode_tokens_per_s_ratio", "decode_tokens_per_s_ratio_wall", "decode_mean_depth"):
            out[f"{short}_{key}"] = arms[k][key]
    out["fixed_tokens_per_s"] = arms["fixed"]["tokens_per_s"]
    out["fixed_decode_tokens_per_s"] = decode["fixed"]["decode_tokens_per_s"]
    return out


def _paired(timings: common.Timings, k: str, clock: str = "wall") -> float:
    """Median over rounds of the fixed arm's step time / arm k's (back to back within a round): k's speed-up."""
    return timings.ratio("fixed", k, clock).median


def _decode(models: dict[str, LoopedLM], d: dict, repeats: int) -> dict:
    """Cached greedy decoding at batch 1: tokens/s of `new` tokens after a `prompt`-token prefill, and the
    mean depth the decoded tokens ran."""
    from looplab.models.generation import generate

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, d["vocab"], (1, d["prompt"]), generator=g)
    new = d["new"]
    for m in models.values():
        m.eval()

    def fn(m):
        def call():
            with torch.no_grad():
                generate(m, ids, new)
        return call

    timings = common.time_round_robin({k: fn(m) for k, m in models.items()}, max(2, repeats // 2), warmup=1)
    out = {}
    for k, m in models.items():
        depth = float(m.config.n_loops)
        if m.router is not None:
            with torch.no_grad():
                seq = generate(m, ids, new)
                routed = m(seq[:, :-1], depths="inference").routing.depth[:, d["prompt"]:]
            depth = float(routed.float().mean())
        out[k] = {"decode_tokens_per_s": new / timings.median(k, "cpu"), "decode_tokens_per_s_wall": new / timings.median(k),
                  "decode_mean_depth": depth}
    return out


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m looplab.bench.router")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    a = ap.parse_args()
    res = run(1, a.quick, a.repeats)
    print(json.dumps({k: v for k, v in res.items() if k != "arms"}, indent=1))


if __name__ == "__main__":
    main()
