"""The transformers export with remote code (docs/interop.md#transformers-with-remote-code).

The exported modeling_looplab.py is a second implementation of LoopedLM (torch + transformers only),
so every configuration the export accepts is compared here with looplab's own model: logits on a
left-padded batch, greedy generate() at batch 1 and left-padded, exits, test-time depth. A trained
checkpoint is then exported and run where `import looplab` fails, and through lm-eval's own CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("transformers")

from looplab import convert  # noqa: E402
from looplab.models import LoopedLM, LoopedLMConfig  # noqa: E402
from looplab.models.exits import ExitPolicy  # noqa: E402
from looplab.models.generation import generate  # noqa: E402
from looplab.remote_code import write_folder  # noqa: E402

TOL = convert.TOLERANCE  # 1e-4, the bound every conversion is checked against
V = 97


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def looped(seed=0, **kw) -> LoopedLM:
    """A small LoopedLM with every parameter moved off its init (W_o, injections and gates start at zero or
    identity, which would hide a missing or miswired branch)."""
    torch.manual_seed(seed)
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=3, max_seq_len=64)
    m = LoopedLM(LoopedLMConfig(**{**base, **kw})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        m.head.weight.mul_(4)  # sharper next-token distributions: greedy ties are improbable
    return m


def export(model, folder, **load_kw):
    from transformers import AutoModelForCausalLM

    write_folder(model, folder)
    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32,
                                                **load_kw).eval()


def rel_diff(a, b, where=None):
    if where is not None:
        a, b = a[where], b[where]
    return float((a - b).abs().max() / b.pow(2).mean().sqrt())


def padded_batch(T=11, pad=(0, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (len(pad), T), generator=g)
    mask = torch.ones(len(pad), T, dtype=torch.long)
    for i, p in enumerate(pad):
        mask[i, :p] = 0
    return ids, mask


CASES = {
    "vanilla": {},
    "vanilla_gqa_tied": dict(n_kv_heads=2, tie_embeddings=True),
    "stateloop_narrow_learned_s0": dict(state_mode="stateloop", state_dim=16, state_init="learned"),
    "stateloop_attn_prelude_coda_gqa": dict(state_mode="stateloop_attn", prelude_layers=1, coda_layers=1, n_kv_heads=2),
    "stateloop_attn_narrow": dict(state_mode="stateloop_attn", state_dim=16),
    "stateloop_reset_h_readout": dict(state_mode="stateloop_reset", state_in_output=False),
    "inject_add_prelude": dict(injection="add", prelude_layers=1),
    "inject_concat_stateloop": dict(injection="concat", state_mode="stateloop"),
    "inject_diag_coda": dict(injection="diag", coda_layers=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_model_matches_looplab(case, tmp_path):
    """Logits (left-padded batch) within 1e-4 of RMS, and greedy generate() token for token at batch 1 and in a
    left-padded batch, through transformers' own generation loop and the stock DynamicCache."""
    m = looped(**CASES[case])
    hf = export(m, tmp_path)
    assert hf.config.num_hidden_layers == len(hf.model.attention_slots)
    ids, mask = padded_batch()
    with torch.no_grad():
        ours, theirs = m(ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    assert rel_diff(theirs, ours, mask.bool()) <= TOL

    prompt, pmask = padded_batch(T=7, pad=(0, 3), seed=2)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    alone = generate(m, prompt[:1], 8)
    assert torch.equal(hf.generate(prompt[:1], **kw), alone)
    batched = hf.generate(prompt, attention_mask=pmask, **kw)
    assert torch.equal(batched, generate(m, prompt, 8, attention_mask=pmask))
    assert torch.equal(batched[1, 3:], generate(m, prompt[1:, 3:], 8)[0])  # a padded row = that row alone


def test_exit_probabilities_and_threshold_generation(tmp_path):
    m = looped(exit_gate="ouro", state_mode="stateloop", coda_layers=1)
    hf = export(m, tmp_path)
    ids, mask = padded_batch()
    real = mask.bool()
    with torch.no_grad():
        ours = m(ids, attention_mask=mask, return_all_loops=True)
        out = hf(input_ids=ids, attention_mask=mask, output_exit_probs=True)
        at_q = hf(input_ids=ids, attention_mask=mask, exit_threshold=0.5)
    assert out.exit_probs.shape == (2, ids.shape[1], 3)
    assert torch.allclose(out.exit_probs.sum(-1), torch.ones(()), atol=1e-6)
    assert float((out.exit_probs - ours.exit_probs)[real].abs().max()) <= 1e-5
    assert rel_diff(out.loop_logits, ours.loop_logits, real[None].expand(3, -1, -1)) <= TOL
    assert rel_diff(out.logits, ours.logits, real) <= TOL  # all loops: the last loop's prediction
    steps = at_q.exit_steps[real]
    assert steps.min() >= 1 and steps.max() <= 3 and len(set(steps.tolist())) > 1  # the threshold binds somewhere

    prompt, pmask = padded_batch(T=7, pad=(0, 3), seed=2)
    for q in (0.3, 0.7):
        theirs = hf.generate(prompt, attention_mask=pmask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None, exit_threshold=q)
        assert torch.equal(theirs, generate(m, prompt, 8, attention_mask=pmask, exits=ExitPolicy(threshold=q))), q
    with pytest.raises(ValueError, match="exit_threshold=1.5"):
        hf(input_ids=ids, exit_threshold=1.5)


def test_depth_is_set_at_load_time(tmp_path):
    m = looped(state_mode="stateloop_attn", prelude_layers=1, coda_layers=1)
    write_folder(m, tmp_path)
    from transformers import AutoModelForCausalLM

    deep = AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True, n_loops=5).eval()
    assert deep.config.n_loops == 5 and deep.config.num_hidden_layers == 1 + 5 * 2 + 5 + 5  # prelude, block, mixer, coda
    ids, mask = padded_batch()
    with torch.no_grad():
        assert rel_diff(deep(input_ids=ids, attention_mask=mask).logits, m(ids, attention_mask=mask, n_loops=5).logits,
                        mask.bool()) <= TOL
    prompt = ids[:1, :6]
    assert torch.equal(deep.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None),
                       generate(m, prompt, 6, n_loops=5))


def test_folder_stores_the_block_once_and_reads_back(tmp_path):
    """model.safetensors holds one copy of the shared block; LoopedLM.from_pretrained and `convert from-hf` read
    the folder back with the same logits."""
    from safetensors import safe_open

    m = looped(state_mode="stateloop", prelude_layers=1, coda_layers=1, n_loops=4, tie_embeddings=True)
    folder = tmp_path / "hf"
    write_folder(m, folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "looplab" and cfg["architectures"] == ["LoopedLMForCausalLM"]
    assert set(cfg["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        stored = sum(f.get_tensor(k).numel() for k in keys)
    assert stored == sum(p.numel() for p in m.parameters())  # R = 4 loops, block stored once, tied head dropped
    assert all(k.startswith("model.") for k in keys) and "lm_head.weight" not in keys

    ids, mask = padded_batch()
    with torch.no_grad():
        want = m(ids, attention_mask=mask).logits
        back = LoopedLM.from_pretrained(str(folder)).eval()
        assert torch.equal(back(ids, attention_mask=mask).logits, want)
        assert convert.main(["from-hf", str(folder), "--out", str(tmp_path / "back")]) == 0
        again = LoopedLM.from_pretrained(str(tmp_path / "back")).eval()
        assert torch.equal(again(ids, attention_mask=mask).logits, want)


@pytest.mark.parametrize("field,kw", [
    ("backbone=mamba2", dict(backbone="mamba2", d_model=32, headdim=16, d_state=16, n_heads=2)),
    ("backbone=hybrid", dict(backbone="hybrid", d_model=32, headdim=16, d_state=16, n_heads=2, n_layers=4)),
    ("state_mode=stateloop_mamba2", dict(state_mode="stateloop_mamba2", headdim=16, d_state=16)),
    ("loop_schedule=parallel", dict(loop_schedule="parallel", loop_kv="gswa", loop_window=4)),
    ("depth_router=expert_choice", dict(depth_router={"name": "expert_choice"})),
])
def test_export_refuses_what_the_exported_code_cannot_run(field, kw, tmp_path):
    m = looped(**kw)
    ckpt = tmp_path / "last.ckpt"
    from looplab.checkpoint import looplab_meta

    torch.save({"state_dict": {f"model.{k}": v for k, v in m.state_dict().items()}, "looplab": looplab_meta(m.config, {})},
               ckpt)
    name, value = field.split("=")
    named = rf"{name}=['\"]?{value}\b"  # the field and its value, quoted or not
    with pytest.raises(convert.ConversionError, match=rf"{named}.*--looplab"):
        convert.to_hf(str(ckpt), tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out" / "config.json").exists()
    with pytest.raises(ValueError, match=named):
        write_folder(m, tmp_path / "direct")


def test_to_hf_vllm_writes_parallel_loops_for_vllm_and_transformers_refuses_them_by_name(tmp_path, capsys):
    """`to-hf --vllm` writes what looplab's vLLM plugin runs, parallel loops included (tests_engines/vllm checks
    vLLM's tokens against looplab's): the same folder layout, read back exactly by looplab; transformers' remote code
    refuses it at load naming loop_schedule and pointing to vLLM; without --vllm the export refuses it, pointing to
    --vllm; and --vllm refuses what the plugin cannot run (a Mamba-2 block), naming the field."""
    from transformers import AutoModelForCausalLM

    from looplab.checkpoint import looplab_meta
    from looplab.remote_code import unsupported

    m = looped(loop_schedule="parallel", loop_kv="gswa", loop_window=4, loop_mix_learned=True)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in m.state_dict().items()},
                "looplab": looplab_meta(m.config, {"seq_len": 32})}, ckpt)
    with pytest.raises(convert.ConversionError, match=r"loop_schedule=parallel.*to-hf --vllm"):
        convert.to_hf(str(ckpt), tmp_path / "refused", log=lambda *_: None)
    assert convert.main(["to-hf", str(ckpt), "--out", str(tmp_path / "v"), "--vllm"]) == 0
    out = capsys.readouterr().out
    assert "read back by looplab: max |Δlogit| / RMS(logits) = 0.000e+00" in out
    assert "lm_eval --model vllm --model_args pretrained=" in out and "max_model_len=34" in out
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert (cfg["loop_schedule"], cfg["loop_kv"], cfg["loop_window"]) == ("parallel", "gswa", 4)
    ids, mask = padded_batch()
    with torch.no_grad():
        back = LoopedLM.from_pretrained(str(tmp_path / "v")).eval()
        assert torch.equal(back(ids, attention_mask=mask).logits, m(ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match=r"loop_schedule='parallel'.*vLLM runs parallel loops"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "v"), trust_remote_code=True)
    ssm = looped(backbone="mamba2", d_model=32, headdim=16, d_state=16, n_heads=2)
    assert "backbone='mamba2'" in unsupported(ssm.config, "vllm")
    with pytest.raises(ValueError, match=r"cannot export for vllm: backbone='mamba2'"):
        write_folder(ssm, tmp_path / "ssm", engine="vllm")
    with pytest.raises(ValueError, match="engine='sglang'"):
        unsupported(m.config, "sglang")


def test_exported_code_refuses_an_edited_config(tmp_path):
    """The modeling file refuses, naming the field, a config.json it cannot run (e.g. edited by hand)."""
    from transformers import AutoModelForCausalLM

    write_folder(looped(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["loop_schedule"] = "parallel"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="loop_schedule='parallel'"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True)


def test_loaded_weights_survive_initialization_and_the_head_stays_tied(tmp_path):
    """Guards that differ between transformers releases (tests_engines/transformers checks them on each): 5.x calls
    _init_weights after loading and marks what it loaded `_is_hf_initialized` (5.0.0 overwrote every loaded weight),
    and 5.3.0 skips tying a remote-code model's head when the checkpoint omits it."""
    import torch.nn as nn

    m = looped(injection="concat", state_mode="stateloop", tie_embeddings=True)
    hf = export(m, tmp_path)
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    for p in hf.parameters():
        p._is_hf_initialized = True
    hf.apply(hf._init_weights)  # what 5.x's initialize_weights does after loading
    assert all(torch.equal(v, before[k]) for k, v in hf.state_dict().items())
    assert hf.lm_head.weight is hf.model.embed.weight
    hf.lm_head.weight = nn.Parameter(torch.empty_like(hf.lm_head.weight))  # as 5.3.0 leaves it
    hf.tie_weights()
    assert hf.lm_head.weight is hf.model.embed.weight
    ids, mask = padded_batch()
    with torch.no_grad():
        assert rel_diff(hf(input_ids=ids, attention_mask=mask).logits, m(ids, attention_mask=mask).logits,
                        mask.bool()) <= TOL


def _flash_stub():
    """tests_engines/transformers/flash_stub.py: transformers' real flash path with CPU stand-ins for the kernels."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests_engines" / "transformers" / "flash_stub.py"
    spec = importlib.util.spec_from_file_location("looplab_flash_stub", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flash_attention_runs_through_transformers_flash_path(tmp_path):
    """attn_implementation="flash_attention_2": transformers' flash_attention_forward reads module.config and takes a
    (B, L) padding mask. Run through transformers' own flash path (its unpadding included) with CPU stand-ins for
    the kernels: fp16 logits within fp16 rounding of sdpa's and of looplab's, greedy tokens equal to sdpa's on a
    left-padded batch (the varlen kernel) and at batch 1 (the dense one). An fp32 model and a 4-D mask are refused
    by name; transformers itself refuses flash_attention_2 at load where flash_attn is not installed."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    stub = _flash_stub()
    m = looped(state_mode="stateloop_attn", prelude_layers=1, coda_layers=1, n_kv_heads=2)  # every kind of slot
    write_folder(m, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True, dtype=torch.float16,
                                              attn_implementation="sdpa").eval()
    ids, mask = padded_batch(pad=(0, 4, 2))
    prompt, pmask = padded_batch(T=7, pad=(0, 3), seed=2)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        sdpa = hf(input_ids=ids, attention_mask=mask).logits
        ours = m(ids, attention_mask=mask).logits
    sdpa_pad, sdpa_one = hf.generate(prompt, attention_mask=pmask, **kw), hf.generate(prompt[:1], **kw)
    stub.use_flash(hf)
    with stub.stub_flash_attn() as calls, torch.no_grad():
        flash = hf(input_ids=ids, attention_mask=mask).logits
        assert calls["varlen"] > 0 and calls["dense"] == 0
        assert torch.equal(hf.generate(prompt, attention_mask=pmask, **kw), sdpa_pad)
        calls.update(dense=0, varlen=0)
        assert torch.equal(hf.generate(prompt[:1], **kw), sdpa_one)
        assert calls["dense"] > 0 and calls["varlen"] == 0
        real = mask.bool()
        assert rel_diff(flash.float(), sdpa.float(), real) <= 3e-2 and rel_diff(flash.float(), ours, real) <= 3e-2
        with pytest.raises(ValueError, match="takes a 2-D"):
            hf(input_ids=ids, attention_mask=real[:, None, None, :].expand(-1, 1, ids.shape[1], -1))
        fp32 = export(m, tmp_path)
        stub.use_flash(fp32)
        with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' runs in float16 or bfloat16"):
            fp32(input_ids=ids, attention_mask=mask)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises((ImportError, ValueError), match="(?i)flash"):
            export(m, tmp_path, attn_implementation="flash_attention_2")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_attention_implementations(attn, tmp_path):
    """sdpa and eager give looplab's logits (flex_attention is refused by transformers: the mask is a boolean tensor)."""
    m = looped(state_mode="stateloop_attn", coda_layers=1, n_kv_heads=2)
    hf = export(m, tmp_path, attn_implementation=attn)
    assert hf.config._attn_implementation == attn
    ids, mask = padded_batch()
    with torch.no_grad():
        assert rel_diff(hf(input_ids=ids, attention_mask=mask).logits, m(ids, attention_mask=mask).logits,
                        mask.bool()) <= TOL
    with pytest.raises(ValueError, match="(?i)flex"):
        export(m, tmp_path, attn_implementation="flex_attention")


# ------------------------------------------------- a trained checkpoint, without looplab, and through lm_eval's CLI
@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
    """A StateLoop 1⊗2 model with prelude and coda, trained a few steps on text with the shakespeare tokenizer,
    exported by `python -m looplab.convert to-hf` (in-process main)."""
    from test_eval_cli import COMMON, _lm_files, _train

    tmp = tmp_path_factory.mktemp("trained")
    train_file, val_file = _lm_files(tmp)
    over = COMMON + ["dataset=hf", "dataset.source=json", f"dataset.data_files={{train:'{train_file}',validation:'{val_file}'}}",
                     "dataset.val_split=validation", "dataset.seq_len=32", "dataset.batch_size=8", "dataset.val_tokens=512",
                     f"dataset.cache_dir={tmp / 'cache'}", "dataset.num_proc=1", "loop_depth=1x2", "loop_depth.prelude=1",
                     "loop_depth.coda=1", "state_mode=stateloop", "backbone.max_seq_len=128", "trainer.limit_test_batches=1"]
    res = _train(over, tmp / "run")
    assert res["status"] == "ok"
    ckpt = tmp / "run" / "checkpoints" / "last.ckpt"
    out = tmp / "hf"
    assert convert.main(["to-hf", str(ckpt), "--out", str(out)]) == 0
    return ckpt, out


def test_trained_export_runs_without_looplab(trained_export, tmp_path):
    """The exported folder in a process where `import looplab` fails: logits and greedy generate() (batch 1 and a
    left-padded batch) equal looplab's, computed here from the checkpoint."""
    from looplab.checkpoint import load_model

    ckpt, folder = trained_export
    model, _ = load_model(str(ckpt))
    model.eval()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["state_mode"] == "stateloop" and cfg["prelude_layers"] == 1 and cfg["coda_layers"] == 1
    assert (folder / "tokenizer_config.json").is_file() and (folder / "modeling_looplab.py").is_file()
    ids, mask = padded_batch(T=10, pad=(0, 3), seed=5)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    gen_one = generate(model, ids[:1], 6)
    gen_pad = generate(model, ids, 6, attention_mask=mask)
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")

    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(textwrap.dedent("""\
        import sys
        class _NoLooplab:
            def find_spec(self, name, path=None, target=None):
                if name == "looplab" or name.startswith("looplab."):
                    raise ImportError("looplab is blocked in this process")
        sys.meta_path.insert(0, _NoLooplab())
        """))
    script = textwrap.dedent(f"""\
        import torch
        try:
            import looplab
            raise SystemExit("looplab imported")
        except ImportError:
            pass
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32).eval()
        x = torch.load({str(tmp_path / 'inputs.pt')!r})
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            logits = hf(input_ids=x["ids"], attention_mask=x["mask"]).logits
        one = hf.generate(x["ids"][:1], **kw)
        pad = hf.generate(x["ids"], attention_mask=x["mask"], **kw)
        import sys
        assert not any(m == "looplab" or m.startswith("looplab.") for m in sys.modules)
        torch.save({{"logits": logits, "one": one, "pad": pad}}, {str(tmp_path / 'out.pt')!r})
        """)
    env = {**os.environ, "PYTHONPATH": str(blocker), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    # no looplab on the path either: run from an empty folder, not the repository (src/ is installed editable)
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert rel_diff(got["logits"], logits, mask.bool()) <= TOL
    assert torch.equal(got["one"], gen_one) and torch.equal(got["pad"], gen_pad)


def test_lm_eval_cli_equals_looplab_eval(trained_export, tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --tasks looplab_tiny --include_path
    <looplab's tasks>` gives looplab.eval's accuracy on every task and its log-likelihoods within 1e-4."""
    from looplab.eval import LOCAL_TASKS_DIR, run_zeroshot

    ckpt, folder = trained_export
    limit = 6
    printed = convert.lm_eval_command(folder, {"seq_len": 32})  # what `to-hf` prints; the run trained at seq_len 32
    assert printed.startswith("lm_eval --model hf ") and f"--include_path {LOCAL_TASKS_DIR}" in printed
    cmd = [sys.executable, "-m"] + printed.split() + [
        "--limit", str(limit), "--device", "cpu", "--batch_size", "4", "--output_path", str(tmp_path / "out"),
        "--log_samples"]
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    results_file = next((tmp_path / "out").rglob("results_*.json"))
    theirs = json.loads(results_file.read_text())["results"]

    ours = run_zeroshot(str(ckpt), tasks=["looplab_tiny"], limit=limit)
    tasks = sorted(t for t in ours["results"] if t != "looplab_tiny")
    assert tasks == ["looplab_tiny_cloze", "looplab_tiny_next_line", "looplab_tiny_speaker"]
    for t in tasks:
        assert theirs[t]["acc,none"] == pytest.approx(ours["results"][t]["acc"], abs=1e-12), t
        assert ours["n_samples"][t] == limit

    # per-choice log-likelihoods from lm_eval's samples against the model's own (an independent forward pass)
    from looplab.checkpoint import load_model
    from looplab.data.tokenizer import load_tokenizer
    from looplab.testing.lm_eval_samples import logged_loglikelihoods

    model, meta = load_model(str(ckpt))
    model.eval()
    checked = 0
    L = 32  # the max_length both sides score with: a longer request keeps its last L + 1 tokens
    tok = load_tokenizer(meta["dataset"]["tokenizer"])
    for where, ll, own in logged_loglikelihoods(tmp_path / "out", tok, model, L):
        assert abs(ll - own) <= 1e-4 * max(1.0, abs(own)), (*where, ll, own)
        checked += 1
    assert checked >= 3 * limit * 2  # three tasks, >= 2 choices per document


def test_to_hf_vllm_writes_exits_as_the_folders_defaults_and_refuses_them_by_name(tmp_path):
    """`to-hf --vllm --exit-threshold Q --exit-skip kv_copy` writes the plugin's exit settings into config.json (so
    that `lm_eval --model vllm`, which cannot pass hf_overrides, serves with them; tests_engines/vllm runs it); looplab
    still reads the folder at every loop. Refused by name before anything is written: the flags without --vllm, a
    threshold outside (0, 1], a handling the plugin does not run, a skip without a threshold, a model without a gate.
    A model that --vllm refuses too is not pointed to --vllm."""
    from looplab.checkpoint import looplab_meta

    def ckpt_of(m, name):
        path = tmp_path / f"{name}.ckpt"
        torch.save({"state_dict": {f"model.{k}": v for k, v in m.state_dict().items()},
                    "looplab": looplab_meta(m.config, {"seq_len": 32})}, path)
        return str(path)

    m = looped(exit_gate="ouro")
    ckpt = ckpt_of(m, "gated")
    out = tmp_path / "v"
    assert convert.main(["to-hf", ckpt, "--out", str(out), "--vllm", "--exit-threshold", "0.5",
                         "--exit-skip", "kv_copy", "--no-check"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["exit_threshold"], cfg["exit_skip"]) == (0.5, "kv_copy")
    ids, mask = padded_batch()
    with torch.no_grad():
        back = LoopedLM.from_pretrained(str(out)).eval()
        assert torch.equal(back(ids, attention_mask=mask).logits, m(ids, attention_mask=mask).logits)

    quiet = dict(log=lambda *_: None, check=False)
    for kw, match in [(dict(exit_threshold=0.5), r"--exit-threshold set vLLM's serving defaults.*add --vllm"),
                      (dict(vllm=True, exit_threshold=1.5), r"exit_threshold=1\.5.*\(0, 1\]"),
                      (dict(vllm=True, exit_threshold=0.5, exit_skip="zeros"), r"exit_skip='zeros'.*kv_copy"),
                      (dict(vllm=True, exit_skip="kv_copy"), r"exit_skip='kv_copy'.*needs an exit_threshold")]:
        with pytest.raises(convert.ConversionError, match=match):
            convert.to_hf(ckpt, tmp_path / "refused", **quiet, **kw)
    with pytest.raises(convert.ConversionError, match=r"exit_threshold=0\.5.*needs a model with an exit gate"):
        convert.to_hf(ckpt_of(looped(), "plain"), tmp_path / "refused", vllm=True, exit_threshold=0.5, **quiet)
    assert not (tmp_path / "refused").exists()

    ssm = ckpt_of(looped(backbone="mamba2", d_model=32, headdim=16, d_state=16, n_heads=2), "ssm")
    with pytest.raises(convert.ConversionError) as refused:
        convert.to_hf(ssm, tmp_path / "refused", **quiet)
    assert "backbone=mamba2" in str(refused.value) and "--vllm" not in str(refused.value)
