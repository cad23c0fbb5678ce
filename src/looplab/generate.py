"""Generate from a checkpoint: `python -m looplab.generate ckpt=PATH prompt="..." [key=value ...]`.

Keys: ckpt (required), prompt, max_new_tokens (64), temperature (0 = greedy), top_k, top_p,
exit_threshold (the gate's q, or the threshold of exit_rule), exit_rule (gate | kl | entropy |
hidden_delta | argmax_stable; zero-shot rules need no gate), exit_min_loops (1), skip_compute
(false | kv_copy (= true; attention-only models) | ssm_skip | ssm_propagate; models/exit_compute.py),
seed (0), device (cpu), speculative_loops (none; k in 1..R−1: loops 1..k draft, the full depth
verifies, greedy output unchanged), draft_tokens (4, or auto), compile (false | true | default |
reduce-overhead | max-autotune: plain steps compiled over a static cache). The flat keys build the
option groups of `looplab.models.generate` (Sampling, ExitPolicy, Speculation; docs/decoding.md).

Language-model checkpoints stream decoded text as tokens arrive (the tokenizer named in the
checkpoint's dataset config). Synthetic-task checkpoints (p-hop, Mano) take the prompt as
space-separated token names or ids (e.g. prompt="a b a c <query>") and print ids and names.
With exit_threshold, the mean exit depth is reported at the end; with speculative_loops, the
acceptance rate and the decoding speed (tokens/s after the prompt's prefill, per row).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from looplab.models.exits import ExitPolicy
from looplab.models.generation import Sampling, Speculation, stream

DEFAULTS: dict[str, Any] = {
    "ckpt": None, "prompt": "", "max_new_tokens": 64, "temperature": 0.0, "top_k": None, "top_p": None,
    "exit_threshold": None, "exit_rule": None, "exit_min_loops": 1, "skip_compute": False, "seed": 0, "device": "cpu",
    "speculative_loops": None, "draft_tokens": 4, "compile": False,
    "trust_variants": None,  # PKG[,PKG]: variant names in the checkpoint may import these (docs/training.md#what-looplab-trusts)
}

INTEGERS = ("max_new_tokens", "top_k", "seed", "exit_min_loops", "speculative_loops", "draft_tokens")


def parse_args(argv: list[str]) -> dict[str, Any]:
    args = dict(DEFAULTS)
    for a in argv:
        key, sep, val = a.partition("=")
        key = key.lstrip("-").replace("-", "_")
        if not sep or key not in DEFAULTS:
            raise SystemExit(f"bad argument {a!r}: use key=value with key in {sorted(DEFAULTS)}")
        if key in ("ckpt", "prompt", "device", "trust_variants"):
            args[key] = val
        elif key == "draft_tokens" and val.lower() == "auto":
            args[key] = "auto"
        elif key == "exit_rule":
            args[key] = val if val.lower() not in ("none", "null", "") else None
        elif key == "compile":
            v = val.lower()
            args[key] = True if v in ("1", "true", "yes", "on") else False if v in ("0", "false", "no", "off", "none", "") else v
        elif key == "skip_compute":
            v = val.lower()
            args[key] = True if v in ("1", "true", "yes", "on") else False if v in ("0", "false", "no", "off", "none", "") else v
        elif val.lower() in ("none", "null", ""):
            args[key] = None
        elif key in INTEGERS:
            try:
                args[key] = int(val)
            except ValueError:
                raise ValueError(f"{key}={val!r} must be an integer") from None
        else:
            try:
                args[key] = float(val)
            except ValueError:
                raise ValueError(f"{key}={val!r} must be a number") from None
    if not args["ckpt"]:
        raise SystemExit("ckpt=PATH is required (a looplab training checkpoint)")
    if args["max_new_tokens"] is None or args["max_new_tokens"] < 0:  # before the checkpoint is loaded
        raise ValueError(f"max_new_tokens={args['max_new_tokens']!r} must be an integer >= 0")
    if args["exit_min_loops"] is None or args["exit_min_loops"] < 1:  # read only with an exit: refused either way
        raise ValueError(f"exit_min_loops={args['exit_min_loops']!r} must be an integer >= 1 (no exit before that loop)")
    if args["exit_threshold"] is not None:  # the rule's name and its threshold's range, before the checkpoint loads
        from looplab.models.exit_rules import check_rule

        check_rule(args["exit_rule"] or "gate", args["exit_threshold"], 1, args["exit_min_loops"])
    return args


class _TaskText:
    """Synthetic-task vocabulary as a tokenizer: names ↔ ids."""

    def __init__(self, dataset: dict):
        from looplab.data.tasks import make_task  # lazy: only for task checkpoints

        self.vocab = make_task(dataset["task"], dataset.get("task_args")).vocab
        self.eos_id = None

    def encode(self, text: str) -> list[int]:
        out = []
        for t in text.split():
            if t in self.vocab.ids:
                out.append(self.vocab[t])
            elif t.isdigit() and int(t) < self.vocab.vocab_size:
                out.append(int(t))
            else:
                raise SystemExit(f"token {t!r} is not in this task's vocabulary {self.vocab.names}")
        return out

    def name(self, i: int) -> str:
        return self.vocab.names[i]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from looplab.checkpoint import load_model
    from looplab.models.registry import trust_variants

    trust_variants(*(args["trust_variants"] or "").split(","))
    model, meta = load_model(args["ckpt"], map_location=args["device"])
    dataset = meta.get("dataset") or {}
    is_task = dataset.get("task") in ("phop", "mano")
    if is_task:
        tok = _TaskText(dataset)
    else:
        from looplab.data.tokenizer import load_tokenizer  # lazy: model code never needs it

        tok = load_tokenizer(dataset if dataset.get("tokenizer") else "shakespeare-bpe-4096")
    ids = tok.encode(args["prompt"])
    if not ids:
        ids = [tok.eos_id] if tok.eos_id is not None else [0]  # an empty prompt starts from end-of-text
    input_ids = torch.tensor([ids], device=args["device"])
    gen = torch.Generator(device=args["device"]).manual_seed(args["seed"])

    spec = args["speculative_loops"]
    steps = stream(
        model, input_ids, args["max_new_tokens"], eos_token_id=tok.eos_id,
        sampling=Sampling(args["temperature"], args["top_k"], args["top_p"], gen),
        exits=ExitPolicy.from_kwargs(args["exit_threshold"], args["exit_rule"], args["exit_min_loops"],
                                     skip_compute=args["skip_compute"]),
        speculation=None if spec is None else Speculation(spec, args["draft_tokens"]), compile=args["compile"],
    )
    new, depths, speculation = [], [], None
    if is_task:
        print("prompt:", " ".join(tok.name(i) for i in ids))
    else:
        print(args["prompt"], end="", flush=True)
    start = None
    for step in steps:
        if start is None:  # the first token comes with the prompt's prefill: time the decoding after it
            start = time.perf_counter()
        speculation = step.speculation
        t = int(step.tokens[0])
        new.append(t)
        if step.exit_steps is not None:
            depths.append(int(step.exit_steps[0]))
        if is_task:
            print(f"{t}\t{tok.name(t)}" + (f"\texit depth {depths[-1]}" if depths else ""), flush=True)
        else:
            # decode the whole continuation each time: BPE pieces only become text in context
            text = tok.decode(new)
            prev = tok.decode(new[:-1]) if len(new) > 1 else ""
            print(text[len(prev):], end="", flush=True)
    if not is_task:
        print()
    if speculation is not None:
        elapsed = time.perf_counter() - start
        rate = (len(new) - 1) / elapsed if len(new) > 1 and elapsed > 0 else float("nan")
        print(f"[speculative_loops={args['speculative_loops']} draft_tokens={args['draft_tokens']}: "
              f"{speculation.summary()}; {rate:.1f} tokens/s after the prefill]", file=sys.stderr)
    if depths:
        R = model.config.n_loops
        print(f"[mean exit depth {sum(depths) / len(depths):.2f} of {R} over {len(depths)} tokens]", file=sys.stderr)


if __name__ == "__main__":
    from looplab.cli_errors import run_cli

    run_cli(main, "python -m looplab.generate")  # bad input: one line on stderr, exit 1 (looplab/cli_errors.py)
