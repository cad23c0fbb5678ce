"""lm-eval's logged per-choice log-likelihoods against a model's own forward pass: the exported folder under
transformers (tests/test_remote_code.py) and under vLLM (tests_engines/vllm) are checked choice by choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch


def logged_loglikelihoods(out_dir, tokenizer, model, max_length: int) -> Iterator[tuple[tuple, float, float]]:
    """(where, lm-eval's log-likelihood, the model's) for every choice in out_dir's `samples_looplab_tiny_*.jsonl`
    (`lm_eval --log_samples`). The model's is the continuation's summed log-probability, in float64, from one
    forward pass over the request's last max_length + 1 tokens: the window both sides score with."""
    for f in sorted(Path(out_dir).rglob("samples_looplab_tiny_*.jsonl")):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            for args, resp in zip(s["arguments"].values(), s["resps"]):
                ctx, cont = args["arg_0"], args["arg_1"]
                full, head = tokenizer.encode(ctx + cont), tokenizer.encode(ctx)
                n = len(full) - len(head)
                ids = torch.tensor([full[-(max_length + 1):]])
                with torch.no_grad():
                    lp = torch.log_softmax(model(ids[:, :-1]).logits[0].double(), -1)
                own = float(lp[-n:].gather(-1, ids[0, -n:, None]).sum())
                yield (f.name, ctx[-30:], cont), float(resp[0][0]), own
