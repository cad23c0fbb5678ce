"""Mamba-2 benchmark: training throughput of looplab's chunked SSD layer stack on CPU.

Forward+backward tokens/s (fp32, after warm-up, median of repeats) of three models with
the same shapes, timed round-robin in one process (common.time_round_robin) so a loaded
machine slows all alike:

- `chunked`: LoopedLM(backbone=mamba2, n_loops=1) with the pure-PyTorch chunked SSD;
- `step`: the same model with the scan replaced by the token-by-token recurrence;
- `transformers`: `transformers.Mamba2ForCausalLM` (its pure-PyTorch fallback on CPU);
- `chunked_compiled`: `chunked` with `compile_block()`, as `compile=auto` trains at d_model ≥ 512
  (skipped in --quick; an inductor failure is recorded, not raised).

`ratio_vs_transformers` compares the eager chunked scan with the eager reference (kernel
against kernel); `ratio_vs_transformers_compiled` is the step as looplab trains it here.

Each has an embedding, the Mamba-2 layer stack, a final norm and an LM head, and the loss
is next-token cross-entropy, so the ratio compares like with like.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.nn.functional as F

from looplab.bench import common
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.ops.ssd import ssd_reference

FULL = dict(n_layers=4, d_model=512, d_state=64, headdim=64, expand=2, chunk_size=64, seq_len=256, batch=2, vocab=512)
QUICK = dict(n_layers=2, d_model=256, d_state=64, headdim=64, expand=2, chunk_size=64, seq_len=128, batch=2, vocab=512)


def _step_scan(x, dt, A, B, C, chunk_size, D=None, initial_state=None, return_final_state=False):
    y, state = ssd_reference(x, dt, A, B, C, D, initial_state)
    return (y, state) if return_final_state else y


def _looplab_model(d: dict, step: bool) -> torch.nn.Module:
    cfg = LoopedLMConfig(
        vocab_size=d["vocab"], d_model=d["d_model"], n_layers=d["n_layers"], n_loops=1, backbone="mamba2",
        d_state=d["d_state"], headdim=d["headdim"], expand=d["expand"], chunk_size=d["chunk_size"],
        kernel="torch", max_seq_len=d["seq_len"],
    )
    model = LoopedLM(cfg)
    if step:
        for layer in model.block:
            layer.mixer.scan_fn = _step_scan
    return model


def _transformers_model(d: dict) -> torch.nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(
        vocab_size=d["vocab"], hidden_size=d["d_model"], num_hidden_layers=d["n_layers"], state_size=d["d_state"],
        head_dim=d["headdim"], num_heads=d["expand"] * d["d_model"] // d["headdim"], expand=d["expand"], n_groups=1,
        chunk_size=d["chunk_size"], conv_kernel=4, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
    )
    return Mamba2ForCausalLM(cfg)


def _train_step(model, ids, hf: bool) -> None:
    out = model(input_ids=ids) if hf else model(ids)
    logits = out.logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def _time(models: dict, ids: torch.Tensor, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Wall seconds per training step, per round; models run round-robin so load changes hit all alike."""
    steps = {name: (lambda m=model, hf=hf: _train_step(m, ids, hf)) for name, (model, hf) in models.items()}
    return common.time_round_robin(steps, repeats, warmup=warmup).wall


def run(threads: int = 2, quick: bool = False) -> dict:
    """Return tokens/s of each model and the ratios `ratio_vs_step`, `ratio_vs_transformers` (chunked / other).

    The step recurrence is an order of magnitude slower, so it is timed on its own with fewer repeats.
    """
    d = dict(QUICK if quick else FULL)
    warmup, repeats = (1, 3) if quick else (2, 7)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        ids = torch.randint(0, d["vocab"], (d["batch"], d["seq_len"]))
        result: dict = {"dims": d, "threads": threads, "warmup": warmup, "repeats": repeats, "dtype": "float32"}
        models = {"chunked": (_looplab_model(d, step=False), False)}
        try:
            import transformers

            models["transformers"] = (_transformers_model(d), True)
            result["transformers_version"] = transformers.__version__
        except ImportError as e:  # the bench extra is not installed
            result["transformers_error"] = str(e)
        # On a shared machine, OpenMP threads > free cores make every op wait on descheduled
        # threads: measured here 10-50x slower steps at 2 threads under load 8 on 2 cores.
        result["loadavg_1m_before"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        if not quick:
            compiled = _looplab_model(d, step=False)
            compiled.load_state_dict(models["chunked"][0].state_dict())
            compiled.compile_block(dynamic=False)
            first = common.first_compiled_call(lambda: _train_step(compiled, ids, False))
            if "error" in first:
                result["compile_error"] = first["error"]
            else:
                result["compile_s"] = first["compile_s"]
                models["chunked_compiled"] = (compiled, False)
        times = _time(models, ids, warmup, repeats)
        step = {"step": (_looplab_model(d, step=True), False)}
        times.update(_time(step, ids, 1, 1 if quick else 2))
        models.update(step)

        tokens = d["batch"] * d["seq_len"]
        seconds = {k: statistics.median(v) for k, v in times.items()}
        tps = {k: tokens / v for k, v in seconds.items()}
        result["seconds_per_step"] = seconds
        result["seconds_per_step_min"] = {k: min(v) for k, v in times.items()}
        result["tokens_per_s"] = tps
        result["ratio_vs_step"] = tps["chunked"] / tps["step"]
        if "transformers" in tps:
            result["ratio_vs_transformers"] = tps["chunked"] / tps["transformers"]
            if "chunked_compiled" in tps:
                result["ratio_vs_transformers_compiled"] = tps["chunked_compiled"] / tps["transformers"]
        result["params"] = {k: sum(p.numel() for p in m.parameters()) for k, (m, _) in models.items()}
        return result
    finally:
        torch.set_num_threads(old_threads)


if __name__ == "__main__":  # python -m looplab.bench.mamba2 [--quick]
    import json
    import sys

    threads = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--threads=")), 2))
    print(json.dumps(run(threads=threads, quick="--quick" in sys.argv), indent=2))
