"""Self-speculative decoding (docs/decoding.md#self-speculative-decoding) against plain decoding.

Greedy exactness over backbone × state mixer (prelude/coda and injection cycled through them; every registered
variant is also checked by the conformance kit, tests/test_conformance.py), at batch 1 and in left-padded
batches whose rows keep different numbers of draft tokens and so stand at different lengths; the per-row
rollback of every cache kind checked against plain decoding of each row's kept tokens; speculative
sampling against the full model's exactly enumerated distribution (chi-square); the refusals; the CLI and
the lm-eval adapter. Tiny random models whose shared block is damped (its residual writers scaled down), so
that the loops change the stream little and the drafts agree often but not always: an undamped
random model rejects nearly every draft, which would leave the accepting paths untested.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.cache import KVCache, SSMCache
from looplab.models.exits import ExitPolicy
from looplab.models.generation import Sampling, Speculation, generate, prefill, speculative_round
from looplab.models.registry import BACKBONES as BACKBONE_REGISTRY
from looplab.models.registry import STATE_MIXERS

V = 61
BACKBONES = BACKBONE_REGISTRY.names()
# one state mode per registered mixer: none (vanilla looping), attn and mamba2 (StateLoop with that mixer)
STATE_MODES = tuple("vanilla" if m == "none" else f"stateloop+{m}" for m in STATE_MIXERS.names())
DEPTHS = ((0, 0, "none"), (1, 1, "add"), (0, 1, "none"), (1, 0, "add"))  # (prelude, coda, injection)

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def make_model(backbone="llama", state_mode="vanilla", prelude=0, coda=0, injection="none", n_loops=3, seed=0,
               damp=0.3) -> LoopedLM:
    torch.manual_seed(seed)
    state_mode, _, mixer = state_mode.partition("+")
    cfg = LoopedLMConfig(
        vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=n_loops, backbone=backbone, hybrid_pattern="MA",
        state_mode=state_mode, state_mixer=mixer or None, prelude_layers=prelude, coda_layers=coda, injection=injection, max_seq_len=64,
        d_state=8, headdim=16, chunk_size=4, kernel="torch",
    )
    model = LoopedLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.block.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                p.mul_(damp)
        if model.state is not None:  # zero at init: StateLoop would equal Vanilla
            model.state.state_out.weight.normal_(0, 0.05)
        if model.inject is not None:  # the identity at init: the injection would do nothing
            for p in model.inject.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.head.weight.mul_(4)  # sharper logits: fewer near-ties between depths
    return model


def left_padded(lengths=(3, 8, 5), seed=3):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, T - n:] = torch.randint(0, V, (n,), generator=g)
        mask[i, T - n:] = 1
    return ids, mask


def matrix():
    out = []
    for i, (b, s) in enumerate(itertools.product(BACKBONES, STATE_MODES)):
        pre, coda, inj = DEPTHS[i % len(DEPTHS)]
        k, gamma = (1, 2) if i % 3 == 0 else (2, 3) if i % 3 == 1 else (2, "auto")
        out.append(pytest.param(b, s, pre, coda, inj, k, gamma, id=f"{b}-{s}-p{pre}c{coda}-{inj}-k{k}-g{gamma}"))
    return out


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("backbone,state_mode,prelude,coda,injection,k,gamma", matrix())
@torch.no_grad()
def test_speculative_greedy_equals_plain(backbone, state_mode, prelude, coda, injection, k, gamma):
    model = make_model(backbone, state_mode, prelude, coda, injection)
    ids, mask = left_padded()
    n = 10
    plain = generate(model, ids, n, attention_mask=mask, return_logits=True)
    spec = generate(model, ids, n, attention_mask=mask, return_logits=True, speculation=Speculation(k, gamma))
    assert torch.equal(spec.sequences, plain.sequences)
    torch.testing.assert_close(spec.logits, plain.logits, atol=2e-5, rtol=1e-4)
    stats = spec.speculation
    assert stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted and spec.acceptance_rate == stats.acceptance_rate
    # batch 1 (the longest prompt's row, no padding)
    row = 1
    alone = generate(model, ids[row:row + 1], n, speculation=Speculation(k, gamma))
    assert torch.equal(alone, plain.sequences[row:row + 1])


@torch.no_grad()
def test_rows_keep_their_own_agreeing_prefix_and_stay_exact():
    """A left-padded batch whose rows agree with their drafts for different lengths: each row keeps its own
    agreeing prefix (the rows then stand at different lengths), and each row still gets plain greedy
    decoding's tokens."""
    seen = 0
    for backbone, state_mode in (("llama", "stateloop_attn"), ("mamba2", "stateloop"), ("hybrid", "stateloop_mamba2")):
        model = make_model(backbone, state_mode, 1, 1, "add", damp=0.2)
        ids, mask = left_padded((4, 9, 6, 2), seed=5)
        plain = generate(model, ids, 16, attention_mask=mask)
        spec = generate(model, ids, 16, attention_mask=mask, return_logits=True, speculation=Speculation(2, 4))
        assert torch.equal(spec.sequences, plain)
        st = spec.speculation
        seen += int(st.agreed.unique().numel() > 1 and int(st.agreed.max()) > 0)
        # what the batch kept is what its rows kept, each its own count (no batch-wide shortest prefix)
        assert st.accepted == int(st.agreed.sum()) and st.drafted == int(st.row_drafted.sum())
        assert bool((st.row_acceptance >= 0).all() and (st.row_acceptance <= 1).all())
    assert seen == 3, "the rows were meant to agree with their drafts for different lengths"


def test_rows_of_a_batch_reach_different_lengths_in_a_round():
    """One round over a batch: rows keep different counts, and the cache's per-row lengths move by them."""
    model = make_model("llama", "vanilla", damp=0.2, n_loops=3)
    ids, mask = left_padded((4, 9, 6, 2), seed=5)
    B, T = ids.shape
    cache = model.allocate_cache(B, T + 16)
    with torch.no_grad():
        logits, _ = prefill(model, ids, mask, cache, 3, draft_loops=1)
        token = logits.argmax(-1, keepdim=True)
        for _ in range(6):
            before = cache.lengths.clone()
            tokens, counts, _, agreed = speculative_round(model, token, cache, 1, 4, 3)
            assert torch.equal(cache.lengths, before + counts) and torch.equal(counts, agreed + 1)
            if counts.unique().numel() > 1:
                return
            token = tokens.gather(1, (counts - 1)[:, None])
    pytest.fail("the rows were meant to keep different numbers of draft tokens in some round")


@torch.no_grad()
def test_batched_speculation_is_per_row_and_equals_plain_greedy():
    """A tiny looped llama (4 loops, random weights) over four left-padded prompts of different lengths with
    a depth-1 draft of 3 tokens: the batch decodes plain greedy decoding's tokens, its rows keep different numbers
    of draft tokens and so run different numbers of rounds, and each row keeps and is proposed exactly what it is
    when decoded alone — its own agreeing prefix, not the batch's shortest."""
    model = make_model("llama", "vanilla", n_loops=4, seed=1)
    ids, mask = left_padded((3, 9, 5, 7), seed=4)
    spec_opts = Speculation(loops=1, draft_tokens=3)
    plain = generate(model, ids, 12, attention_mask=mask, return_logits=True)
    spec = generate(model, ids, 12, attention_mask=mask, return_logits=True, speculation=spec_opts)
    assert torch.equal(spec.sequences, plain.sequences)
    torch.testing.assert_close(spec.logits, plain.logits, atol=2e-5, rtol=1e-4)
    st = spec.speculation
    assert st.agreed.unique().numel() > 1 and st.row_drafted.unique().numel() > 1, (
        f"the rows were meant to keep different numbers of draft tokens: {st.agreed.tolist()} of "
        f"{st.row_drafted.tolist()}")
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        alone = generate(model, ids[b:b + 1, -n:], 12, return_logits=True, speculation=spec_opts)
        assert torch.equal(alone.sequences[0, n:], plain.sequences[b, ids.shape[1]:])
        assert int(alone.speculation.agreed[0]) == int(st.agreed[b]), b
        assert int(alone.speculation.row_drafted[0]) == int(st.row_drafted[b]), b


@pytest.mark.parametrize("injection", ["concat", "diag"])
@torch.no_grad()
def test_other_injections(injection):
    model = make_model("hybrid", "stateloop_attn", 1, 1, injection)
    ids, mask = left_padded()
    plain = generate(model, ids, 8, attention_mask=mask)
    assert torch.equal(generate(model, ids, 8, attention_mask=mask, speculation=Speculation(2, 3)), plain)


@torch.no_grad()
def test_eos_test_time_depth_and_stateloop_reset():
    """eos rows finish as in plain decoding (and stop holding the batch back); n_loops=R′ verifies at R′."""
    model = make_model("llama", "stateloop_reset", n_loops=3)
    ids, mask = left_padded()
    plain = generate(model, ids, 10, attention_mask=mask)
    eos = int(plain[0, ids.shape[1] + 2])
    assert torch.equal(generate(model, ids, 10, attention_mask=mask, eos_token_id=eos, speculation=Speculation(1)),
                       generate(model, ids, 10, attention_mask=mask, eos_token_id=eos))
    deeper = generate(model, ids, 10, attention_mask=mask, n_loops=5)
    assert torch.equal(generate(model, ids, 10, attention_mask=mask, n_loops=5, speculation=Speculation(4, 2)),
                       deeper)


# ------------------------------------------------------------------ rollback
def _assert_same_cache(got, want, skip_keys=()):
    assert torch.equal(got.lengths, want.lengths) and torch.equal(got.next_pos, want.next_pos)
    for key, entry in got.entries.items():
        if key in skip_keys:
            continue
        ref = want.entries[key]
        if isinstance(entry, KVCache):
            for b, n in enumerate(got.lengths.tolist()):  # each row's columns in use
                torch.testing.assert_close(entry.k[b, :, :n], ref.k[b, :, :n], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(entry.v[b, :, :n], ref.v[b, :, :n], atol=1e-5, rtol=1e-4)
        else:
            assert isinstance(entry, SSMCache)
            torch.testing.assert_close(entry.conv_state, ref.conv_state, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(entry.ssm_state, ref.ssm_state, atol=1e-5, rtol=1e-4)
            assert entry.trail is None


@pytest.mark.parametrize("backbone,state_mode,prelude,coda,R,k", [
    ("hybrid", "stateloop_mamba2", 1, 1, 2, 1),  # every coda depth is read (k and R): all entries compared
    ("hybrid", "stateloop_attn", 2, 0, 3, 2),
    ("mamba2", "stateloop_mamba2", 1, 0, 3, 1),
])
@torch.no_grad()
def test_rollback_equals_plain_decoding_of_the_kept_tokens(backbone, state_mode, prelude, coda, R, k):
    """After a round with a rejected draft, every cache entry (attention key/values, Mamba-2 conv and
    SSM states of the block, prelude, coda and state mixer) equals what plain one-token decoding of each
    row's kept tokens leaves (the rows that kept fewer stop earlier: select_rows): the same per-row lengths
    and the same values at the positions in use."""
    model = make_model(backbone, state_mode, prelude, coda, n_loops=R, damp=1.0)
    ids, mask = left_padded((3, 6))
    B, T = ids.shape
    cache = model.allocate_cache(B, T + 24)  # 4 rounds of at most γ + 1 = 5 tokens
    logits, _ = prefill(model, ids, mask, cache, R, draft_loops=k)
    token = logits.argmax(-1, keepdim=True)
    rejected = False
    for _ in range(4):
        before = copy.deepcopy(cache)
        gamma = 4
        tokens, counts, _, agreed = speculative_round(model, token, cache, k, gamma, R)
        rejected |= bool((counts < gamma + 1).any())
        # the reference: plain cached steps over each row's kept inputs (its token, then its kept drafts)
        inputs = torch.cat([token, tokens[:, :-1]], 1)
        for i in range(int(counts.max())):
            rows = (counts > i).nonzero().squeeze(1)
            with before.select_rows(rows):
                out = model(inputs[rows, i:i + 1], cache=before, return_all_loops=bool(coda))
            assert torch.equal(out.logits[:, -1].argmax(-1), tokens[rows, i])
        unused = [key for key, e in cache.entries.items()
                  if isinstance(key[1], tuple) and key[0] not in (k - 1, R - 1)] if coda else []
        _assert_same_cache(cache, before, skip_keys=unused)
        token = tokens.gather(1, (counts - 1)[:, None])
    assert rejected, "a draft was meant to be rejected"


# ------------------------------------------------------------------ refusals
def test_refusals_name_the_options():
    model = make_model(n_loops=3)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"speculation loops=3 must be an integer in 1\.\.2"):
        generate(model, ids, 4, speculation=Speculation(3))
    with pytest.raises(ValueError, match="draft_tokens=0"):
        generate(model, ids, 4, speculation=Speculation(1, 0))
    with pytest.raises(ValueError, match="does not combine with exits"):
        generate(model, ids, 4, exits=ExitPolicy(threshold=1.0, rule="entropy"), speculation=Speculation(1))
    with pytest.raises(TypeError, match="speculation="):
        generate(model, ids, 4, speculation=2)


# ------------------------------------------------------------ CLI and lm-eval
def test_cli_prints_acceptance_and_speed_with_the_plain_text(tmp_path, capsys):
    from looplab.checkpoint import looplab_meta
    from looplab.generate import main

    torch.manual_seed(0)
    lm = LoopedLM(LoopedLMConfig(vocab_size=4096, d_model=32, n_heads=4, n_layers=1, n_loops=3)).eval()
    sd = {f"model.{k}": v for k, v in lm.state_dict().items()}
    torch.save({"state_dict": sd, "looplab": looplab_meta(lm.config, {"name": "lm_tiny", "tokenizer": "shakespeare-bpe-4096"})},
               tmp_path / "lm.ckpt")
    args = [f"ckpt={tmp_path / 'lm.ckpt'}", "prompt=To be, or not", "max_new_tokens=6"]
    main(args)
    plain = capsys.readouterr()
    main(args + ["speculative_loops=2", "draft_tokens=3"])
    spec = capsys.readouterr()
    assert spec.out == plain.out
    assert "acceptance" in spec.err and "tokens/s" in spec.err and "acceptance" not in plain.err
    main(args + ["speculative_loops=1", "draft_tokens=auto"])
    assert capsys.readouterr().out == plain.out


def test_lm_eval_generate_until_takes_the_speculation_args():
    from lm_eval.api.instance import Instance

    from looplab.eval import LooplabLM

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=4096, d_model=32, n_heads=2, n_layers=1, n_loops=3, max_seq_len=256)).eval()
    reqs = [Instance(request_type="generate_until", doc={}, arguments=(p, {"until": ["\n\n"], "max_gen_toks": 6}), idx=i)
            for i, p in enumerate(["To be, or not", "My lord"])]
    plain = LooplabLM.from_model(model, "shakespeare-bpe-4096", batch_size=2).generate_until(reqs)
    spec = LooplabLM.from_model(model, "shakespeare-bpe-4096", batch_size=2, speculative_loops="2",
                                draft_tokens="3").generate_until(reqs)
    assert spec == plain
    with pytest.raises(ValueError, match="loops=3"):
        LooplabLM.from_model(model, "shakespeare-bpe-4096", speculative_loops=3)


def test_bench_measures_every_cell_against_plain_decoding():
    """bench/speculative.py (table 11): every (k, γ) cell decodes plain greedy decoding's tokens and reports its
    tokens/s over plain's, its acceptance and the draft cost (depth-k decoding over full-depth decoding)."""
    from looplab.bench.speculative import best_cell, measure

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=1, n_loops=3, max_seq_len=64)).eval()
    ids = torch.randint(0, 64, (2, 5))
    res = measure(model, ids, ks=[1, 2], gammas=[2, "auto"], new_tokens=6, repeats=1)
    assert res["plain_tokens_per_s"] > 0 and [(c["k"], c["gamma"]) for c in res["cells"]] == [
        (1, 2), (1, "auto"), (2, 2), (2, "auto")]
    for c in res["cells"]:
        assert c["speedup"] > 0 and 0 <= c["acceptance"] <= 1 and 0 < c["draft_cost"] and c["rounds"] >= 1
        # each row keeps its own prefix: the batch's acceptance is a mean over its rows
        assert c["row_acceptance_min"] <= c["acceptance"] + 1e-9
    run = {"checkpoint": "m", "backbone": "llama", "state_mode": "vanilla", "d_model": 32, "batches": {"1": res}}
    assert best_cell([run])["speedup"] == max(c["speedup"] for c in res["cells"])


# ------------------------------------------------------------ speculative sampling
def _chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, the cells expected below 5 pooled into one."""
    keep = expected >= 5
    o = torch.cat([observed[keep], observed[~keep].sum()[None]])
    e = torch.cat([expected[keep], expected[~keep].sum()[None]])
    nonempty = e > 0  # the pooled cell, when nothing was pooled
    return float(((o - e)[nonempty] ** 2 / e[nonempty]).sum()), int(nonempty.sum()) - 1


def _chi_square_p(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@torch.no_grad()
def test_speculative_sampling_keeps_the_full_models_distribution():
    """temperature > 0: tokens 2 and 3 of many speculative generations (rows of one batch, which decode
    independently) against the full model's distribution of them given token 1, enumerated exactly from forward
    passes over every prefix; chi-square tests at a fixed seed. Token 1 comes from the prefill (plain sampling,
    checked too); tokens 2 and 3 from the first round (accepted drafts, a resample after a rejection, the extra
    token) or, after an early rejection, from the second. The draft's acceptance must lie well inside (0, 1), so
    that both the accepting and the resampling path ran. Resampling from p instead of max(0, p − q) fails this
    at this seed (p ≈ 6e-11), as it does at 9 of the seeds 1..10."""
    Vs, n, k, gamma = 6, 3000, 1, 2
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=Vs, d_model=16, n_heads=2, n_layers=1, n_loops=3, max_seq_len=16)).eval()
    model.head.weight.mul_(6.0)  # logits of a useful spread: neither uniform nor one-hot
    prompt = torch.tensor([[1, 4, 2]])
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt.expand(n, -1), 3, sampling=sampling, speculation=Speculation(k, gamma),
                   return_logits=True)
    acc = out.speculation.acceptance_rate
    assert 0.05 < acc < 0.95, f"acceptance {acc:.3f}: the test needs both accepted and rejected drafts"
    # p(a | prompt), p(b | prompt, a), p(c | prompt, a, b): one batched forward per prefix length
    a, b = torch.arange(Vs).repeat_interleave(Vs), torch.arange(Vs).repeat(Vs)
    p1 = model(prompt).logits[0, -1].softmax(-1).double()  # (V,)
    p2 = model(torch.cat([prompt.expand(Vs, -1), torch.arange(Vs)[:, None]], 1)).logits[:, -1].softmax(-1)
    p3 = model(torch.cat([prompt.expand(Vs * Vs, -1), a[:, None], b[:, None]], 1)).logits[:, -1].softmax(-1)
    p23 = (p2[:, :, None] * p3.view(Vs, Vs, Vs)).double()  # (a, b, c): p(b, c | prompt, a)
    seqs = out.sequences[:, prompt.shape[1]:]  # (n, 3)
    stat, df = _chi_square(torch.bincount(seqs[:, 0], minlength=Vs).double(), n * p1)
    assert _chi_square_p(stat, df) > 1e-3, f"token 1: chi-square {stat:.1f} on {df} df"
    # given token 1 = a, as drawn: one cell set per a, so df = Σ_a (cells_a − 1)
    stat = df = 0
    for t in range(Vs):
        rows = seqs[:, 0] == t
        if bool(rows.any()):
            obs = torch.bincount(seqs[rows, 1] * Vs + seqs[rows, 2], minlength=Vs * Vs).double()
            s_t, df_t = _chi_square(obs, int(rows.sum()) * p23[t].flatten())
            stat, df = stat + s_t, df + df_t
    p_value = _chi_square_p(stat, df)
    assert p_value > 1e-3, f"tokens 2-3: chi-square {stat:.1f} on {df} df (p = {p_value:.2g}): not the full model's"
