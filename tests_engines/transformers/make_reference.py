"""Export the matrix's folders and compute looplab's reference outputs, in looplab's own venv (.venv).

    .venv/bin/python tests_engines/transformers/make_reference.py --out .venvs/transformers-ref

scripts/transformers-matrix runs this once; each transformers cell then checks the folders against these
references in a venv where looplab is not installed (test_exported_folder.py). Writes, under --out:

  <name>/            a `python -m looplab.convert to-hf` folder (the CLI's main, in this process)
  <name>.pt          looplab's outputs on fixed inputs: logits (a left-padded batch), greedy tokens (batch 1
                     and left-padded), and per folder the exit distribution and threshold generations, or
                     the test-time depth R′
  manifest.json      what each folder holds and which checks it gets, lm-eval's command as `to-hf` prints it,
                     looplab.eval's zero-shot accuracies (`run_zeroshot`, what `python -m looplab.eval CKPT
                     --zeroshot` calls) and its per-request log-likelihoods

A few folders hold several exported features at once (lean: every folder costs each cell a load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from looplab import convert  # noqa: E402
from looplab.checkpoint import looplab_meta  # noqa: E402
from looplab.models import LoopedLM, LoopedLMConfig  # noqa: E402
from looplab.models.exits import ExitPolicy  # noqa: E402
from looplab.models.generation import generate  # noqa: E402

TOKENIZER = "shakespeare-bpe-4096"
SEQ_LEN = 48  # the lm-eval folder's training sequence length: lm_eval's max_length and looplab.eval's context
LM_EVAL_LIMIT = 10  # documents per looplab_tiny task
GEN_TOKENS = 8
THRESHOLDS = (0.3, 0.7)
DEEPER = 5  # the test-time depth R′ checked at load time (from_pretrained(..., n_loops=R′))

# name -> (LoopedLMConfig fields, checks); every folder gets logits, greedy generation (batch 1, left-padded),
# sdpa and eager. Together they cover what the export supports: vanilla and the four StateLoop modes, prelude
# and coda, GQA, the three injections, tied embeddings, learned s0, d_s != d, the exit gate.
FOLDERS = {
    # the lm-eval folder: a shakespeare tokenizer, StateLoop with its attention mixer, prelude, coda, GQA
    "stateloop_attn": (dict(vocab_size=4096, state_mode="stateloop_attn", prelude_layers=1, coda_layers=1,
                            n_kv_heads=2, injection="add", state_init="learned"), ["lm_eval", "depth", "flash"]),
    "vanilla": (dict(state_mode="vanilla", injection="concat", tie_embeddings=True, n_kv_heads=1), []),
    "exit_gate": (dict(exit_gate="ouro", state_mode="stateloop", coda_layers=1, injection="diag", state_dim=16),
                  ["exits"]),
    "stateloop_reset": (dict(state_mode="stateloop_reset", state_in_output=False, prelude_layers=1), []),
}
BASE = dict(vocab_size=97, d_model=32, n_heads=4, n_layers=2, n_loops=3, max_seq_len=128)


def model_for(name: str, seed: int) -> LoopedLM:
    """A small LoopedLM with every parameter moved off its init (W_o, injections and gates start at zero or identity,
    which would hide a missing branch) and a sharper head (greedy ties improbable), as tests/test_remote_code.py."""
    torch.manual_seed(seed)
    m = LoopedLM(LoopedLMConfig(**{**BASE, **FOLDERS[name][0]})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        m.head.weight.mul_(4)  # tied: the embedding too
    return m


def padded(V: int, T: int, pad: tuple[int, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (len(pad), T), generator=g)
    mask = torch.ones(len(pad), T, dtype=torch.long)
    for i, p in enumerate(pad):
        mask[i, :p] = 0
    return ids, mask


def reference(name: str, m: LoopedLM, checks: list[str]) -> dict:
    V = m.config.vocab_size
    ids, mask = padded(V, 11, (0, 4, 2), seed=1)
    prompt, pmask = padded(V, 7, (0, 3), seed=2)
    ref = {"ids": ids, "mask": mask, "prompt": prompt, "pmask": pmask}
    with torch.no_grad():
        ref["logits"] = m(ids, attention_mask=mask).logits
        ref["gen_one"] = generate(m, prompt[:1], GEN_TOKENS)
        ref["gen_pad"] = generate(m, prompt, GEN_TOKENS, attention_mask=pmask)
        if "exits" in checks:
            out = m(ids, attention_mask=mask, return_all_loops=True)
            ref["exit_probs"], ref["loop_logits"] = out.exit_probs, out.loop_logits
            for q in THRESHOLDS:
                ref[f"gen_q{q}"] = generate(m, prompt, GEN_TOKENS, attention_mask=pmask, exits=ExitPolicy(threshold=q))
        if "depth" in checks:
            ref["deep_logits"] = m(ids, attention_mask=mask, n_loops=DEEPER).logits
            ref["deep_gen_pad"] = generate(m, prompt, GEN_TOKENS, attention_mask=pmask, n_loops=DEEPER)
    return ref


def lm_eval_reference(ckpt: Path) -> dict:
    """looplab.eval's zero-shot accuracies (run_zeroshot: `python -m looplab.eval CKPT --zeroshot looplab_tiny`) and
    its per-request log-likelihoods (the same adapter through lm-eval with samples logged)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from looplab.eval import LOCAL_TASKS_DIR, LooplabLM, run_zeroshot

    acc = run_zeroshot(str(ckpt), ["looplab_tiny"], limit=LM_EVAL_LIMIT)
    out = lm_eval.simple_evaluate(model=LooplabLM(checkpoint=str(ckpt)), tasks=["looplab_tiny"], limit=LM_EVAL_LIMIT,
                                  task_manager=TaskManager(include_path=[str(LOCAL_TASKS_DIR)]), bootstrap_iters=0,
                                  log_samples=True)
    requests = []
    for task, samples in out["samples"].items():
        for s in samples:
            for args, resp in zip(s["arguments"], s["resps"]):
                requests.append({"task": task, "doc_id": s["doc_id"], "context": args[0], "continuation": args[1],
                                 "loglikelihood": float(resp[0][0])})
    for task, r in acc["results"].items():
        if "acc" in r:  # the same adapter, twice: the accuracies must agree before they are a reference
            assert abs(out["results"][task]["acc,none"] - r["acc"]) < 1e-12, task
    return {"results": {t: r for t, r in acc["results"].items() if "acc" in r}, "n_samples": acc["n_samples"],
            "limit": LM_EVAL_LIMIT, "requests": requests}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "checkpoints").mkdir(parents=True)
    torch.set_num_threads(1)
    import transformers

    manifest = {"looplab_transformers": transformers.__version__, "torch": torch.__version__, "folders": {},
                "gen_tokens": GEN_TOKENS, "thresholds": list(THRESHOLDS), "deeper": DEEPER,
                "tolerance": convert.TOLERANCE}
    for seed, (name, (fields, checks)) in enumerate(FOLDERS.items()):
        m = model_for(name, seed)
        dataset = {}
        if "lm_eval" in checks:
            dataset = {"_target_": "looplab.data.lm.LMDataModule", "name": "lm_tiny", "source": "shakespeare",
                       "tokenizer": TOKENIZER, "seq_len": SEQ_LEN}
        ckpt = out / "checkpoints" / f"{name}.ckpt"
        torch.save({"state_dict": {f"model.{k}": v for k, v in m.state_dict().items()},
                    "looplab": looplab_meta(m.config, dataset=dataset)}, ckpt)
        folder = out / name
        assert convert.main(["to-hf", str(ckpt), "--out", str(folder)]) == 0, name  # checked against looplab
        torch.save(reference(name, m, checks), out / f"{name}.pt")
        entry = {"folder": str(folder), "reference": str(out / f"{name}.pt"), "checks": checks,
                 "config": {**BASE, **fields}}
        if "lm_eval" in checks:
            entry["lm_eval_command"] = convert.lm_eval_command(folder, dataset)
            entry["lm_eval"] = lm_eval_reference(ckpt)
        manifest["folders"][name] = entry
        print(f"{name}: exported to {folder}", file=sys.stderr)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"reference written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
