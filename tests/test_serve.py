"""looplab.serve.Engine: a running batch whose requests join and leave mid-run, each decoded as it would be alone."""

from __future__ import annotations

import re

import json

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy
from looplab.models.generation import generate
from looplab.serve import Engine, solo_agreement

V = 97


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def looped(**kw) -> LoopedLM:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=1, n_loops=3, max_seq_len=128, headdim=16, d_state=16)
    m = LoopedLM(LoopedLMConfig(**{**base, **kw})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        m.head.weight.mul_(4)
        if m.exit_gate is not None:
            torch.nn.init.normal_(m.exit_gate.proj.weight, std=2.0)  # spread the exits over the loops
    return m


def trace(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, V, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g),
             int(torch.randint(1, 14, (1,), generator=g))) for _ in range(n)]


CASES = {
    "llama": (dict(), None),
    "llama_gate_kv_copy": (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="kv_copy")),
    "llama_gate_read_only": (dict(exit_gate="ouro", coda_layers=1), ExitPolicy(threshold=0.6)),
    "hybrid_gate_ssm_skip": (dict(backbone="hybrid", hybrid_pattern="MA", n_layers=2, exit_gate="ouro"),
                             ExitPolicy(threshold=0.5, skip="ssm_skip")),
    "mamba2_gate_ssm_propagate": (dict(backbone="mamba2", exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="ssm_propagate")),
    "stateloop_attn_prelude_coda": (dict(state_mode="stateloop_attn", prelude_layers=1, coda_layers=1), None),
    "router_expert_choice": (dict(depth_router={"name": "expert_choice"}), None),
    "router_token_choice": (dict(depth_router={"name": "token_choice"}), None),
    "parallel_gswa": (dict(loop_schedule="parallel", loop_kv="gswa", loop_window=4), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_equals_solo_decoding(case):
    """9 requests through 3 rows: rows are reused, requests join while others decode and leave at eos or at their
    limit; every request's tokens and exit depths equal generate() of that request alone."""
    kw, exits = CASES[case]
    m = looped(**kw)
    reqs = trace()
    # an eos that some request meets before its limit: the third token request 0 decodes alone
    eos = int(generate(m, reqs[0][0][None], 3, exits=exits)[0, -1])
    engine = Engine(m, max_batch=3, max_len=40, exits=exits, eos_token_id=eos)
    handles = [engine.add(p, n) for p, n in reqs]
    joined_mid_run = 0
    while not engine.idle():
        before = {r.id for r in engine.running}
        engine.step()
        joined_mid_run += bool(before) and any(r.id not in before and r.row is not None for r in engine.running)
    assert all(h.done for h in handles) and engine.stats["prefills"] == 9
    assert joined_mid_run >= 2  # admissions into freed rows while other rows were mid-generation
    assert any(h.hit_eos and len(h.tokens) < h.max_new_tokens for h in handles)
    assert any(not h.hit_eos and len(h.tokens) == h.max_new_tokens for h in handles)
    if exits is not None:
        assert all(len(h.exit_steps) == len(h.tokens) for h in handles)
        assert len({s for h in handles for s in h.exit_steps}) > 1  # the exits bind
    agree = solo_agreement(m, handles, exits=exits, eos_token_id=eos)
    assert agree["equal"] == 9, agree["differences"]


def test_arrivals_wait_and_errors_name_the_value():
    m = looped()
    clock = {"t": 0.0}
    engine = Engine(m, max_batch=2, max_len=32, clock=lambda: clock["t"])
    late = engine.add([3, 4, 5], 4, arrival=5.0)
    early = engine.add([6, 7], 4)
    engine.step()
    assert early.row is not None and late.row is None  # not arrived yet
    clock["t"] = 6.0
    engine.step()
    assert late.row is not None and len(late.tokens) == 2
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.add([1], 0)
    with pytest.raises(ValueError, match="max_len=32"):
        engine.add(list(range(1, 30)), 8)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add([], 3)


# ------------------------------------------------------------------ depth-wise batching
DEPTHWISE = {
    "llama": (dict(), None),
    "llama_gate_kv_copy": (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="kv_copy")),
    "stateloop_prelude_coda_concat_gate": (dict(exit_gate="ouro", coda_layers=1, prelude_layers=1, injection="concat",
                                                state_mode="stateloop", n_layers=2), ExitPolicy(threshold=0.5, skip="kv_copy")),
    "gqa_kl_rule_min_loops": (dict(n_kv_heads=2), ExitPolicy(threshold=0.05, rule="kl", min_loops=2, skip="kv_copy")),
    "hybrid_prelude": (dict(backbone="hybrid", hybrid_pattern="MA", n_layers=2, prelude_layers=1), None),
    "hybrid_gate_ssm_skip_coda": (dict(backbone="hybrid", hybrid_pattern="MA", n_layers=2, exit_gate="ouro",
                                       coda_layers=1), ExitPolicy(threshold=0.5, skip="ssm_skip")),
    "mamba2_gate_ssm_propagate": (dict(backbone="mamba2", exit_gate="ouro"), ExitPolicy(threshold=0.5, skip="ssm_propagate")),
    "router_expert_choice": (dict(depth_router={"name": "expert_choice"}, n_layers=2), None),
    "router_token_choice_injection": (dict(depth_router={"name": "token_choice"}, injection="add"), None),
}


@pytest.mark.parametrize("case", sorted(DEPTHWISE))
def test_depthwise_batching_equals_solo_decoding(case):
    """schedule='depthwise': each step is one call of every block layer over the in-flight tokens, each at its own
    loop; requests join and leave mid-run; every request's tokens and exit depths equal generate() alone."""
    kw, exits = DEPTHWISE[case]
    m = looped(**kw)
    reqs = trace()
    eos = int(generate(m, reqs[0][0][None], 3, exits=exits)[0, -1])
    engine = Engine(m, max_batch=3, max_len=40, exits=exits, eos_token_id=eos, schedule="depthwise")
    calls = []
    hook = m.block[0].register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    handles = [engine.add(p, n) for p, n in reqs]
    per_step = []
    while not engine.idle():
        before = len(calls)
        prefills = engine.stats["prefills"]
        engine.step()
        if engine.stats["prefills"] == prefills:  # a prefill runs the block R times over one prompt
            per_step.append(len(calls) - before)
    hook.remove()
    assert set(per_step) <= {0, 1} and 1 in per_step  # one block call per step (0: nothing in flight)
    loops = engine.depthwise.block_calls
    assert sum(len(set(c)) > 1 for c in loops) >= 3  # calls holding items of two or more different loops
    assert all(h.done for h in handles) and engine.stats["prefills"] == 9
    if exits is not None:
        assert len({s for h in handles for s in h.exit_steps}) > 1
    agree = solo_agreement(m, handles, exits=exits, eos_token_id=eos)
    assert agree["equal"] == 9, agree["differences"]


@pytest.mark.parametrize("kw,exits,named", [
    (dict(state_mode="stateloop_attn"), None, "state_mode=stateloop_attn (mixer attn)"),
    (dict(depth_router={"name": "expert_choice", "kv": "share_first"}), None, "depth_router.kv='share_first'"),
    (dict(depth_router={"name": "token_choice"}, backbone="hybrid", hybrid_pattern="MA", n_layers=2), None,
     "depth_router=token_choice with backbone=hybrid (Mamba-2 layers)"),
    (dict(loop_schedule="parallel"), None, "loop_schedule=parallel"),
    (dict(exit_gate="ouro"), ExitPolicy(threshold=0.5), "skip=None"),
])
def test_depthwise_refuses_by_name(kw, exits, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        Engine(looped(**kw), max_batch=2, max_len=32, exits=exits, schedule="depthwise")
    with pytest.raises(ValueError, match="schedule='diagonal'"):
        Engine(looped(), schedule="diagonal")


# ------------------------------------------------------------------ the load benchmark
def test_serve_bench_cli_on_a_checkpoint_checks_every_request(tmp_path, capsys):
    """`python -m looplab.bench serve CKPT`: closed-loop runs of the three arms at each concurrency and an open-loop
    Poisson run, JSON with the reported figures, and every request checked against decoding it alone."""
    from looplab.bench.__main__ import main as bench_main
    from looplab.bench.serve import make_trace

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1, n_loops=3, max_seq_len=64,
                                    exit_gate="ouro")).eval()
    with torch.no_grad():
        model.exit_gate.proj.weight.normal_(0, 0.5)
        model.exit_gate.proj.bias.fill_(-0.5)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "serve.json"
    bench_main(["serve", str(tmp_path / "ckpt"), "--concurrency", "1,3", "--requests", "6", "--rate", "500",
                "--prompt-len", "2,6", "--new-tokens", "2,6", "--repeats", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert sorted(r["repeat"] for r in res["runs"] if r["concurrency"] == 1) == [0, 0, 0, 1, 1, 1]
    assert all("solo_check" in r for r in res["runs"] if r["repeat"] == 0)  # outputs checked on the first repeat
    runs = {(r["arm"], r["concurrency"], r["open_loop"]): r for r in res["runs"] if r["repeat"] == 0}
    assert set(runs) == {(a, c, o) for a in ("plain", "exits_lockstep", "exits_depthwise")
                         for c, o in ((1, False), (3, False), (3, True))}
    traces = {o: make_trace(6, 64, (2, 6), (2, 6), rate=500 if o else None, seed=0) for o in (False, True)}
    for key, r in runs.items():
        assert r["requests"] == 6 and r["output_tokens"] == sum(q["max_new_tokens"] for q in traces[key[2]]), key
        assert r["solo_check"]["different"] == 0 and r["solo_check"]["equal"] + r["solo_check"]["ties"] == 6, key
        assert r["output_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and 0 < r["prefill_share"] < 1, key
        assert 0 <= r["ttft_p50_s"] <= r["ttft_p99_s"] and r["token_latency_p50_s"] <= r["token_latency_p99_s"], key
        assert r["peak_cache_bytes"] > 0, key
        assert (r["mean_depth"] == 3.0) if key[0] == "plain" else (1.0 <= r["mean_depth"] < 3.0), key
    # both schedules take the same exit decisions (each equals solo decoding with the same rule)
    assert runs[("exits_depthwise", 3, False)]["mean_depth"] == runs[("exits_lockstep", 3, False)]["mean_depth"]
    lo, hi = res["summary"]["exits_depthwise_vs_plain_c3_range"]
    assert lo <= res["summary"]["exits_depthwise_vs_plain_c3"] <= hi
    assert res["solo_differences"] == 0
    assert "exits_depthwise_vs_plain_c3" in res["summary"] and "plain_c3_vs_one_at_a_time" in res["summary"]
    assert "wrote" in capsys.readouterr().out


def test_serve_bench_serves_an_exit_rule_a_model_without_a_gate(tmp_path, capsys):
    """`bench serve CKPT --exit-rule entropy --exit-threshold X` on a model without an exit gate: the exit arms run
    with the zero-shot rule (exits at more than one depth, every request equal to decoding it alone with the same
    rule), and the JSON names the rule; an unknown rule is refused by name before anything runs."""
    from looplab.bench.__main__ import main as bench_main

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1, n_loops=3, max_seq_len=64)).eval()
    with torch.no_grad():
        model.head.weight.mul_(8)  # next-token entropies that differ across tokens and loops
    ids = torch.randint(1, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # a threshold at which the rule stops tokens at different depths
        spread = {x: set(model(ids, exits=ExitPolicy(threshold=x, rule="entropy")).exit_steps.flatten().tolist())
                  for x in torch.linspace(2.0, 4.2, 23).tolist()}
    x = max(spread, key=lambda k: len(spread[k]))
    assert len(spread[x]) > 1, spread
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "serve.json"
    bench_main(["serve", str(tmp_path / "ckpt"), "--exit-rule", "entropy", "--exit-threshold", str(x),
                "--concurrency", "2", "--requests", "4", "--prompt-len", "4,8", "--new-tokens", "4,8", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["model"]["exit_rule"] == "entropy" and res["model"]["exit_gate"] == "none"
    runs = {r["arm"]: r for r in res["runs"]}
    assert "exits_lockstep" in runs and runs["plain"]["mean_depth"] == 3.0
    for arm, r in runs.items():
        assert r["solo_check"]["different"] == 0, (arm, r["solo_check"])
    assert 1.0 <= runs["exits_lockstep"]["mean_depth"] < 3.0
    with pytest.raises(ValueError, match="entropyy"):
        bench_main(["serve", str(tmp_path / "ckpt"), "--exit-rule", "entropyy", "--out", str(tmp_path / "y.json")])
    assert not (tmp_path / "y.json").exists()


def test_serve_bench_refuses_bad_options_by_name(tmp_path, capsys):
    from looplab.bench.__main__ import main as bench_main

    for args, named in ((["--concurrency", "0,8"], "--concurrency '0,8'"), (["--rate", "-1"], "--rate -1.0"),
                        (["--new-tokens", "5,2"], "--new-tokens '5,2'"), (["--repeats", "0"], "--repeats 0")):
        with pytest.raises(SystemExit):
            bench_main(["serve", "random", *args, "--out", str(tmp_path / "x.json")])
        assert named in capsys.readouterr().err, args
    assert not (tmp_path / "x.json").exists()


def test_make_bench_serve_part(tmp_path):
    """`make bench`'s serve part (quick): every arm's runs, solo-checked, with the headline ratios."""
    from looplab.bench.__main__ import main as bench_main

    out = tmp_path / "results.json"
    bench_main(["--quick", "--threads", "1", "--only", "serve", "--out", str(out)])
    r = json.loads(out.read_text())["serve"]
    assert r["status"] == "ok", r
    assert {(x["arm"], x["concurrency"]) for x in r["runs"]} == {(a, c) for a in ("plain", "exits_lockstep",
                                                                               "exits_depthwise") for c in (1, 8)}
    assert r["solo_differences"] == 0
    for k in ("depthwise_vs_plain_c8", "depthwise_decode_vs_plain_c8", "lockstep_exits_vs_plain_c8", "ideal_c8"):
        assert r[k] > 0, k
    assert r["ideal_c8"] > 1.2  # the gate spreads the exits: there is depth to save


@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
def test_sampled_requests_draw_what_they_draw_alone(schedule):
    """Requests with sampling options beside greedy ones: each sampled request draws from its own seeded generator, so
    it gets exactly what generate(sampling=..., generator seeded alike) gives it alone; another seed draws otherwise."""
    from looplab.models.generation import Sampling

    m = looped(exit_gate="ouro")
    exits = ExitPolicy(threshold=0.5, skip="kv_copy")
    engine = Engine(m, max_batch=3, max_len=40, exits=exits, schedule=schedule)
    warm = Sampling(temperature=1.0, top_k=20)
    handles = [engine.add(p, 12, sampling=warm if i % 2 else None, seed=100 + i) for i, (p, _) in enumerate(trace(6))]
    engine.run()
    assert [h.sampling is not None for h in handles] == [False, True] * 3
    agree = solo_agreement(m, handles, exits=exits)
    assert agree["equal"] == 6, agree["differences"]
    greedy = generate(m, handles[1].prompt[None], 12, exits=exits)[0, handles[1].prompt.numel():].tolist()
    assert handles[1].tokens != greedy  # the draws are not the greedy tokens
    other = Engine(m, max_batch=3, max_len=40, exits=exits, schedule=schedule)
    again = other.add(handles[1].prompt, 12, sampling=warm, seed=7)
    other.run()
    assert again.tokens != handles[1].tokens
    with pytest.raises(ValueError, match="sampling.generator"):
        engine.add([1, 2], 3, sampling=Sampling(temperature=1.0, generator=torch.Generator()))
