"""The benchmark harness runs end to end in --quick mode and writes well-formed figures.

No timing thresholds: the machine is shared, so only structure and sanity are asserted.
"""

import json
import math

import pytest
import torch

from looplab.bench import __main__ as runner
from looplab.bench import common, train


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_closed_form_flops_match_model_flops():
    d = dict(train.QUICK, n_layers=3, n_loops=5)
    model = train.looplab_model(d)
    T = d["seq_len"]
    assert model.flops_per_token(T, training=True) == train.closed_form_flops(model, T, causal=False)
    # what MFU divides by: causal attention counted as causal (T(T + 1)/2 of the T² query-key pairs)
    assert train.causal_flops_per_token(model, T, training=True) == train.closed_form_flops(model, T)
    # the unlooped twin with N·R layers does the same work per token
    twin = train.looplab_model(d, n_layers=15, n_loops=1)
    assert twin.flops_per_token(T, training=True) == model.flops_per_token(T, training=True)


def test_transformers_reference_has_same_matmul_params_per_layer():
    d = train.QUICK
    hf = train.transformers_model(d, n_layers=d["n_layers"] * d["n_loops"])
    ours = train.looplab_model(d, n_layers=d["n_layers"] * d["n_loops"], n_loops=1)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(hf) == count(ours)


def test_unknown_part_is_pending():
    out = runner.run_part("not_landed_yet", 1, True, {}, {})
    assert out["status"] == "pending"


def test_quick_run_writes_expected_keys(tmp_path):
    out = tmp_path / "results.json"
    runner.main(["--quick", "--threads", "1", "--only", "train,data", "--out", str(out)])
    res = json.loads(out.read_text())
    m = res["machine"]
    assert m["threads"] == 1 and m["torch"] and m["cpu"] and m["date"]
    tr = res["train"]
    assert tr["status"] == "ok", tr
    for k in ("tokens_per_s", "ratio_vs_transformers", "ratio_vs_unlooped", "mfu", "matmul_gflops",
              "transformers_tokens_per_s", "unlooped_tokens_per_s", "peak_memory_mb"):
        assert _positive_finite(tr[k]), (k, tr.get(k))
    assert tr["flops_per_token"] == tr["flops_per_token_issue_formula"]
    for name in ("foreach_adamw", "checkpoint_loops", "sdpa_math"):
        assert _positive_finite(tr["options"][name]["speedup_vs_default"])
    # MFU uses the ceiling measured around each step; best is one of the measured configurations
    lo, hi = tr["matmul_gflops_range"]
    assert 0 < lo <= tr["matmul_gflops"] <= hi
    assert tr["best"]["config"] in {"default", *tr["options"]}
    assert tr["best"]["tokens_per_s"] >= tr["tokens_per_s"]
    R = tr["config"]["n_loops"]
    for k in ("transformers", f"looplab_R{R}", f"looplab_R{R}_checkpoint"):
        assert _positive_finite(tr["memory_mb"][k]["peak_mb"]), tr["memory_mb"][k]
    da = res["data"]
    assert da["status"] == "ok", da
    assert _positive_finite(da["train_steps_per_s"])
    for k in ("lm", "tasks"):
        if da[k].get("status") != "pending":
            assert _positive_finite(da[k]["batches_per_s"]) and _positive_finite(da[k]["ratio_vs_train_step"])


def test_only_keeps_other_parts(tmp_path):
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"decode": {"status": "ok", "state_overhead": 0.1}}))
    runner.main(["--quick", "--threads", "1", "--only", "train", "--no-memory", "--no-options", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["decode"]["state_overhead"] == 0.1 and res["train"]["status"] == "ok"


@pytest.mark.parametrize("n", [64])
def test_matmul_ceiling_positive(n):
    assert _positive_finite(common.matmul_probe(n, calls=2)())


def test_first_compiled_call_records_failure():
    def broken() -> None:
        raise RuntimeError("no C++ compiler\nsecond line")

    assert common.first_compiled_call(broken) == {"error": "RuntimeError: no C++ compiler"}
    assert common.first_compiled_call(lambda: None)["compile_s"] >= 0


class FakeClock:
    """Stands in for both of the timer's clocks: time moves only when a candidate says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(common, "_wall", c)
    monkeypatch.setattr(common, "_cpu", c)
    return c


def test_timer_runs_rounds_in_abba_order_and_pairs_ratios_per_round(clock):
    calls = []
    seconds = {"a": iter([5, 1, 2, 10]), "b": iter([5, 10, 4, 20])}  # the first call of each is the warm-up

    def call(name):
        def fn():
            calls.append(name)
            clock.now += next(seconds[name])
        return fn

    t = common.time_round_robin({"a": call("a"), "b": call("b")}, 3, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # odd rounds reversed, warm-up round included
    assert t.wall == {"a": [1, 2, 10], "b": [10, 4, 20]} and t.cpu == t.wall and t.reference == "a"
    assert t.ratios("b") == [10, 2, 2]  # round by round, against the reference
    assert t.ratio("b") == (2, 2, 10)  # median and range of those: not the ratio of the medians (10 / 2)
    assert t.ratio("a", "b").median == 0.5 and t.median("b") == 10
    with pytest.raises(ValueError, match="clock"):
        t.seconds("a", "gpu")


def test_timer_steppers_prepare_untimed_per_episode(clock):
    """A stepper's start (here 100 s) is never counted; episodes restart every stepper, the warm-up rounds are
    the first ones overall, and `after` sees every step's output, warm-up included."""
    events = []

    class Decoder(common.Stepper):
        def __init__(self, name, cost):
            self.name, self.cost = name, cost

        def start(self, episode):
            events.append((self.name, "start", episode))
            self.episode = episode
            clock.now += 100

        def step(self, i):
            events.append((self.name, i))
            clock.now += self.cost
            return self.episode, i

    seen = []
    t = common.time_round_robin({"x": Decoder("x", 1), "y": Decoder("y", 3)}, episodes=[2, 3], warmup=1,
                                after=lambda name, out: seen.append((name, out)))
    assert events == [("x", "start", 0), ("y", "start", 0), ("x", 0), ("y", 0), ("y", 1), ("x", 1),
                      ("x", "start", 1), ("y", "start", 1), ("x", 0), ("y", 0), ("y", 1), ("x", 1), ("x", 2), ("y", 2)]
    assert t.wall == {"x": [1, 1, 1, 1], "y": [3, 3, 3, 3]}  # 5 rounds, 1 warm-up
    assert t.ratio("y") == (3, 3, 3)
    assert len(seen) == 10 and seen[0] == ("x", (0, 0)) and seen[-1] == ("y", (1, 2))


def test_timer_ceiling_probe_brackets_each_timed_call(clock):
    probes = iter(range(10, 1000, 10))
    t = common.time_round_robin({"a": lambda: None, "b": lambda: None}, 2, warmup=1, ceiling=lambda: next(probes))
    assert t.ceiling == {"a": [35, 55], "b": [15, 75]}  # round 1 (b, a), then round 2 (a, b); warm-up unprobed


def test_timer_refuses_unclear_arguments():
    with pytest.raises(TypeError, match="repeats"):
        common.time_round_robin({"a": lambda: None}, 2, episodes=[2])
    with pytest.raises(TypeError, match="repeats"):
        common.time_round_robin({"a": lambda: None})
    with pytest.raises(KeyError, match="nope"):
        common.time_round_robin({"a": lambda: None}, 1, reference="nope")


def test_timer_synchronises_cuda_around_each_timed_call(monkeypatch, clock):
    """On a GPU the timer waits for the device before reading the clock and before stopping it (and after a
    stepper's start); on the CPU it never calls CUDA."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))

    class Step(common.Stepper):
        def start(self, episode):
            events.append("start")

        def step(self, i):
            events.append("step")

    common.time_round_robin({"s": Step()}, 2, warmup=0, device="cuda:1")
    sync = ("sync", "cuda:1")
    assert events == ["start", sync, sync, "step", sync, sync, "step", sync]
    events.clear()
    common.time_round_robin({"s": Step()}, 2, warmup=0, device="cpu")
    common.time_round_robin({"s": Step()}, 2, warmup=0)
    assert events == ["start", "step", "step"] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no CUDA GPU visible to torch")
def test_timer_on_cuda_times_the_kernels():
    a = torch.randn(2048, 2048, device="cuda")
    t = common.time_round_robin({"mm": lambda: a @ a, "mm2": lambda: (a @ a) @ a}, 3, device=a.device)
    assert all(x > 0 for x in t.wall["mm"]) and t.ratio("mm2", "mm").median > 1


def test_cuda_without_gpu_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal path does not apply")
    with pytest.raises(SystemExit):
        runner.main(["--quick", "--device", "cuda", "--only", "train"])
    assert "--device cuda" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no CUDA GPU visible to torch")
def test_quick_run_on_cuda(tmp_path):
    out = tmp_path / "results.json"
    runner.main(["--quick", "--device", "cuda", "--only", "train", "--no-compile", "--out", str(out)])
    tr = json.loads(out.read_text())["train"]
    assert tr["status"] == "ok", tr
    assert tr["dtype"] == "bf16 autocast" and _positive_finite(tr["mfu"]) and _positive_finite(tr["peak_memory_mb"])


def test_overhead_part_measures_plain_transformers_and_skip(tmp_path):
    """`make bench`'s decoding-overhead part: plain cached decoding against transformers' generate on the
    same weights (which decodes the same tokens) and skip decoding in which no token exits."""
    out = tmp_path / "results.json"
    runner.main(["--quick", "--threads", "1", "--only", "overhead", "--out", str(out)])
    o = json.loads(out.read_text())["overhead"]
    assert o["status"] == "ok", o
    w = o["widths"]["64"]
    assert w["transformers_agree"] == 1.0  # the unrolled model is the same model
    for k in ("tokens_per_s", "ratio_vs_transformers", "per_loop_ms"):
        assert _positive_finite(w[k]), (k, w)
    for k in ("plain", "plain_depth1", "gate_plain", "skip_no_exit", "transformers"):
        assert _positive_finite(w["ms_per_token"][k]), k
    assert w["skip_overhead"] > -1 and math.isfinite(w["outside_loops_share"]) and w["outside_loops_share"] < 1
    assert o["skip_overhead"] == w["skip_overhead"] and o["ratio_vs_transformers"] == w["ratio_vs_transformers"]


def test_router_part_measures_routed_and_fixed_depth(tmp_path, capsys):
    """`make bench`'s depth-routing part (Mixture-of-Recursions): training and decoding tokens/s of expert choice and
    token choice against the fixed-depth model with the same block, and their analytic training FLOPs."""
    out = tmp_path / "results.json"
    runner.main(["--quick", "--threads", "1", "--only", "router", "--out", str(out)])
    r = json.loads(out.read_text())["router"]
    assert r["status"] == "ok", r
    arms = r["arms"]
    assert set(arms) == {"fixed", "expert_choice", "token_choice"}
    fixed = arms["fixed"]
    for name, a in arms.items():
        for k in ("tokens_per_s", "tokens_per_s_wall", "flops_per_token_train", "decode_tokens_per_s", "decode_mean_depth"):
            assert _positive_finite(a[k]), (name, k, a.get(k))
        # the same block: the routed arms add only the router's d·R weights
        assert 0 <= a["params"] - fixed["params"] <= r["config"]["d_model"] * r["config"]["n_loops"]
    for short, name in (("ec", "expert_choice"), ("tc", "token_choice")):
        a = arms[name]
        assert 0 < a["flops_ratio"] < 1 and r[f"{short}_flops_ratio"] == a["flops_ratio"]
        assert 0 < r[f"{short}_flops_ratio_measured"] < 1
        for k in ("tokens_per_s_ratio", "tokens_per_s_ratio_wall", "decode_tokens_per_s_ratio"):
            assert _positive_finite(r[f"{short}_{k}"]), (short, k)
        assert a["gathered_fractions"][0] == 1.0 and min(a["gathered_fractions"]) < 1
        assert 1 <= a["decode_mean_depth"] <= r["config"]["n_loops"]
    # MoR's capacities: expert choice gathers exactly (R − r)/R of the tokens at loop r
    R = r["config"]["n_loops"]
    assert arms["expert_choice"]["gathered_fractions"] == pytest.approx([(R - i) / R for i in range(R)], abs=1 / r["config"]["seq_len"])
    assert "ec_flops_ratio" in capsys.readouterr().out  # the headline table prints the part


def test_parallel_part_measures_parallel_sequential_and_unlooped(tmp_path, capsys):
    """`make bench`'s parallel-loops part: decoding tokens/s of parallel 1⊗4 (each kv) against sequential 1⊗4 and
    1⊗1 at batch 1 and 8, KV bytes, and the decoded logits checked against the CLP forward first."""
    out = tmp_path / "results.json"
    runner.main(["--quick", "--threads", "1", "--only", "parallel", "--out", str(out)])
    r = json.loads(out.read_text())["parallel"]
    assert r["status"] == "ok", r
    arms = {"1x1", "seq_1x4", "par_1x4_own", "par_1x4_share_first", "par_1x4_gswa"}
    for b in (1, 8):
        cells = r[f"batch{b}"]
        assert set(cells) == arms
        for name, c in cells.items():
            assert _positive_finite(c["tokens_per_s"]) and _positive_finite(c["vs_1x1"]), (b, name, c)
        assert cells["1x1"]["vs_1x1"] == 1.0 and cells["seq_1x4"]["vs_seq_1x4"] == 1.0
        # KV: own keeps the sequential model's R caches, share_first one, gswa one plus R−1 windows of w
        full = cells["1x1"]["kv_bytes"]
        tokens = r["prompt"] + r["new_tokens"]
        assert cells["seq_1x4"]["kv_bytes"] == cells["par_1x4_own"]["kv_bytes"] == 4 * full
        assert cells["par_1x4_share_first"]["kv_bytes"] == full
        assert cells["par_1x4_gswa"]["kv_bytes"] == full + 3 * full * r["window"] // tokens
    assert all(v <= 1e-4 for v in r["decode_vs_clp_forward"].values())
    assert r["gswa_vs_1x1_batch1"] == r["batch1"]["par_1x4_gswa"]["vs_1x1"]
    assert set(r["targets_met"]) == set(r["targets"])
    assert "gswa_vs_seq_batch1" in capsys.readouterr().out
