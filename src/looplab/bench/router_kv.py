"""KV memory of routed decoding (docs/decoding.md#routed-decoding): LoopCache.nbytes of a depth-routed model against the
fixed-depth model of the same block, after prefilling P tokens and decoding N more one at a time.

Untrained models (random routers, sharpened ×8 so decisions vary): the figures measure the caching
mechanism (each depth's cache holds the tokens that reached it), not what a trained router would choose.
Usage: python -m looplab.bench.router_kv [--batch 1] [--prompt 16] [--new 112]
"""

from __future__ import annotations

import argparse

import torch

from looplab.models import LoopedLM, LoopedLMConfig

ARMS = {
    "fixed depth (none)": None,
    "expert_choice aux_router, recursion_wise": {"name": "expert_choice", "aux_router": True},
    "expert_choice threshold 0.5, recursion_wise": {"name": "expert_choice"},
    "token_choice, recursion_wise": {"name": "token_choice"},
    "expert_choice aux_router, share_first": {"name": "expert_choice", "aux_router": True, "kv": "share_first"},
    "token_choice, share_first": {"name": "token_choice", "kv": "share_first"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=112)
    ap.add_argument("--loops", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    T = a.prompt + a.new
    ids = torch.randint(1, 256, (a.batch, T), generator=torch.Generator().manual_seed(0))
    base = None
    print(f"d_model 128, 2 layers x R={a.loops}, batch {a.batch}, prompt {a.prompt} + {a.new} decoded tokens, fp32")
    for name, router in ARMS.items():
        torch.manual_seed(0)
        model = LoopedLM(LoopedLMConfig(vocab_size=256, d_model=128, n_heads=4, n_layers=2, n_loops=a.loops,
                                        ffn_hidden=256, max_seq_len=T, depth_router=router)).eval()
        with torch.no_grad():
            for p in (model.router.parameters() if model.router is not None else ()):
                p.mul_(8.0)
            cache = model.allocate_cache(a.batch, T)
            out = model(ids[:, :a.prompt], cache=cache)
            depths = [out.routing.depth] if out.routing is not None else []
            for t in range(a.prompt, T):
                out = model(ids[:, t:t + 1], cache=cache)
                if out.routing is not None:
                    depths.append(out.routing.depth)
        nbytes = cache.nbytes()
        base = base or nbytes
        per_depth = [cache[r, 0].length for r in range(a.loops) if (r, 0) in cache.entries]
        mean_depth = float(torch.cat(depths, 1).float().mean()) if depths else float(a.loops)
        print(f"{name:45s} {nbytes / 1024:8.1f} KiB  {nbytes / base:5.2f}x  tokens per depth cache {per_depth}  "
              f"mean depth {mean_depth:.2f}")


if __name__ == "__main__":
    main()
