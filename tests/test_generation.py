"""Cached decoding and exit-gate skip decoding against full recomputation (docs/decoding.md).

Cached decoding against full forwards for every registered variant (every backbone, state update, mixer, exit gate
and injection, in left-padded batches, plain and with the exit read-out) is the conformance kit's
(tests/test_conformance.py); this file checks what is particular to the decoders: the cache's memory, sampling and
eos, the skip handling's KV reuse, zero-shot rules against forward, the CLI and the benchmark. StateLoop's W_o and
the exit gate are given random weights: at init W_o is zero (StateLoop would equal Vanilla) and the gate is near
0.5 everywhere, which would test little.
"""

from __future__ import annotations

import copy

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.cache import KVCache
from looplab.models.exit_compute import skip_compute_unsupported
from looplab.models.exits import ExitPolicy
from looplab.models.generation import Sampling, decode_one_token, generate
from looplab.models.registry import BACKBONES, STATE_MIXERS, STATE_UPDATES

V = 61
ATOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def make_model(backbone="llama", state_mode="vanilla", exit_gate="none", n_loops=3, seed=0, gate_bias=None,
               state_mixer=None) -> LoopedLM:
    torch.manual_seed(seed)
    cfg = LoopedLMConfig(
        vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=n_loops, backbone=backbone,
        hybrid_pattern="MA", state_mode=state_mode, state_mixer=state_mixer, exit_gate=exit_gate, max_seq_len=64,
        d_state=8, headdim=16, chunk_size=4, kernel="torch",
    )
    model = LoopedLM(cfg).eval()
    with torch.no_grad():
        if model.state is not None:
            model.state.state_out.weight.normal_(0, 0.2)
        if model.exit_gate is not None:
            # logit std ≈ 1 around 0: tokens exit at different depths under q = 0.5
            model.exit_gate.proj.weight.normal_(0, 1 / 32**0.5)
            model.exit_gate.proj.bias.fill_(-0.3 if gate_bias is None else gate_bias)
    return model


def recompute_greedy(model, prompt, n, exit_threshold=None):
    """Reference: the full forward pass over the whole prefix at every step, no cache."""
    seq, logits = prompt, []
    for _ in range(n):
        lg = model(seq, exits=ExitPolicy.from_kwargs(exit_threshold=exit_threshold)).logits[:, -1]
        logits.append(lg)
        seq = torch.cat([seq, lg.argmax(-1, keepdim=True)], 1)
    return seq, torch.stack(logits, 1)


# ------------------------------------------------------------- cache memory
@pytest.mark.parametrize("backbone", BACKBONES.names())
@pytest.mark.parametrize("mixer", STATE_MIXERS.names())
@torch.no_grad()
def test_cache_memory_growth(backbone, mixer):
    """Only key/value entries grow with the length, by exactly their width per token; a recurrent entry is constant."""
    model = make_model(backbone, "vanilla" if mixer == "none" else "stateloop", state_mixer=mixer)
    cfg = model.config
    cache = model.allocate_cache(1, 40)
    sizes = {}
    model(torch.randint(0, V, (1, 10)), cache=cache)
    sizes[10] = cache.nbytes()
    for n in range(11, 31):
        model(torch.randint(0, V, (1, 1)), cache=cache)
        sizes[n] = cache.nbytes()
    n_kv = sum(1 for k in cfg.layer_types if k == "A") + (STATE_MIXERS.get(mixer).supports.cache == "kv")
    # 2 (k, v) × loops × key/value entries × width × 4 bytes per token, and nothing else grows
    per_token = 2 * cfg.n_loops * n_kv * cfg.d_model * 4
    for n in sizes:
        assert sizes[n] - sizes[10] == per_token * (n - 10)
    if n_kv == 0:  # recurrent entries only: constant in length
        assert len(set(sizes.values())) == 1 and sizes[10] > 0


def test_right_padding_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, torch.ones(2, 4, dtype=torch.long), 2, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))


# ---------------------------------------------------------------- sampling
@torch.no_grad()
def test_sampling_limits_and_eos():
    model = make_model()
    prompt = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(4))
    greedy = generate(model, prompt, 6)
    assert torch.equal(model.generate(prompt, 6), greedy)  # the LoopedLM method delegates here
    with pytest.raises(TypeError):
        model.generate(prompt, 6, 0.0)  # options are keyword-only
    # top_k=1 and a vanishing top_p leave only the argmax
    assert torch.equal(generate(model, prompt, 6, sampling=Sampling(temperature=1.0, top_k=1)), greedy)
    assert torch.equal(generate(model, prompt, 6, sampling=Sampling(temperature=0.7, top_p=1e-6)), greedy)
    a = generate(model, prompt, 6, sampling=Sampling(temperature=1.0, generator=torch.Generator().manual_seed(5)))
    b = generate(model, prompt, 6, sampling=Sampling(temperature=1.0, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(a, b)
    # sampled tokens stay inside the top-k set
    logits = torch.randn(3, V)
    top = logits.topk(4).indices
    for s in range(20):
        tok = Sampling(1.0, top_k=4, generator=torch.Generator().manual_seed(s)).sample(logits)
        assert all(int(t) in top[i].tolist() for i, t in enumerate(tok))
    # eos: row 0 stops at its 3rd greedy token and is padded with eos afterwards
    eos = int(greedy[0, 4 + 2])
    out = generate(model, prompt, 6, eos_token_id=eos)
    first = [int((greedy[r, 4:] == eos).nonzero()[0]) if (greedy[r, 4:] == eos).any() else None for r in range(2)]
    for r in range(2):
        if first[r] is not None:
            assert (out[r, 4 + first[r]:] == eos).all()
            assert torch.equal(out[r, : 4 + first[r]], greedy[r, : 4 + first[r]])
    # when every row is done, generation stops early
    single = generate(model, prompt[:1], 6, eos_token_id=eos)
    assert single.shape[1] == 4 + first[0] + 1


# ------------------------------------------------------------ skip_compute
# every registered state update on a llama block, and the attention mixer (whose keys/values kv_copy fills too)
LLAMA_STATES = (*STATE_UPDATES.names(), "stateloop_attn")


@pytest.mark.parametrize("state_mode", LLAMA_STATES)
@torch.no_grad()
def test_skip_compute_never_exiting_equals_cached(state_mode):
    model = make_model("llama", state_mode, "ouro", n_loops=4, gate_bias=-20.0)
    with torch.no_grad():
        model.exit_gate.proj.weight.zero_()
    prompt = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    plain = generate(model, prompt, 8, attention_mask=mask, return_logits=True)
    skip = generate(model, prompt, 8, attention_mask=mask, return_logits=True,
                    exits=ExitPolicy.from_kwargs(exit_threshold=0.9, skip_compute=True))
    assert torch.equal(skip.sequences, plain.sequences)
    torch.testing.assert_close(skip.logits, plain.logits, atol=ATOL, rtol=1e-4)
    assert (skip.exit_steps == 4).all()


@pytest.mark.parametrize("state_mode", LLAMA_STATES)
@torch.no_grad()
def test_skip_compute_early_exit_uses_threshold_depth_and_reuses_kv(state_mode):
    """Each skip step gives the logits forward(exit_threshold=q) gives from the same cache, and
    for every loop r deeper than a row's exit depth e the new position's KV equals loop e's."""
    model = make_model("llama", state_mode, "ouro", n_loops=4, seed=1, gate_bias=-0.3)
    R, q = 4, 0.5
    B, T = 3, 5
    prompt = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(7))
    cache = model.allocate_cache(B, T + 12)
    model(prompt, cache=cache, exits=ExitPolicy.from_kwargs(exit_threshold=q))  # prefill runs every loop
    keys = [k for (r, k), e in cache.entries.items() if r == 0 and isinstance(e, KVCache)]
    seen_mixed = seen_all_early = False
    tok = prompt[:, -1:]
    for step in range(12):
        ref_cache = copy.deepcopy(cache)
        ref = model(tok, cache=ref_cache, exits=ExitPolicy.from_kwargs(exit_threshold=q))
        logits, exits = decode_one_token(model, tok, cache,
                                         exits=ExitPolicy.from_kwargs(exit_threshold=q, skip_compute=True))
        assert torch.equal(exits, ref.exit_steps[:, 0])
        torch.testing.assert_close(logits, ref.logits[:, 0], atol=ATOL, rtol=1e-4)
        pos = int(cache.lengths[0]) - 1  # no padding: every row at one length
        for b in range(B):
            e = int(exits[b]) - 1
            for key in keys:
                for r in range(R):
                    got_k, got_v = cache[r, key].k[b, :, pos], cache[r, key].v[b, :, pos]
                    src = cache[min(r, e), key]
                    assert torch.equal(got_k, src.k[b, :, pos]) and torch.equal(got_v, src.v[b, :, pos])
                    if r <= e:  # loops that ran hold the exact values
                        torch.testing.assert_close(got_k, ref_cache[r, key].k[b, :, pos], atol=ATOL, rtol=1e-4)
        assert cache.lengths.tolist() == [T + step + 1] * B
        seen_mixed |= bool((exits < R).any() and (exits != exits[0]).any())
        seen_all_early |= bool((exits < R).all())
        tok = logits.argmax(-1, keepdim=True)
    assert seen_mixed and seen_all_early, "the gate was meant to make rows exit at mixed depths"


def _median_threshold(model, prompt, rule):
    """A threshold at which about half the prompt's tokens stop after loop 2 (so exits are mixed)."""
    out = model(prompt, return_all_loops=True)
    if rule == "argmax_stable":
        return 1
    lp = torch.log_softmax(out.loop_logits.float(), -1)
    if rule == "entropy":
        v = -(lp[1].exp() * lp[1]).sum(-1)
    elif rule == "kl":
        v = (lp[1].exp() * (lp[1] - lp[0])).sum(-1)
    else:
        h = out.loop_hidden
        v = (h[1] - h[0]).norm(dim=-1) / h[1].norm(dim=-1)
    return float(v.median())


@pytest.mark.parametrize("rule", ["kl", "entropy", "hidden_delta", "argmax_stable"])
@pytest.mark.parametrize("state_mode", ["vanilla", "stateloop"])
@torch.no_grad()
def test_skip_compute_with_zero_shot_exit_rules_matches_forward(rule, state_mode):
    """Zero-shot rules need no gate: each skip step takes the depth forward(exit_rule=...) takes from
    the same cache, with the same logits, and generate() runs them end to end."""
    model = make_model("llama", state_mode, "none", n_loops=4, seed=2)
    B, T, R = 3, 5, 4
    prompt = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(9))
    tau = _median_threshold(model, prompt, rule)
    cache = model.allocate_cache(B, T + 8)
    model(prompt, cache=cache)
    tok, seen_early = prompt[:, -1:], False
    for _ in range(8):
        ref = model(tok, cache=copy.deepcopy(cache),
                    exits=ExitPolicy.from_kwargs(exit_rule=rule, exit_threshold=tau, exit_min_loops=2))
        logits, exits = decode_one_token(model, tok, cache, exits=ExitPolicy.from_kwargs(
            exit_threshold=tau, skip_compute=True, exit_rule=rule, exit_min_loops=2))
        assert torch.equal(exits, ref.exit_steps[:, 0]) and int(exits.min()) >= 2
        torch.testing.assert_close(logits, ref.logits[:, 0], atol=ATOL, rtol=1e-4)
        seen_early |= bool((exits < R).any())
        tok = logits.argmax(-1, keepdim=True)
    assert seen_early, f"threshold {tau} of {rule!r} was meant to make some tokens stop early"
    out = generate(model, prompt, 4, return_logits=True,
                   exits=ExitPolicy.from_kwargs(exit_rule=rule, exit_threshold=tau, skip_compute=True))
    full = generate(model, prompt, 4, return_logits=True,
                    exits=ExitPolicy.from_kwargs(exit_rule=rule, exit_threshold=tau))
    assert out.exit_steps.shape == (B, 4) and full.exit_steps.shape == (B, 4)


@torch.no_grad()
def test_skip_compute_whole_batch_exit_at_depth_one():
    """A gate that always exits after loop 1: deeper loops are never run, only copied."""
    model = make_model("llama", "stateloop_attn", "ouro", n_loops=3, gate_bias=20.0)
    prompt = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(8))
    out = generate(model, prompt, 5, return_logits=True,
                   exits=ExitPolicy.from_kwargs(exit_threshold=0.5, skip_compute=True))
    assert (out.exit_steps[:, 1:] == 1).all()
    # depth-1 logits with a cache whose deeper loops hold depth-1 KV == a 1-loop model's decoding
    one = LoopedLM(LoopedLMConfig(**{**model.config.to_dict(), "n_loops": 1})).eval()
    one.load_state_dict(model.state_dict())
    ref = generate(one, prompt, 5, return_logits=True)
    assert torch.equal(out.sequences[:, 5:], ref.sequences[:, 5:])
    torch.testing.assert_close(out.logits[:, 1:], ref.logits[:, 1:], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("backbone,state_mode", [("mamba2", "vanilla"), ("hybrid", "stateloop"), ("llama", "stateloop_mamba2")])
def test_skip_compute_refused_for_ssm(backbone, state_mode):
    model = make_model(backbone, state_mode, "ouro")
    assert "recurrent" in skip_compute_unsupported(model.config)
    with pytest.raises(ValueError, match="Choose skip_compute=ssm_skip"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2,
                 exits=ExitPolicy.from_kwargs(exit_threshold=0.5, skip_compute=True))


def test_skip_compute_needs_gate_and_threshold():
    with pytest.raises(ValueError, match="exit gate"):
        generate(make_model(), torch.zeros(1, 3, dtype=torch.long), 2,
                 exits=ExitPolicy.from_kwargs(exit_threshold=0.5, skip_compute=True))
    with pytest.raises(ValueError, match="exit_rule='kl' needs exit_threshold"):
        generate(make_model(), torch.zeros(1, 3, dtype=torch.long), 2, exits=ExitPolicy.from_kwargs(exit_rule="kl"))
    with pytest.raises(ValueError, match="'loudness'"):
        generate(make_model(), torch.zeros(1, 3, dtype=torch.long), 2,
                 exits=ExitPolicy.from_kwargs(exit_rule="loudness", exit_threshold=1.0))
    with pytest.raises(ValueError, match="exit_threshold"):
        generate(make_model(exit_gate="ouro"), torch.zeros(1, 3, dtype=torch.long), 2,
                 exits=ExitPolicy.from_kwargs(skip_compute=True))


# ----------------------------------------------------------------------- CLI
def _save_checkpoint(path, model, dataset):
    from looplab.checkpoint import looplab_meta

    sd = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": sd, "looplab": looplab_meta(model.config, dataset)}, path)


def test_cli_streams_text_and_task_tokens(tmp_path, capsys):
    from looplab.generate import main

    torch.manual_seed(0)
    lm = LoopedLM(LoopedLMConfig(vocab_size=4096, d_model=32, n_heads=4, n_layers=1, n_loops=2, exit_gate="ouro")).eval()
    _save_checkpoint(tmp_path / "lm.ckpt", lm, {"name": "lm_tiny", "tokenizer": "shakespeare-bpe-4096"})
    main([f"ckpt={tmp_path / 'lm.ckpt'}", "prompt=To be, or not", "max_new_tokens=5", "exit_threshold=0.5"])
    out = capsys.readouterr()
    assert out.out.startswith("To be, or not") and len(out.out.strip()) > len("To be, or not")
    assert "mean exit depth" in out.err
    # a zero-shot exit rule, decoding with skip_compute
    main([f"ckpt={tmp_path / 'lm.ckpt'}", "prompt=To be", "max_new_tokens=3", "exit_rule=entropy",
          "exit_threshold=100", "skip_compute=true"])
    out = capsys.readouterr()
    assert out.out.startswith("To be") and "mean exit depth 1.00" in out.err

    from looplab.data.tasks import make_task

    vocab = make_task("phop", {"n": 8, "p": 2, "alphabet": 4}).vocab
    task = LoopedLM(LoopedLMConfig(vocab_size=vocab.vocab_size, d_model=32, n_heads=4, n_layers=1, n_loops=2)).eval()
    _save_checkpoint(tmp_path / "task.ckpt", task, {"task": "phop", "task_args": {"n": 8, "p": 2, "alphabet": 4}})
    main([f"ckpt={tmp_path / 'task.ckpt'}", f"prompt={' '.join(vocab.names[2:6])} <query>", "max_new_tokens=2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("prompt:") and len(lines) == 3
    tid, name = lines[1].split("\t")[:2]
    assert vocab.names[int(tid)] == name


# ----------------------------------------------------------------- benchmark
def test_decode_bench_quick_at_tiny_dims(monkeypatch):
    from looplab.bench import decode

    monkeypatch.setattr(decode, "DIMS", dict(d_model=32, n_layers=2, n_loops=2, n_heads=4, vocab_size=64, batch=1))
    res = decode.run(threads=1, quick=True)
    for key in ("state_overhead", "ratio_vs_vanilla_r_plus_1", "cached_speedup_512"):
        assert isinstance(res[key], float) and res[key] == res[key]  # present and not NaN
    assert set(res["per_token_ms"]) == {"64", "512"}
    assert "vanilla_R+1" in res["per_token_ms"]["512"] and "stateloop_R" in res["per_token_ms"]["512"]
    assert {"mamba2_R", "hybrid_R", "stateloop_mamba2_R"} <= set(res["per_token_ms"]["512"])
    # exits come from trained checkpoints only: without any, the section says what to run
    assert "make table8" in res["skip_compute"]["skipped"]


def _gated_phop_checkpoint(path, bias: float | None = None):
    from looplab.data.tasks import make_task

    args = {"n": 8, "p": 2, "alphabet": 4}
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=make_task("phop", args).vocab.vocab_size, d_model=32, n_heads=4,
                                    n_layers=1, n_loops=3, exit_gate="ouro")).eval()
    if bias is not None:
        with torch.no_grad():
            model.exit_gate.proj.weight.zero_()
            model.exit_gate.proj.bias.fill_(bias)
    dataset = {"_target_": "looplab.data.tasks.TaskDataModule", "name": "phop", "task": "phop", "task_args": args,
               "batch_size": 4, "val_size": 8, "test_size": 8, "seed": 0}
    _save_checkpoint(path, model, dataset)
    return model, dataset


def test_exit_decoding_of_a_checkpoint_matches_full_forward_passes(tmp_path):
    """bench/exit_grid.py's decode_checkpoint (table 4's exit columns): its all-loops and exit-depth decoders score the
    answers exactly as a full forward pass does, skip_compute equals the exit depth computed in full
    when every token exits at loop R, and a gate that stops every token after loop 1 skips loops."""
    from looplab.bench import exit_grid
    from looplab.data.registry import datamodule_from_meta

    model, dataset = _gated_phop_checkpoint(tmp_path / "gated.ckpt")
    res = exit_grid.decode_checkpoint(tmp_path / "gated.ckpt", n_sequences=8, warmup=0)
    dm = datamodule_from_meta(dataset)
    dm.setup("test")
    steps_total = 0
    right = {"all_loops": 0, "exact_exit": 0}
    for batch in dm.test_dataloader():  # 2 batches of 4 sequences
        with torch.no_grad():
            full = model(batch["input_ids"]).logits
            gated = model(batch["input_ids"], exits=ExitPolicy.from_kwargs(exit_threshold=0.5))
        m = batch["answer_mask"]
        right["all_loops"] += int((full.argmax(-1) == batch["targets"])[m].sum())
        right["exact_exit"] += int((gated.logits.argmax(-1) == batch["targets"])[m].sum())
        steps_total += int(gated.exit_steps.sum())
    assert res["sequences"] == 8 and res["answers"] == 8
    assert res["accuracy"]["all_loops"] == right["all_loops"] / 8
    assert res["accuracy"]["exact_exit"] == right["exact_exit"] / 8
    assert res["mean_exit_step_exact_exit"] == pytest.approx(steps_total / res["tokens"])
    assert sum(res["exit_histogram"]) == res["tokens"]

    _gated_phop_checkpoint(tmp_path / "late.ckpt", bias=-30.0)  # λ ≈ 0: every token runs all 3 loops
    late = exit_grid.decode_checkpoint(tmp_path / "late.ckpt", n_sequences=8, warmup=0)
    assert late["exit_histogram"] == [0, 0, late["tokens"]] and late["top1_agreement_vs_exact_exit"] == 1.0
    assert late["accuracy"]["skip"] == late["accuracy"]["all_loops"]
    _gated_phop_checkpoint(tmp_path / "early.ckpt", bias=30.0)  # λ ≈ 1: every token stops after loop 1
    early = exit_grid.decode_checkpoint(tmp_path / "early.ckpt", n_sequences=8, warmup=0)
    assert early["exit_histogram"] == [early["tokens"], 0, 0] and early["mean_exit_step"] == 1.0

    summary = exit_grid.decode_checkpoints([tmp_path / "late.ckpt", tmp_path / "early.ckpt"], n_sequences=4)
    s = summary["groups"]["vanilla"]["summary"]
    assert s["mean_exit_step"]["n"] == 2 and s["mean_exit_step"]["mean"] == pytest.approx(2.0)


def test_cache_longer_than_max_seq_len_is_refused():
    """RoPE trusts a cache's positions (no per-layer bound check), so a cache may not outgrow the tables."""
    model = LoopedLM(LoopedLMConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, n_loops=2, max_seq_len=8))
    model.allocate_cache(1, 8)
    with pytest.raises(ValueError, match="max_len=9.*max_seq_len=8"):
        model.allocate_cache(1, 9)
