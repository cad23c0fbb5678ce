"""Self-speculative decoding speed by hand (issue 27; not a timed test): tokens/s of plain greedy
decoding against speculative greedy decoding (models/speculative.py) of the same prompts.

    python -m looplab.bench.speculative [--ckpt PATH] [--k 1 2 3] [--gamma 2 4 auto] [--batch 1]
                                        [--new 64] [--repeats 3] [--threads 1]

Without --ckpt: a random-init llama 1⊗4 at d 64 (its loops disagree, so little is accepted).
With a checkpoint: prompts are the first --prompt tokens of its task's test sequences (or random
tokens for a language-model checkpoint). Every configuration decodes the same prompts, timed
round-robin (repeat i of every configuration before repeat i+1 of any), so load on a shared
machine hits all alike; the figure is the median tokens/s over repeats, wall time from the call to
`generate` to its return (prefill included, the same for both). Each speculative run is checked to
give the plain run's tokens. This is the measurement table 11 is to be built on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.generation import generate


def _random_model(seed: int = 0) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(LoopedLMConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=1, n_loops=4, max_seq_len=512)).eval()


def _prompts(model, meta: dict | None, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    dataset = (meta or {}).get("dataset") or {}
    if dataset.get("task"):
        from looplab.bench.exit_decode import _test_examples

        rows = [ex["input_ids"][:prompt_len] for ex in _test_examples(meta, batch)]
        return torch.stack(rows)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)


@torch.no_grad()
def run(ckpt: str | None = None, ks=None, gammas=(2, 4, "auto"), batch: int = 1, prompt_len: int = 16,
        new_tokens: int = 64, repeats: int = 3, threads: int | None = 1, seed: int = 0) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    meta = None
    if ckpt:
        from looplab.checkpoint import load_model

        model, meta = load_model(ckpt, map_location="cpu")
        model.eval()
    else:
        model = _random_model(seed)
    R = model.config.n_loops
    ks = list(ks or range(1, R))
    ids = _prompts(model, meta, batch, prompt_len, seed)
    configs = {"plain": {}}
    for k in ks:
        for g in gammas:
            configs[f"k={k} gamma={g}"] = {"speculative_loops": k, "draft_tokens": g}
    reference = generate(model, ids, new_tokens)
    times: dict[str, list[float]] = {name: [] for name in configs}
    acceptance: dict[str, float] = {}
    for _ in range(repeats):
        for name, kw in configs.items():
            start = time.perf_counter()
            out = generate(model, ids, new_tokens, return_logits=True, **kw)
            times[name].append(time.perf_counter() - start)
            if not torch.equal(out.sequences, reference):
                raise AssertionError(f"{name} decoded other tokens than plain greedy decoding")
            if out.speculation is not None:
                acceptance[name] = out.acceptance_rate
    n = batch * new_tokens
    result = {"model": ckpt or "random llama 1x4 d64", "n_loops": R, "batch": batch, "new_tokens": new_tokens,
              "threads": torch.get_num_threads(), "configs": {}}
    plain = n / statistics.median(times["plain"])
    for name in configs:
        tps = n / statistics.median(times[name])
        result["configs"][name] = {"tokens_per_s": round(tps, 1), "speedup": round(tps / plain, 3),
                                   "acceptance": round(acceptance[name], 3) if name in acceptance else None}
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt")
    p.add_argument("--k", type=int, nargs="*")
    p.add_argument("--gamma", nargs="*", default=["2", "4", "auto"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    gammas = [g if g == "auto" else int(g) for g in a.gamma]
    res = run(a.ckpt, a.k, gammas, a.batch, a.prompt, a.new, a.repeats, a.threads)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
