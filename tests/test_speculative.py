"""Self-speculative decoding (issue 27, models/speculative.py) against plain greedy decoding.

Exactness over backbone × state mode × prelude/coda × injection, at batch 1 and in left-padded
batches whose rows agree with their drafts for different lengths; the rollback of every cache
kind checked against plain decoding of the kept tokens; the refusals; the CLI and the lm-eval
adapter. Tiny random models whose shared block is damped (its residual writers scaled down), so
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
from looplab.models.generation import generate
from looplab.models.speculative import prefill, speculative_round

V = 61
BACKBONES = ("llama", "mamba2", "hybrid")
STATE_MODES = ("vanilla", "stateloop", "stateloop_attn", "stateloop_mamba2")  # mixer none / attn / mamba2
DEPTHS = ((0, 0, "none"), (1, 1, "add"), (0, 1, "none"), (1, 0, "add"))  # (prelude, coda, injection)

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def make_model(backbone="llama", state_mode="vanilla", prelude=0, coda=0, injection="none", n_loops=3, seed=0,
               damp=0.3) -> LoopedLM:
    torch.manual_seed(seed)
    cfg = LoopedLMConfig(
        vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=n_loops, backbone=backbone, hybrid_pattern="MA",
        state_mode=state_mode, prelude_layers=prelude, coda_layers=coda, injection=injection, max_seq_len=64,
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
    for i, (b, s, (pre, coda, inj)) in enumerate(itertools.product(BACKBONES, STATE_MODES, DEPTHS)):
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
def test_rows_accept_different_lengths_and_stay_exact():
    """A left-padded batch whose rows agree with their drafts for different lengths in the same
    rounds: the batch keeps the shortest agreeing prefix, so each row still gets its plain tokens,
    and the acceptance counted per row differs between rows."""
    seen = 0
    for backbone, state_mode in (("llama", "stateloop_attn"), ("mamba2", "stateloop"), ("hybrid", "stateloop_mamba2")):
        model = make_model(backbone, state_mode, 1, 1, "add", damp=0.2)
        ids, mask = left_padded((4, 9, 6, 2), seed=5)
        plain = generate(model, ids, 16, attention_mask=mask)
        spec = generate(model, ids, 16, attention_mask=mask, return_logits=True, speculation=Speculation(2, 4))
        assert torch.equal(spec.sequences, plain)
        agreed = spec.speculation.agreed
        seen += int(agreed.unique().numel() > 1 and int(agreed.max()) > 0)
        # the batch keeps no more than its least agreeing row's prefix in each round
        assert spec.speculation.accepted <= int(agreed.min())
    assert seen == 3, "the rows were meant to agree with their drafts for different lengths"


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
    assert got.length == want.length and torch.equal(got.next_pos, want.next_pos)
    for key, entry in got.entries.items():
        if key in skip_keys:
            continue
        ref = want.entries[key]
        assert entry.length == ref.length, key
        if isinstance(entry, KVCache):
            n = entry.length
            torch.testing.assert_close(entry.k[:, :, :n], ref.k[:, :, :n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(entry.v[:, :, :n], ref.v[:, :, :n], atol=1e-5, rtol=1e-4)
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
    SSM states of the block, prelude, coda and state mixer) equals what plain one-token decoding of
    the kept tokens leaves: the same lengths and the same values at the positions in use."""
    model = make_model(backbone, state_mode, prelude, coda, n_loops=R, damp=1.0)
    ids, mask = left_padded((3, 6))
    B, T = ids.shape
    cache = model.allocate_cache(B, T + 12)
    logits = prefill(model, ids, mask, cache, k, R)
    token = logits.argmax(-1, keepdim=True)
    rejected = False
    for _ in range(4):
        before = copy.deepcopy(cache)
        gamma = 4
        tokens, _, agreed = speculative_round(model, token, cache, k, gamma, R)
        m = tokens.shape[1]
        rejected |= m < gamma + 1
        # the reference: plain cached steps over the kept inputs (the token, then the kept drafts)
        inputs = torch.cat([token, tokens[:, :-1]], 1)
        for i in range(m):
            out = model(inputs[:, i:i + 1], cache=before, return_all_loops=bool(coda))
            assert torch.equal(out.logits[:, -1].argmax(-1), tokens[:, i])
        unused = [key for key, e in cache.entries.items()
                  if isinstance(key[1], tuple) and key[0] not in (k - 1, R - 1)] if coda else []
        _assert_same_cache(cache, before, skip_keys=unused)
        token = tokens[:, -1:]
    assert rejected, "a draft was meant to be rejected"


# ------------------------------------------------------------------ refusals
def test_refusals_name_the_options():
    model = make_model(n_loops=3)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature=0.7.*greedy"):
        generate(model, ids, 4, sampling=Sampling(temperature=0.7), speculation=Speculation(1))
    with pytest.raises(ValueError, match=r"speculative_loops=3 must be an integer in 1\.\.2"):
        generate(model, ids, 4, speculation=Speculation(3))
    with pytest.raises(ValueError, match="draft_tokens=0"):
        generate(model, ids, 4, speculation=Speculation(1, 0))
    with pytest.raises(ValueError, match="exit_threshold"):
        generate(model, ids, 4, exits=ExitPolicy.from_kwargs(exit_rule="entropy", exit_threshold=1.0), speculation=Speculation(1))


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
    with pytest.raises(ValueError, match="speculative_loops=3"):
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
        # the batch keeps the shortest agreeing prefix of its rows (no eos here: every row runs to the end)
        assert c["row_acceptance_min"] >= c["acceptance"] - 1e-9
    run = {"checkpoint": "m", "backbone": "llama", "state_mode": "vanilla", "d_model": 32, "batches": {"1": res}}
    assert best_cell([run])["speedup"] == max(c["speedup"] for c in res["cells"])
