"""Evaluation: perplexity per loop depth, and the lm-eval adapter checked against the model's own log-probs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from looplab.checkpoint import looplab_meta
from looplab.data.tokenizer import load_tokenizer
from looplab.eval import DEFAULT_TASKS, LOCAL_TASKS_DIR, LooplabLM, evaluate_perplexity, run_zeroshot
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy

TOK = "shakespeare-bpe-4096"


def tiny_model(vocab=4096, loops=3, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = LoopedLMConfig(vocab_size=vocab, d_model=32, n_heads=2, n_layers=1, n_loops=loops, max_seq_len=256, **kw)
    m = LoopedLM(cfg).eval()
    with torch.no_grad():  # a random init is nearly uniform; sharpen it so scores differ between strings
        m.head.weight.mul_(20)
    return m


def save_checkpoint(model, path, **dataset):
    ds = {"_target_": "looplab.data.lm.LMDataModule", "name": "lm_tiny", "source": "shakespeare",
          "tokenizer": TOK, "seq_len": 64, **dataset}
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    torch.save({"state_dict": sd, "looplab": looplab_meta(model.config, dataset=ds)}, path)
    return path


def own_logprob(model, ctx_ids, cont_ids):
    """Σ log p(cont | ctx) from one plain forward pass (independent of the adapter)."""
    ids = torch.tensor([ctx_ids + cont_ids])
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    n = len(cont_ids)
    picked = lp[-n:].gather(-1, torch.tensor(cont_ids)[:, None]).squeeze(-1)
    greedy = bool((lp[-n:].argmax(-1) == torch.tensor(cont_ids)).all())
    return float(picked.sum()), greedy


def requests(kind, *args_list):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


# --------------------------------------------------------------- perplexity
def test_perplexity_is_exp_of_token_weighted_mean_nll():
    model = tiny_model(vocab=64, loops=3)
    g = torch.Generator().manual_seed(1)
    batches = []
    for B, T in ((3, 10), (1, 7), (4, 10)):  # uneven batches: a mean of batch means would differ
        x = torch.randint(0, 64, (B, T), generator=g)
        y = torch.randint(0, 64, (B, T), generator=g)
        y[0, :3] = -100  # ignored targets
        batches.append({"input_ids": x, "targets": y})
    res = evaluate_perplexity(model, batches, per_loop=True)

    nll_sum, loop_sum, count = 0.0, [0.0, 0.0, 0.0], 0
    with torch.no_grad():
        for b in batches:
            out = model(b["input_ids"], return_all_loops=True)
            for r in range(3):
                lp = torch.log_softmax(out.loop_logits[r].double(), -1)
                for i, j in (b["targets"] != -100).nonzero().tolist():
                    loop_sum[r] -= float(lp[i, j, b["targets"][i, j]])
            lp = torch.log_softmax(out.logits.double(), -1)
            for i, j in (b["targets"] != -100).nonzero().tolist():
                nll_sum -= float(lp[i, j, b["targets"][i, j]])
                count += 1
    assert res["tokens"] == count == 3 * 10 + 7 + 4 * 10 - 3 * 3
    assert res["nll"] == pytest.approx(nll_sum / count, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(nll_sum / count), rel=1e-5)
    assert res["loop_perplexity"] == pytest.approx([math.exp(s / count) for s in loop_sum], rel=1e-5)
    assert res["loop_nll"][-1] == pytest.approx(res["nll"], rel=1e-6)  # the last depth is the model's output
    assert evaluate_perplexity(model, batches, per_loop=False, max_batches=1)["tokens"] == 27
    with pytest.raises(ValueError, match="no target tokens"):
        evaluate_perplexity(model, [], per_loop=False)


# ------------------------------------------------------------------ adapter
def test_loglikelihood_equals_models_own_logprobs_at_the_boundary():
    model = tiny_model()
    tok = load_tokenizer(TOK)
    lm = LooplabLM.from_model(model, TOK, batch_size=3)
    ctx = "To be, or not to be:"
    # context ending without a space, continuation starting with one: the space belongs to the next word
    assert tok.encode(ctx + " that is the question") == tok.encode(ctx) + tok.encode(" that is the question")
    # a trailing space in the context moves to the continuation (it would otherwise be a lone ' ' token)
    assert tok.encode("The king is") + tok.encode(" dead") != tok.encode("The king is ") + tok.encode("dead")
    cases = [
        ((ctx, " that is the question"), tok.encode(ctx), tok.encode(" that is the question")),
        (("The king is ", "dead"), tok.encode("The king is"), tok.encode(" dead")),
        (("Good morrow", ", my lord."), tok.encode("Good morrow"), tok.encode(", my lord.")),
        (("", "Hello world"), [tok.eos_id], tok.encode("Hello world")),
        (("ROMEO.\n", "But soft!"), tok.encode("ROMEO."), tok.encode("ROMEO.\nBut soft!")[len(tok.encode("ROMEO.")):]),
    ]
    got = lm.loglikelihood(requests("loglikelihood", *[c[0] for c in cases]))
    for (args, ctx_ids, cont_ids), (lp, greedy) in zip(cases, got):
        want_lp, want_greedy = own_logprob(model, ctx_ids, cont_ids)
        assert lp == pytest.approx(want_lp, abs=1e-3), args
        assert greedy == want_greedy
    # batching (right padding) changes nothing
    one = LooplabLM.from_model(model, TOK, batch_size=1).loglikelihood(requests("loglikelihood", *[c[0] for c in cases]))
    assert [a for a, _ in one] == pytest.approx([a for a, _ in got], abs=1e-4)


def test_is_greedy_on_the_models_own_continuation():
    model = tiny_model()
    tok = load_tokenizer(TOK)
    ctx_ids = tok.encode("Now is the winter of our discontent")
    ids = list(ctx_ids)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    lm = LooplabLM.from_model(model, TOK)
    lp, greedy = lm._score([(ids, 3)])[0]
    assert greedy and lp == pytest.approx(own_logprob(model, ctx_ids, ids[len(ctx_ids):])[0], abs=1e-3)


def test_long_contexts_are_left_truncated_to_max_length():
    model = tiny_model()
    tok = load_tokenizer(TOK)
    lm = LooplabLM.from_model(model, TOK, max_length=12)
    ctx = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."
    full = tok.encode(ctx) + tok.encode(" The evil")
    n = len(tok.encode(" The evil"))
    kept = full[-13:]
    (lp, _), = lm.loglikelihood(requests("loglikelihood", (ctx, " The evil")))
    assert lp == pytest.approx(own_logprob(model, kept[:-n], kept[-n:])[0], abs=1e-3)


def test_loglikelihood_rolling_matches_lm_eval_windows():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model = tiny_model()
    tok = load_tokenizer(TOK)
    text = "O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name."
    ids = tok.encode(text)
    for L in (8, 256):
        lm = LooplabLM.from_model(model, TOK, max_length=L)
        (got,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))
        want = 0.0
        for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, tok.eos_id, L, 1)):
            want += own_logprob(model, ctx, cont)[0]
        assert got == pytest.approx(want, abs=1e-3)
    assert lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))[0] == pytest.approx(
        own_logprob(model, [tok.eos_id], ids)[0], abs=1e-3)


def test_generate_until_is_greedy_and_stops():
    model = tiny_model()
    tok = load_tokenizer(TOK)
    lm = LooplabLM.from_model(model, TOK, batch_size=2)
    prompts = ["To be, or not", "My lord"]
    outs = lm.generate_until(requests("generate_until", *[(p, {"until": ["\n\n"], "max_gen_toks": 6}) for p in prompts]))
    for p, out in zip(prompts, outs):
        ids = tok.encode(p)
        new = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
                if nxt == tok.eos_id:
                    break
                new.append(nxt)
        want = tok.decode(new).split("\n\n")[0]
        assert out == want


def test_adapter_refuses_non_text_checkpoints(tmp_path):
    path = save_checkpoint(tiny_model(vocab=16), tmp_path / "phop.ckpt", name="phop", tokenizer=None)
    with pytest.raises(ValueError, match="no text tokenizer"):
        LooplabLM(checkpoint=str(path))


# ------------------------------------------------------------- lm-eval runs
def test_simple_evaluate_runs_local_task_through_registered_adapter(tmp_path):
    import lm_eval
    import lm_eval.api.registry
    from lm_eval.tasks import TaskManager

    assert lm_eval.api.registry.get_model("looplab") is LooplabLM
    model = tiny_model(loops=2)
    path = save_checkpoint(model, tmp_path / "lm.ckpt")
    tm = TaskManager(include_path=str(LOCAL_TASKS_DIR), include_defaults=False)
    out = lm_eval.simple_evaluate(model="looplab", model_args=f"checkpoint={path}", tasks=["looplab_tiny_mc"],
                                  task_manager=tm, batch_size=8, bootstrap_iters=0, log_samples=False)
    acc = out["results"]["looplab_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0

    # the same accuracy computed without lm-eval: argmax over the summed log-probs of " " + choice
    import json

    tok = load_tokenizer(TOK)
    docs = [json.loads(l) for l in (LOCAL_TASKS_DIR / "looplab_tiny_mc" / "looplab_tiny_mc.jsonl").read_text().splitlines()]
    assert len(docs) == 20
    correct = 0
    for d in docs:
        ctx = f"Question: {d['question']}\nAnswer:"
        scores = [own_logprob(model, tok.encode(ctx), tok.encode(ctx + " " + c)[len(tok.encode(ctx)):])[0] for c in d["choices"]]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
    assert acc == pytest.approx(correct / 20)


@pytest.mark.slow
def test_run_zeroshot_on_a_checkpoint(tmp_path):
    path = save_checkpoint(tiny_model(loops=2), tmp_path / "lm.ckpt")
    summary = run_zeroshot(path, tasks=["looplab_tiny_mc"], include_defaults=False, batch_size=4, limit=10)
    assert summary["n_samples"]["looplab_tiny_mc"] == 10 and 0 <= summary["average_acc"] <= 1
    with pytest.raises(ValueError, match="unknown lm-eval task"):
        run_zeroshot(path, tasks=["no_such_task"], include_defaults=False)


def test_default_suite_is_the_papers_eight():
    assert DEFAULT_TASKS == ["lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "sciq", "race"]


def test_checkpoint_perplexity_rebuilds_the_training_data(tmp_path):
    import json

    from looplab.data import corpus
    from looplab.data.lm import LMDataModule
    from looplab.eval.perplexity import checkpoint_perplexity

    texts = [t[5000:7000] for _, t in corpus.documents()[:12]]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ds = dict(source="json", data_files=str(data), val_fraction=0.25, seq_len=32, batch_size=4,
              val_tokens=None, cache_dir=str(tmp_path / "cache"))
    model = tiny_model(loops=2)
    path = save_checkpoint(model, tmp_path / "lm.ckpt", **ds, _vocab_size=4096, _tokenizer_spec=TOK)  # as train.py stores it
    got = checkpoint_perplexity(str(path))
    dm = LMDataModule(**ds)
    dm.setup()
    want = evaluate_perplexity(model, dm.val_dataloader())
    assert got["tokens"] == want["tokens"] > 0
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-5)
    assert got["loop_perplexity"] == pytest.approx(want["loop_perplexity"], rel=1e-5)


def test_generate_fallback_without_cached_decoder_gives_the_same_text(monkeypatch):
    model = tiny_model()
    lm = LooplabLM.from_model(model, TOK, batch_size=2)
    reqs = requests("generate_until", *[(p, {"until": ["\n\n"], "max_gen_toks": 5}) for p in ("Good my lord", "What, ho")])
    cached = lm.generate_until(reqs)

    def no_decoder(*a, **k):
        raise ImportError("looplab.models.generation unavailable")

    monkeypatch.setattr(model, "generate", no_decoder)
    assert lm.generate_until(reqs) == cached


def test_exit_threshold_scores_from_the_gate_selected_depths():
    model = tiny_model(exit_gate="ouro")
    tok = load_tokenizer(TOK)
    lm = LooplabLM.from_model(model, TOK, exit_threshold=0.5)
    ctx, cont = tok.encode("Once more unto the breach"), tok.encode(", dear friends")
    (lp, _), = lm.loglikelihood(requests("loglikelihood", ("Once more unto the breach", ", dear friends")))
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont[:-1]]), exits=ExitPolicy(threshold=0.5)).logits[0].double()
    want = torch.log_softmax(logits, -1)[-len(cont):].gather(-1, torch.tensor(cont)[:, None]).sum().item()
    assert lp == pytest.approx(want, abs=1e-3)
    with pytest.raises(ValueError, match="exit gate"):
        LooplabLM.from_model(tiny_model(), TOK, exit_threshold=0.5)


def test_loglikelihood_under_a_zero_shot_exit_rule_sums_the_chosen_depths_log_probs():
    """exit_rule=entropy (no gate): the score is Σ of each continuation token's log-probability read at
    the depth the rule picks for that position, computed here from all loops' logits."""
    from looplab.models.exit_rules import first_exit

    model = tiny_model(loops=3)
    tok = load_tokenizer(TOK)
    ctx, cont = tok.encode("Once more unto the breach"), tok.encode(", dear friends")
    ids = torch.tensor([ctx + cont[:-1]])
    with torch.no_grad():
        full = model(ids, return_all_loops=True)
    lp2 = torch.log_softmax(full.loop_logits[1].double(), -1)
    tau = float(-(lp2.exp() * lp2).sum(-1).median())  # about half the positions stop at loop 2
    steps = first_exit("entropy", tau, 3, min_loops=2, logits=full.loop_logits)[0]  # (T,)
    assert int(steps.min()) == 2 and int(steps.max()) == 3
    want = sum(torch.log_softmax(full.loop_logits[int(steps[i]) - 1, 0, i].double(), -1)[cont[j]].item()
               for j, i in enumerate(range(len(ctx) - 1, ids.shape[1])))
    lm = LooplabLM.from_model(model, TOK, exit_rule="entropy", exit_threshold=tau, exit_min_loops=2)
    (lp, _), = lm.loglikelihood(requests("loglikelihood", ("Once more unto the breach", ", dear friends")))
    assert lp == pytest.approx(want, abs=1e-3)
    with pytest.raises(ValueError, match="needs exit_threshold"):
        LooplabLM.from_model(model, TOK, exit_rule="kl")


def test_adapter_scores_and_generates_at_a_test_time_depth():
    """model_args n_loops=R′ (test-time depth): loglikelihood is read from model(ids, n_loops=R′), generation runs R′ loops,
    and a depth below 1 is refused."""
    model = tiny_model(loops=2)
    tok = load_tokenizer(TOK)
    ctx, cont = tok.encode("Once more unto the breach"), tok.encode(", dear friends")
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont[:-1]]), n_loops=5).logits[0].double()
    want = torch.log_softmax(logits, -1)[-len(cont):].gather(-1, torch.tensor(cont)[:, None]).sum().item()
    lm = LooplabLM.from_model(model, TOK, n_loops="5")
    (lp, _), = lm.loglikelihood(requests("loglikelihood", ("Once more unto the breach", ", dear friends")))
    assert lp == pytest.approx(want, abs=1e-3)
    at_trained = LooplabLM.from_model(model, TOK).loglikelihood(requests("loglikelihood", ("Once more unto the breach", ", dear friends")))
    assert at_trained[0][0] != pytest.approx(want, abs=1e-3)  # the depth really changed the scores
    with torch.no_grad():
        seq = model.generate(torch.tensor([ctx]), 4, n_loops=5)
    assert lm._greedy([ctx], 4)[0] == seq[0, len(ctx):].tolist()[: len(lm._greedy([ctx], 4)[0])]
    with pytest.raises(ValueError, match="n_loops must be"):
        LooplabLM.from_model(model, TOK, n_loops=0)


# ------------------------------------------------------- looplab_tiny suite
def test_tiny_suite_runs_offline_through_the_adapter_and_matches_own_scoring():
    """`--tasks looplab_tiny` (the tag) runs the three held-out-play tasks offline; lm-eval's accuracy
    equals an argmax over the model's own log-probs of delimiter + choice after the context."""
    from looplab.eval import tiny_suite as ts

    model = tiny_model(loops=2)
    tok = load_tokenizer(TOK)
    limit = 6
    res = run_zeroshot(model, tasks=["looplab_tiny"], tokenizer=TOK, include_defaults=False, limit=limit, batch_size=16)
    assert sorted(res["results"]) == sorted(ts.TASKS)  # the tag adds no aggregate row
    assert res["n_samples"] == {t: limit for t in ts.TASKS}
    shipped = ts.load()
    for task in ts.TASKS:
        acc = res["results"][task]["acc"]
        delim = ts.DELIMITERS[task[len(ts.GROUP) + 1:]]
        correct = 0
        for d in shipped[task][:limit]:
            ctx = tok.encode(d["context"])
            scores = [own_logprob(model, ctx, tok.encode(d["context"] + delim + c)[len(ctx):])[0] for c in d["choices"]]
            correct += int(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
        assert acc == pytest.approx(correct / limit), task
    assert res["average_acc"] == pytest.approx(sum(res["results"][t]["acc"] for t in ts.TASKS) / 3)


def test_add_intervals_keeps_fields_and_adds_counts_and_wilson_intervals():
    from looplab.tables.zeroshot import add_intervals, wilson

    res = {"results": {"looplab_tiny_cloze": {"acc": 0.4, "acc_norm": 0.3}, "looplab_tiny_speaker": {"acc": 0.3}},
           "average_acc": 0.35, "tasks": ["looplab_tiny"], "limit": None,
           "n_samples": {"looplab_tiny_cloze": 300, "looplab_tiny_speaker": 300}}
    out = add_intervals(res)
    assert {k: out[k] for k in res} == res  # nothing renamed or changed
    assert out["n_items"] == {"looplab_tiny_cloze": 300, "looplab_tiny_speaker": 300}
    assert out["chance"] == {"looplab_tiny_cloze": pytest.approx(0.25), "looplab_tiny_speaker": pytest.approx(0.25)}
    assert out["average_chance"] == pytest.approx(0.25)
    assert out["stderr"]["looplab_tiny_cloze"] == pytest.approx(math.sqrt(0.4 * 0.6 / 300))
    lo, hi = out["ci95"]["looplab_tiny_cloze"]
    assert (lo, hi) == pytest.approx((0.346165, 0.456363), abs=1e-6)  # Wilson (as scipy.stats.binomtest(120, 300) gives)
    assert wilson(0.0, 10)[0] == 0.0 and wilson(1.0, 10)[1] == pytest.approx(1.0) and wilson(0.5, 0) == (0.0, 1.0)
    se = math.sqrt(0.4 * 0.6 / 300 + 0.3 * 0.7 / 300) / 2
    assert out["average_acc_stderr"] == pytest.approx(se)
    assert out["average_acc_ci95"] == pytest.approx([0.35 - 1.96 * se, 0.35 + 1.96 * se], abs=1e-4)
    json.dumps(out)  # what zeroshot.json stores
    hub = add_intervals({"results": {"piqa": {"acc": 0.6}}, "average_acc": 0.6, "n_samples": {"piqa": 100}})
    assert hub["chance"] == {"piqa": None} and hub["average_chance"] is None and hub["ci95"]["piqa"]


def test_table_zeroshot_defaults_to_the_tiny_suite_at_tiny_scale(tmp_path, monkeypatch):
    import looplab.eval
    from looplab.tables import spec
    from looplab.tables import zeroshot as tz

    assert tz.default_tasks("tiny") == ["looplab_tiny"] and tz.default_tasks("paper") == DEFAULT_TASKS
    assert tz._local_only(["looplab_tiny"]) and tz._local_only(["looplab_tiny_cloze", "looplab_tiny_mc"])
    assert not tz._local_only(["piqa"])
    calls = []

    def fake_run_zeroshot(ckpt, tasks=None, include_defaults=True, **kw):
        calls.append((tasks, include_defaults))
        return {"results": {t: {"acc": 0.5} for t in ("looplab_tiny_cloze", "looplab_tiny_next_line")}, "average_acc": 0.5,
                "tasks": tasks, "limit": None, "n_samples": {"looplab_tiny_cloze": 300, "looplab_tiny_next_line": 300}}

    monkeypatch.setattr(looplab.eval, "run_zeroshot", fake_run_zeroshot)
    ckpt = save_checkpoint(tiny_model(loops=2), tmp_path / "lm.ckpt")
    sw = spec.get(1).sweeps_for("tiny")[0]
    run = tmp_path / "out" / "table1" / "tiny" / sw.folder / "0"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"status": "ok", "checkpoint": str(ckpt), "overrides": []}))
    written = tz.evaluate_table(1, "tiny", tmp_path / "out")
    assert written == [run / "zeroshot.json"] and calls == [(["looplab_tiny"], False)]
    zs = json.loads(written[0].read_text())
    assert zs["average_acc"] == 0.5 and zs["n_items"]["looplab_tiny_cloze"] == 300 and len(zs["ci95"]["looplab_tiny_cloze"]) == 2
