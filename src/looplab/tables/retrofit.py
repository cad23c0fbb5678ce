"""Table 11's realistic-width model (docs/tables.md#table-11): a transformers Llama of d 512 retrofitted into a looped model.

No machine here reaches the Hub, so the source is a `LlamaForCausalLM` with random weights of a
SmolLM-like shape (d 512, 8 heads, 6 layers, SwiGLU 1,376), written with `save_pretrained` like any
downloaded folder; `looplab.convert from-hf --loops 4 --prelude 1 --coda 1` then makes it a 1⊗4
looped model with a one-layer prelude and coda (checked against the re-stacked source), and table 11
trains it briefly on lm_tiny (`train_overrides`). With a real checkpoint, pass its folder instead:

    python -m looplab.tables.retrofit OUT [--source HF_FOLDER_OR_ID]

prints the Hydra overrides that train the converted folder (one per line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SOURCE_SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                    num_key_value_heads=8, vocab_size=1024, max_position_embeddings=256)
LOOPS, PRELUDE, CODA = 4, 1, 1


TRAIN_STEPS, TRAIN_LR = 200, 1e-3  # "briefly trained": d 512 runs ~10× the d 128 arms' CPU time per step


def looped_overrides(folder: str) -> list[str]:
    """What `convert.train_overrides` gives for the converted SOURCE_SHAPE folder, without building it (table 11's
    spec names its training run before the folder exists; tests check the two agree)."""
    s = SOURCE_SHAPE
    return ["backbone=llama", f"++backbone.vocab_size={s['vocab_size']}", f"++backbone.d_model={s['hidden_size']}",
            f"++backbone.n_heads={s['num_attention_heads']}", f"++backbone.n_kv_heads={s['num_key_value_heads']}",
            f"++backbone.ffn_hidden={s['intermediate_size']}", f"++backbone.max_seq_len={s['max_position_embeddings']}",
            "++backbone.rope_base=10000.0", "++backbone.norm_eps=1e-05", "++backbone.tie_embeddings=false",
            "loop_depth.layers=1", f"loop_depth.loops={LOOPS}", f"loop_depth.prelude={PRELUDE}", f"loop_depth.coda={CODA}",
            f"init_from={folder}"]


def random_source(out: Path, seed: int = 0) -> Path:
    """A transformers Llama folder with random weights (SOURCE_SHAPE; vocab = lm_tiny's 1,024-token BPE)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**SOURCE_SHAPE, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def retrofit(out: Path, source: str | None = None, log=print) -> list[str]:
    """Convert `source` (default: a random SOURCE_SHAPE Llama under out/source) into out/looped;
    → the `python -m looplab.train` overrides that train it on lm_tiny."""
    from looplab.convert import from_hf, train_overrides

    out = Path(out)
    src = source or str(random_source(out / "source"))
    model, _ = from_hf(src, out / "looped", loops=LOOPS, prelude=PRELUDE, coda=CODA, log=log)
    return train_overrides(model.config, out / "looped")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--source", help="a transformers Llama folder or hub id (default: a random d 512 one)")
    a = p.parse_args(argv)
    for o in retrofit(Path(a.out), a.source, log=lambda *x: None):
        print(o)


if __name__ == "__main__":
    main()
