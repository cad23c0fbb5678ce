"""loop_schedule=parallel (models/parallel.py): cross-loop parallelism, shared and gated sliding-window KV.

The reference everywhere is the teacher-forced CLP forward (every loop over every token, loop r reading loop
r−1 one token back); cached decoding (prefill, then one folded block call per token) must equal it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from conftest import compose
from looplab.models import ConfigError, ExitPolicy, LoopedLM, LoopedLMConfig, Speculation

V = 48
BOUND = 1e-4  # max|Δ| / RMS(logits), convert's bound


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def build(kv="gswa", R=3, seed=0, **kw) -> LoopedLM:
    torch.manual_seed(seed)
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, n_loops=R, max_seq_len=64,
                loop_schedule="parallel", loop_kv=kv, loop_window=3, prelude_layers=1, coda_layers=1)
    base.update(kw)
    if base["loop_schedule"] == "sequential":
        base.pop("loop_kv"), base.pop("loop_window")
    return LoopedLM(LoopedLMConfig(**base)).eval()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.pow(2).mean().sqrt())


# options varied across the kv modes so that each is decoded at least once
OPTIONS = {"own": dict(loop_mix=(1.0, 0.5)),
           "share_first": dict(loop_norm=True, loop_mix_learned=True),
           "gswa": dict(loop_norm=True)}


@pytest.mark.parametrize("kv", ["own", "share_first", "gswa"])
def test_decoding_equals_the_clp_forward_at_batch_1_and_left_padded(kv):
    model = build(kv, **OPTIONS[kv])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :2] = 0
    n = 8  # > window 3: the window slides during decoding
    out = model.generate(ids, n, attention_mask=mask, return_logits=True)
    full = torch.cat([mask, torch.ones(3, n, dtype=torch.long)], 1)
    with torch.no_grad():
        ref = model(out.sequences, attention_mask=full).logits[:, 9:9 + n]
    assert rel(out.logits, ref) <= BOUND
    for b in range(3):  # each padded row against that row alone, at batch 1 without a mask
        alone_ids = ids[b:b + 1, mask[b].bool()]
        alone = model.generate(alone_ids, n, return_logits=True)
        assert torch.equal(alone.sequences[0, -n:], out.sequences[b, -n:])
        with torch.no_grad():
            ref1 = model(alone.sequences).logits[:, alone_ids.shape[1] - 1:-1]
        assert rel(alone.logits, ref1) <= BOUND
        assert rel(out.logits[b], alone.logits[0]) <= BOUND


def test_residual_gate_and_learned_mix_decode_exactly():
    model = build("gswa", loop_gate="residual", loop_mix_learned=True, loop_mix=(0.5, 1.5))
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, 6, return_logits=True)
    with torch.no_grad():
        ref = model(out.sequences).logits[:, 6:12]
    assert rel(out.logits, ref) <= BOUND
    names = dict(model.named_parameters())
    assert "loop_input.a" in names and "block.0.attn.loop_gate.proj.weight" in names
    assert float(names["loop_input.a"].detach()) == 0.5 and float(names["loop_input.b"].detach()) == 1.5


def test_one_block_call_per_generated_token():
    R, n = 4, 6
    model = build("gswa", R=R)
    calls = []
    model.block[0].register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    model.generate(torch.randint(0, V, (2, 5)), n)
    prefill, steps = calls[:R], calls[R:]
    assert prefill == [(2, 5, 32)] * R  # the prompt: the CLP forward, loop by loop
    assert steps == [(2, R, 32)] * (n - 1)  # each later token: ONE call on R rows per sequence


def test_the_window_binds_and_share_first_ignores_own_keys():
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        narrow = build("gswa", loop_window=2)(ids).logits
        wide = build("gswa", loop_window=64)(ids).logits
        short = build("gswa", loop_window=2)(ids[:, :2]).logits
        short_wide = build("gswa", loop_window=64)(ids[:, :2]).logits
    assert rel(narrow, wide) > 1e-3  # beyond 2 tokens the window changes what loops >= 2 read
    torch.testing.assert_close(short, short_wide)  # within it, nothing changes
    with torch.no_grad():  # share_first and own differ only in loops >= 2's keys
        assert rel(build("share_first")(ids).logits, build("own")(ids).logits) > 1e-3


def test_kv_bytes_one_full_cache_plus_windows():
    B, L, R, w = 2, 20, 4, 3
    Hkv, hd, layers, item = 2, 8, 2, 4
    full = 2 * B * Hkv * L * hd * item * layers  # one full cache of loop 1 over the block's layers
    sizes = {}
    for kv in ("own", "share_first", "gswa"):
        model = build(kv, R=R, prelude_layers=0, coda_layers=0)
        cache = model.allocate_cache(B, L)
        model(torch.randint(0, V, (B, L)), cache=cache)
        sizes[kv] = cache.nbytes()
    seq = build("own", R=R, prelude_layers=0, coda_layers=0, loop_schedule="sequential")
    cache = seq.allocate_cache(B, L)
    seq(torch.randint(0, V, (B, L)), cache=cache)
    assert sizes == {"own": R * full, "share_first": full, "gswa": full + 2 * B * Hkv * (R - 1) * w * hd * item * layers}
    assert cache.nbytes() == sizes["own"]  # own keeps what the sequential schedule keeps


def test_one_loop_parallel_is_the_sequential_model():
    ids = torch.randint(0, V, (2, 9))
    par = build("own", R=1)
    seq = build("own", R=1, loop_schedule="sequential")
    assert par.state_dict().keys() == seq.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, seq(ids).logits)
    assert "loop_schedule" not in seq.config.to_dict()  # a sequential model's dict (and hash) as before


def test_chains_start_at_each_rows_first_real_token():
    model = build("own", R=2)
    ids = torch.randint(0, V, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 3:], model(ids).logits)


def test_activation_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, V, (2, 8))
    grads = []
    for ckpt in (False, True):
        model = build("gswa", R=3).train()
        model.checkpoint_loops = ckpt
        model(ids).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)
    assert grads[0]["block.0.attn.loop_gate.weight"].abs().sum() > 0  # the gate learns


@pytest.mark.parametrize("kw, words", [
    (dict(backbone="mamba2"), "backbone=mamba2"), (dict(backbone="hybrid"), "backbone=hybrid"),
    (dict(state_mode="stateloop"), "state_mode=stateloop"), (dict(exit_gate="ouro"), "exit_gate=ouro"),
    (dict(injection="add"), "injection=add"), (dict(depth_router="expert_choice"), "depth_router=expert_choice"),
    (dict(loop_kv="shared"), "loop_kv (loop_depth.kv)='shared'"), (dict(loop_window=0), "loop_window"),
    (dict(loop_gate="key"), "loop_gate"), (dict(loop_schedule="diagonal"), "loop_schedule (loop_depth.schedule)"),
    (dict(loop_schedule="sequential", loop_kv="gswa"), "loop_kv='gswa' with loop_schedule=sequential"),
])
def test_impossible_configs_are_refused_by_name(kw, words):
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_loops=2, loop_schedule="parallel")
    base.update(kw)
    with pytest.raises(ConfigError) as e:
        LoopedLMConfig(**base)
    assert words in str(e.value)


def test_calls_it_does_not_define_are_refused_by_name():
    model = build("gswa", R=3)
    ids = torch.randint(0, V, (1, 5))
    for kw, word in ((dict(backprop_loops=1), "backprop_loops=1"), (dict(exits=ExitPolicy(at_step=1)), "exits=")):
        with pytest.raises(ValueError, match="loop_schedule=parallel") as e:
            model(ids, **kw)
        assert word in str(e.value)
    for kw, word in ((dict(speculation=Speculation(loops=1)), "speculation="), (dict(compile=True), "compile=True"),
                     (dict(exits=ExitPolicy(threshold=0.5, rule="entropy")), "exits=")):
        with pytest.raises(ValueError, match="loop_schedule=parallel") as e:
            model.generate(ids, 2, **kw)
        assert word in str(e.value)
    with pytest.raises(ValueError, match="static=False"):
        model.allocate_cache(1, 8, static=True)
    with pytest.raises(ValueError, match="set compile=false"):
        model.compile_block()


def test_loop_depth_keys_compose_and_refuse_the_depth_sampler():
    from looplab.training.compose import model_config_from_cfg

    mc = model_config_from_cfg(compose(["loop_depth=1x4", "loop_depth.schedule=parallel", "loop_depth.kv=gswa",
                                        "loop_depth.window=8", "loop_depth.mix=[1.0,0.5]"]), vocab_size=V)
    assert (mc.loop_schedule, mc.loop_kv, mc.loop_window, mc.loop_mix) == ("parallel", "gswa", 8, (1.0, 0.5))
    assert model_config_from_cfg(compose(["loop_depth=1x4"]), vocab_size=V).loop_schedule == "sequential"
    with pytest.raises(ConfigError, match="loop_depth.sampler='uniform'"):
        model_config_from_cfg(compose(["loop_depth=1x4", "loop_depth.schedule=parallel", "loop_depth.sampler=uniform"]),
                              vocab_size=V)


@pytest.mark.parametrize("kv", ["own", "share_first", "gswa"])
def test_trains_through_looplab_train(kv, tiny_overrides, tmp_path):
    from looplab.train import train

    run_dir = tmp_path / kv
    cfg = compose(tiny_overrides + ["loop_depth=1x3", "loop_depth.schedule=parallel", f"loop_depth.kv={kv}",
                                    "loop_depth.window=8", "trainer.max_steps=4", "trainer.val_check_interval=4",
                                    "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
                                    "hardware.activation_checkpointing=true", f"hydra.run.dir={run_dir}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    res = train(cfg)
    assert res["status"] == "ok" and res["global_step"] == 4
    assert res["model"]["loop_schedule"] == "parallel" and res["model"]["loop_kv"] == kv
    assert 1.0 < res["perplexity"] < 1e4
    if kv != "gswa":
        return
    # the eval CLI's diagnostics on this checkpoint: every measure at loops 1..R, the CLP forward's states
    from looplab.eval.__main__ import main

    out = tmp_path / "eval"
    report = main([str(run_dir / "checkpoints" / "last.ckpt"), "--diagnostics", "--max-batches", "1", "--out", str(out)])
    diag = json.loads((out / "eval.json").read_text())["diagnostics"]
    assert diag["n_loops"] == 3 and diag == report["diagnostics"]
    assert all(v is not None and math.isfinite(v) for v in diag["offset_cost"][1:] + diag["fixed_point_gap"])
    assert (out / "loop_diagnostics.png").stat().st_size > 0
    # table 13's measurement of the run folder: tokens/s at two batch sizes, the cache, the diagnostics with G-SWA's gate
    from looplab.bench.routed_decode import main as measure

    measure([str(run_dir), "--prompt", "4", "--new", "3", "--repeats", "1", "--batch", "1", "2", "--diagnostics",
             "--diagnostics-batches", "1", "--out", str(tmp_path / "plt.json")])
    (r,) = json.loads((tmp_path / "plt.json").read_text())["runs"]
    assert r["loop_schedule"] == "parallel" and r["loop_kv"] == "gswa" and r["loop_window"] == 8
    assert set(r["batches"]) == {"1", "2"} and r["tokens_per_s"] == r["batches"]["1"]["tokens_per_s"] > 0
    assert r["kv_bytes"] > 0 and r["mean_depth"] == 3 and r["new_tokens"] == 3
    assert r["diagnostics"]["n_loops"] == 3 and r["diagnostics"]["loop_gate"][0] is None
    assert all(0 < g < 1 for g in r["diagnostics"]["loop_gate"][1:])


def test_diagnostics_read_the_clp_forwards_loops():
    from looplab.eval.diagnostics import loop_states

    model = build("gswa", R=3)
    ids = torch.randint(0, V, (2, 9))
    st = loop_states(model, ids, n_loops=4)  # one loop beyond R: its first 3 loops are depth 3's
    with torch.no_grad():
        out = model(ids, return_all_loops=True)
        lens = torch.stack([model.logits_at(z, r, st.positions, None) for r, z in enumerate(st.readouts[:3])])
    torch.testing.assert_close(lens, out.loop_logits)


def test_pretrained_round_trip(tmp_path):
    model = build("gswa", loop_mix_learned=True, loop_mix=(1.0, 0.5), loop_gate="residual")
    model.save_pretrained(tmp_path)
    back = LoopedLM.from_pretrained(tmp_path).eval()
    assert back.config == model.config and back.config.loop_mix == (1.0, 0.5)
    ids = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
