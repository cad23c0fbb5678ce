"""The exported remote-code folder on one transformers release, where looplab is not installed.

Run by each cell of scripts/transformers-matrix (its own venv: torch 2.13.0, one transformers, lm-eval,
accelerate, pytest). The folders and looplab's reference outputs come from make_reference.py, run with looplab's
venv. Checked here, against looplab's numbers:
- logits on a left-padded batch within 1e-4 of their RMS, with sdpa and with eager attention;
- greedy `generate()` at batch 1 and in a left-padded batch, token for token;
- the exit gate's distribution, every loop's logits, and `generate(exit_threshold=q)`;
- the test-time depth R′ set at load (`n_loops=`);
- lm-eval's own `hf` model (`lm_eval --model hf ...`, the command `to-hf` prints): the accuracies of
  `python -m looplab.eval --zeroshot` (run_zeroshot) exactly, each request's log-likelihood within 1e-4;
- flash attention: refused at load where flash_attn is not installed (transformers' own check), and
  transformers' flash path itself run with CPU stand-ins for the kernels (flash_stub.py): the model hands it
  `module.config` and a (B, L) padding mask, and gives sdpa's tokens; an fp32 model is refused by name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_stub import stub_flash_attn, use_flash

# the folder make_reference.py wrote with looplab's venv
REF = Path(os.environ.get("LOOPLAB_TF_REF", Path(__file__).resolve().parents[2] / ".venvs" / "transformers-ref"))
_manifest = json.loads((REF / "manifest.json").read_text()) if (REF / "manifest.json").is_file() else {"folders": {}}
FOLDERS = sorted(_manifest["folders"]) or ["<no reference>"]
GEN = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="session")
def manifest() -> dict:
    if not _manifest["folders"]:
        pytest.fail(f"no reference at {REF}: run `.venv/bin/python tests_engines/transformers/make_reference.py "
                    f"--out {REF}` (scripts/transformers-matrix does)")
    return _manifest


def entry(manifest, name):
    return manifest["folders"][name]


def load(e, **kw):
    from transformers import AutoModelForCausalLM

    kw.setdefault("dtype", torch.float32)
    return AutoModelForCausalLM.from_pretrained(e["folder"], trust_remote_code=True, **kw).eval()


def ref_of(e) -> dict:
    return torch.load(e["reference"], weights_only=True)


def rel_diff(a, b, where):
    a, b = a.float(), b.float()
    return float((a[where] - b[where]).abs().max() / b[where].pow(2).mean().sqrt())


def test_environment(manifest):
    """A clean cell: the transformers it was built for, torch 2.13.0, and no looplab to fall back on."""
    import transformers

    assert importlib.util.find_spec("looplab") is None, "looplab is importable in this cell"
    want = os.environ.get("LOOPLAB_TF_EXPECT")
    if want:
        assert transformers.__version__ == want, (transformers.__version__, want)
    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    assert manifest["folders"], "the reference holds no folder"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", FOLDERS)
def test_logits_and_greedy_generation(manifest, name, attn):
    e = entry(manifest, name)
    ref = ref_of(e)
    hf = load(e, attn_implementation=attn)
    assert hf.config._attn_implementation == attn
    assert hf.config.num_hidden_layers == len(hf.model.attention_slots)
    with torch.no_grad():
        logits = hf(input_ids=ref["ids"], attention_mask=ref["mask"]).logits
    assert rel_diff(logits, ref["logits"], ref["mask"].bool()) <= manifest["tolerance"]
    n = manifest["gen_tokens"]
    assert torch.equal(hf.generate(ref["prompt"][:1], max_new_tokens=n, **GEN), ref["gen_one"])
    assert torch.equal(hf.generate(ref["prompt"], attention_mask=ref["pmask"], max_new_tokens=n, **GEN), ref["gen_pad"])


def test_exit_gate(manifest):
    e = entry(manifest, "exit_gate")
    ref = ref_of(e)
    hf = load(e)
    real = ref["mask"].bool()
    R = hf.config.n_loops
    with torch.no_grad():
        out = hf(input_ids=ref["ids"], attention_mask=ref["mask"], output_exit_probs=True)
    assert float((out.exit_probs - ref["exit_probs"])[real].abs().max()) <= 1e-5
    assert rel_diff(out.loop_logits, ref["loop_logits"], real[None].expand(R, -1, -1)) <= manifest["tolerance"]
    for q in manifest["thresholds"]:
        got = hf.generate(ref["prompt"], attention_mask=ref["pmask"], max_new_tokens=manifest["gen_tokens"],
                          exit_threshold=q, **GEN)
        assert torch.equal(got, ref[f"gen_q{q}"]), q


def test_test_time_depth(manifest):
    e = entry(manifest, "stateloop_attn")
    ref = ref_of(e)
    R2 = manifest["deeper"]
    hf = load(e, n_loops=R2)
    c = hf.config
    assert c.n_loops == R2
    assert c.num_hidden_layers == c.prelude_layers + R2 * (c.n_layers + 1 + c.coda_layers)  # block, mixer, coda
    with torch.no_grad():
        logits = hf(input_ids=ref["ids"], attention_mask=ref["mask"]).logits
    assert rel_diff(logits, ref["deep_logits"], ref["mask"].bool()) <= manifest["tolerance"]
    got = hf.generate(ref["prompt"], attention_mask=ref["pmask"], max_new_tokens=manifest["gen_tokens"], **GEN)
    assert torch.equal(got, ref["deep_gen_pad"])


def test_lm_eval_hf_model_equals_looplab_eval(manifest, tmp_path):
    """lm-eval's own command line, as `to-hf` printed it, on looplab_tiny: looplab.eval's accuracies exactly and its
    per-request log-likelihoods within 1e-4."""
    e = entry(manifest, "stateloop_attn")
    want = e["lm_eval"]
    cmd = [sys.executable, "-m"] + e["lm_eval_command"].split() + [
        "--limit", str(want["limit"]), "--device", "cpu", "--batch_size", "4", "--output_path", str(tmp_path / "out"),
        "--log_samples"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    theirs = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert sorted(want["results"]) == ["looplab_tiny_cloze", "looplab_tiny_next_line", "looplab_tiny_speaker"]
    for task, ours in want["results"].items():
        assert theirs[task]["acc,none"] == pytest.approx(ours["acc"], abs=1e-12), task
        assert theirs[task]["acc_norm,none"] == pytest.approx(ours["acc_norm"], abs=1e-12), task
    lls = {(q["task"], q["doc_id"], q["context"], q["continuation"]): q["loglikelihood"] for q in want["requests"]}
    seen = 0
    for f in (tmp_path / "out").rglob("samples_looplab_tiny_*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            task = f.name[len("samples_"):].rsplit("_", 1)[0]
            for args, resp in zip(s["arguments"].values(), s["resps"]):
                own = lls[(task, s["doc_id"], args["arg_0"], args["arg_1"])]
                ll = float(resp[0][0])
                assert abs(ll - own) <= 1e-4 * max(1.0, abs(own)), (task, s["doc_id"], args["arg_1"], ll, own)
                seen += 1
    assert seen == len(lls) and seen >= 3 * want["limit"] * 2


def test_flash_attention_refused_at_load_without_its_package(manifest):
    """Where flash_attn is not installed (any CPU machine), transformers' own load-time check refuses it, by name."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here: the real kernel is used, nothing is refused")
    with pytest.raises((ImportError, ValueError)) as err:
        load(entry(manifest, "vanilla"), attn_implementation="flash_attention_2")
    assert "flash" in str(err.value).lower()


def test_flash_attention_path(manifest):
    """transformers' flash_attention_2 path (its flash_attention_forward, unpadding and padding) with CPU stand-ins
    for the kernels: the attention slots carry the config it reads, it gets a (B, L) padding mask (the varlen kernel
    runs on the left-padded batch, the dense one without padding), and in fp16 its logits are sdpa's within fp16
    rounding and its greedy tokens are sdpa's. An fp32 model and a 4-D mask are refused, naming the implementation;
    an fp32 model under autocast runs."""
    e = entry(manifest, "stateloop_attn")  # prelude, coda, GQA, the StateLoop mixer: every kind of slot
    ref = ref_of(e)
    hf = load(e, dtype=torch.float16, attn_implementation="sdpa")
    ids, mask, prompt, pmask = ref["ids"], ref["mask"], ref["prompt"], ref["pmask"]
    n = manifest["gen_tokens"]
    with torch.no_grad():
        sdpa_logits = hf(input_ids=ids, attention_mask=mask).logits
    sdpa_pad = hf.generate(prompt, attention_mask=pmask, max_new_tokens=n, **GEN)
    sdpa_one = hf.generate(prompt[:1], max_new_tokens=n, **GEN)
    use_flash(hf)
    assert all(s.config is hf.config for s in hf.model.attention_slots)
    with stub_flash_attn() as calls, torch.no_grad():
        flash_logits = hf(input_ids=ids, attention_mask=mask).logits
        assert calls["varlen"] > 0 and calls["dense"] == 0  # padded rows: unpadded by the (B, L) mask
        flash_pad = hf.generate(prompt, attention_mask=pmask, max_new_tokens=n, **GEN)
        calls.update(dense=0, varlen=0)
        flash_one = hf.generate(prompt[:1], max_new_tokens=n, **GEN)
        assert calls["dense"] > 0 and calls["varlen"] == 0  # no padding: the dense kernel, causal bottom-right
    real = mask.bool()
    # fp16 (measured: 0.6% of the logits' RMS from sdpa's, 0.8% from looplab's fp32; a wrong mask or slot: O(1))
    assert rel_diff(flash_logits, sdpa_logits, real) <= 3e-2
    assert rel_diff(flash_logits, ref["logits"], real) <= 3e-2
    assert torch.equal(flash_pad, sdpa_pad) and torch.equal(flash_one, sdpa_one)

    with stub_flash_attn(), torch.no_grad():
        with pytest.raises(ValueError, match="takes a 2-D"):
            hf(input_ids=ids, attention_mask=real[:, None, None, :].expand(-1, 1, ids.shape[1], -1))
        fp32 = load(e)
        use_flash(fp32)
        with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' runs in float16 or bfloat16"):
            fp32(input_ids=ids, attention_mask=mask)
        with torch.autocast("cpu", dtype=torch.float16):  # an fp32 model under autocast computes in fp16: it runs
            assert rel_diff(fp32(input_ids=ids, attention_mask=mask).logits, ref["logits"], real) <= 3e-2
