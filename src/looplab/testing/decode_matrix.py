"""The decoding dtype matrix (tests/test_gpu_readiness.py on the CPU, tests/test_gpu_decode.py on a GPU): every
decoder and serving schedule, in float32, bfloat16 and a float32 model under autocast to bfloat16, each row against
decoding it alone (docs/decoding.md#on-a-gpu)."""

from __future__ import annotations

import contextlib

import torch

from looplab.models import ExitPolicy, LoopedLM, LoopedLMConfig, Speculation

V = 61
DTYPES = ("fp32", "bf16", "autocast")
# name → (model config, generate options)
DECODERS = {
    "plain_gqa_prelude_coda": (dict(n_kv_heads=2, prelude_layers=1, coda_layers=1), {}),
    "exit_readout": (dict(exit_gate="ouro"), dict(exits=ExitPolicy(threshold=0.5))),
    "skip_kv_copy": (dict(exit_gate="ouro", state_mode="stateloop"), dict(exits=ExitPolicy(threshold=0.5, skip="kv_copy"))),
    "skip_ssm_skip": (dict(exit_gate="ouro", backbone="hybrid"), dict(exits=ExitPolicy(threshold=0.5, skip="ssm_skip"))),
    "skip_ssm_propagate": (dict(exit_gate="ouro", backbone="hybrid"),
                           dict(exits=ExitPolicy(threshold=0.5, skip="ssm_propagate"))),
    "speculation": (dict(state_mode="stateloop_attn"), dict(speculation=Speculation(1, 2))),
    "routed": (dict(depth_router="expert_choice"), {}),
    "parallel_gswa": (dict(loop_schedule="parallel", loop_kv="gswa", loop_window=4), {}),
}
# name → (model config, exit policy) for the serving engine's two schedules
ENGINES = {"exits_kv_copy": (dict(exit_gate="ouro", n_kv_heads=2), ExitPolicy(threshold=0.5, skip="kv_copy")),
           "exits_ssm_skip": (dict(exit_gate="ouro", backbone="hybrid"), ExitPolicy(threshold=0.5, skip="ssm_skip")),
           "routed": (dict(depth_router="token_choice"), None),
           "plain_parallel": (dict(loop_schedule="parallel"), None)}


def make(seed: int = 0, d_model: int = 32, device="cpu", **kw) -> LoopedLM:
    """A random model whose every part matters: small perturbations of every parameter, a sharpened head, a gate
    spread so that tokens exit at mixed depths."""
    torch.manual_seed(seed)
    cfg = LoopedLMConfig(vocab_size=V, d_model=d_model, n_heads=4, n_layers=2, n_loops=3, max_seq_len=64, d_state=8,
                         headdim=16, chunk_size=4, kernel="torch", hybrid_pattern="MA", **kw)
    model = LoopedLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        model.head.weight.mul_(4)
        if model.exit_gate is not None:
            model.exit_gate.proj.weight.normal_(0, 1 / d_model ** 0.5, generator=g)
            model.exit_gate.proj.bias.fill_(-0.3)
    return model.to(device)


def prompts(n=(3, 7, 5, 6), seed: int = 3, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (k,), generator=g).to(device) for k in n]


def padded(ps: list[torch.Tensor]):
    """(ids (B, T) left-padded with 0, mask (B, T))."""
    T = max(len(p) for p in ps)
    dev = ps[0].device
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long, device=dev), p]) for p in ps])
    mask = (torch.arange(T, device=dev)[None] >= torch.tensor([T - len(p) for p in ps], device=dev)[:, None]).long()
    return ids, mask


def in_dtype(model: LoopedLM, mode: str):
    """(the model in `mode`, the context to decode in): bf16 weights, or float32 weights under autocast to bf16."""
    if mode == "bf16":
        return model.to(torch.bfloat16), torch.no_grad()
    if mode == "autocast":
        return model, torch.autocast(model.head.weight.device.type, dtype=torch.bfloat16)
    return model, contextlib.nullcontext()


def agree(batched_tokens: torch.Tensor, solo_tokens: torch.Tensor, solo_logits: torch.Tensor, tie: float) -> bool:
    """Equal tokens, or equal up to a first difference where the solo top-2 logit margin is within `tie`."""
    diff = (batched_tokens != solo_tokens).nonzero()
    if not len(diff):
        return True
    top = solo_logits[int(diff[0])].float().topk(2).values
    return float(top[0] - top[1]) <= tie


@torch.no_grad()
def decoder_agrees(name: str, mode: str, tie: float, device="cpu", d_model: int = 32) -> list[int]:
    """Decode a left-padded batch with decoder `name` in `mode`; → the rows that do not agree with decoding alone."""
    from looplab.models.generation import generate

    cfg, options = DECODERS[name]
    model, ctx = in_dtype(make(d_model=d_model, device=device, **cfg), mode)
    ps = prompts(device=device)
    ids, mask = padded(ps)
    bad = []
    with ctx:
        out = generate(model, ids, 8, attention_mask=mask, return_logits=True, **options)
        for i, p in enumerate(ps):
            solo = generate(model, p[None], 8, return_logits=True, **options)
            new = out.sequences[i, ids.shape[1]:]
            if not agree(new, solo.sequences[0, len(p):], solo.logits[0], tie):
                bad.append(i)
            elif out.exit_steps is not None and torch.equal(new, solo.sequences[0, len(p):]) \
                    and not torch.equal(out.exit_steps[i], solo.exit_steps[0]):
                bad.append(i)
    return bad


@torch.no_grad()
def engine_agreement(name: str, schedule: str, mode: str, tie: float, device="cpu", d_model: int = 32) -> dict | None:
    """Serve six requests (three rows, joining and leaving) under `schedule` in `mode`; → solo_agreement's counts, or
    None when the schedule refuses the model by name."""
    from looplab.serve import Engine, solo_agreement

    cfg, exits = ENGINES[name]
    model, ctx = in_dtype(make(d_model=d_model, device=device, **cfg), mode)
    with ctx:
        try:
            engine = Engine(model, max_batch=3, max_len=40, exits=exits, schedule=schedule)
        except ValueError as e:
            if "is not" in str(e) or "already run" in str(e):
                return None
            raise
        reqs = [engine.add(p, n) for p, n in zip(prompts((3, 7, 5, 6, 4, 8), device=device), (6, 9, 4, 7, 5, 8))]
        engine.run()
        return solo_agreement(model, reqs, exits=exits, tie_margin=tie)
