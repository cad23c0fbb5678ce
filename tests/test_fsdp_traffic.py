"""FSDP2 traffic of a looped model: collectives counted per optimizer step, against R, k, the mesh and the dtype.

One spawn of 4 CPU processes (gloo) runs every measurement; each collective is counted by kind, process-group
size and bytes (an all-gather's gathered output, a reduce-scatter's unsharded input, an all-reduce's tensor).

- Depth (2 ranks, ranks 2 and 3 wait): a 2⊗R model at R = 1, 2, 4, 8, sharded as hardware=fsdp shards it
  (`shard_looped_model`). Where R > 1, looplab's default (`gather_once`) all-gathers and reduce-scatters each
  block layer once per step, the root twice and once (it reshards after forward); its gradients equal one
  process's at every R. FSDP2's own schedule (`gather_once=False`) is counted too: 2R all-gathers per block
  layer. At R = 1 nothing is reused and gather_once is FSDP2's schedule: the block is freed after forward.
- Gradient accumulation (2 ranks): k = 4 micro-batches through `accumulate_without_sync` (what Lightning's
  training loop enters through `LoopedFSDPStrategy.block_backward_sync` for all but the last) make the same
  collectives per optimizer step as k = 1, under gather_once, FSDP2's schedule and at R = 1, and give one
  process's k = 1 gradients and weights (one SGD step); `accumulate_unsharded=False` multiplies them by k.
- bf16 all-gathers (2 ranks, a Mamba-2 model, CPU autocast): the gathered parameters are bf16 but for each
  mixer's A_log, dt_bias, D, conv and gated norm, gathered and used in fp32; gradients reduced and
  accumulated in fp32; bytes counted parameter by parameter.
- HSDP (4 ranks as 2 "nodes" × 2, `build_fsdp_mesh`): all-gathers and reduce-scatters within a node's 2
  ranks, one all-reduce of each rank's half across the 2 nodes; the same at k = 2; the weights equal one
  process's; against FSDP over the 4 ranks, where every all-gather spans both nodes.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from test_distributed import _free_port
from looplab.bench.fsdp_traffic import count_collectives as bench_count_collectives

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]  # the one-process references: tiny
PROCS, WORLD, B, T, V, N = 4, 2, 8, 8, 30, 2  # even sizes: no shard padding, so bytes are the parameters' own
LOOPS = (1, 2, 4, 8)
K = 4  # micro-batches per optimizer step on 2 ranks: 8 rows → 4 a rank → 1 a micro-batch
ACCUM = ((2, True), (2, False), (1, True))  # (R, gather_once) measured at k = K too
LR = 0.1  # SGD: the weights after a step are a function of the gradients alone


def make_model(R: int):
    from looplab.models import LoopedLM, LoopedLMConfig

    torch.manual_seed(0)
    return LoopedLM(LoopedLMConfig(vocab_size=V, d_model=32, n_heads=2, ffn_hidden=64, n_layers=N, n_loops=R))


def make_mamba():
    from looplab.models import LoopedLM, LoopedLMConfig

    torch.manual_seed(0)
    return LoopedLM(LoopedLMConfig(vocab_size=V, d_model=32, n_heads=2, n_layers=1, n_loops=2, backbone="mamba2",
                                   d_state=16, headdim=16, chunk_size=8, kernel="torch"))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(2)]


def loss_of(model, ids):
    return F.cross_entropy(model(ids[:, :-1]).logits.float().flatten(0, 1), ids[:, 1:].flatten())


# ------------------------------------------------------------------------------------------- counting
def count_collectives():
    """(kind, group size) → calls and (kind, group size, "bytes") → bytes of FSDP2's collectives: the bench's counter
    (bench/fsdp_traffic.py), by group size."""
    return bench_count_collectives(by_group_size=True)


def totals(counts: Counter) -> dict[str, int]:
    """{kind: calls, kind_bytes: bytes} over every group size."""
    out: Counter = Counter()
    for key, v in counts.items():
        out[key[0] + ("_bytes" if len(key) == 3 else "")] += v
    return dict(out)


# ------------------------------------------------------------------------------------------- one run
def _run(rank: int, world: int, mesh, R: int = 2, gather_once: bool = True, k: int = 1, keep: bool = True,
         checkpoint_loops: bool = False, mamba_bf16: bool = False) -> dict:
    """Two optimizer steps of k micro-batches on this rank's rows; the first's gradients and weights, the second's
    collectives; the block's state (sharded or not) at the last micro-batch's backward, after the step and after
    a forward without a graph."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from looplab.training.fsdp import accumulate_without_sync, shard_looped_model

    model = make_mamba() if mamba_bf16 else make_model(R)
    model.checkpoint_loops = checkpoint_loops  # hardware.activation_checkpointing: each loop recomputed in backward
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mamba_bf16 else None
    shard_looped_model(model, mesh=mesh, mp_policy=policy, gather_once=gather_once)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mamba_bf16 else contextlib.nullcontext
    seen: dict[str, torch.dtype] = {}
    if mamba_bf16:  # the dtypes the forward computes with
        mixer, layer = model.block[0].mixer, model.block[0]
        mixer.register_forward_pre_hook(lambda m, a: seen.update(
            {n: p.dtype for n, p in [*m.named_parameters(recurse=False), *m.conv1d.named_parameters(prefix="conv1d"),
                                     *m.norm.named_parameters(prefix="norm")]}))
        mixer.in_proj.register_forward_pre_hook(lambda m, a: seen.update({"in_proj.weight": m.weight.dtype}))
        layer.register_forward_pre_hook(lambda m, a: seen.update({"layer.norm.weight": m.norm.weight.dtype}))
        model.register_forward_pre_hook(lambda m, a: seen.update({"embed": next(m.parameters()).dtype}))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows = B // world
    local = [ids[rank * rows:(rank + 1) * rows] for ids in batches()]
    block_state = {}

    def step(ids: torch.Tensor) -> None:
        for i in range(k):
            with accumulate_without_sync(model, keep_unsharded=keep) if i < k - 1 else contextlib.nullcontext():
                with autocast():
                    loss = loss_of(model, ids[i * rows // k:(i + 1) * rows // k]) / k
                block_state["sharded_in_backward"] = all(isinstance(p, DTensor) for p in model.block.parameters())
                loss.backward()

    step(local[0])  # step 1 (FSDP2's lazy init): its gradients and weights against one process
    grads = {n: p.grad.full_tensor().float().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    with count_collectives() as counts:  # step 2: one optimizer step's traffic
        step(local[1])
        opt.step()
        opt.zero_grad()
    sharded_after_step = all(isinstance(p, DTensor) for p in model.block.parameters())
    with torch.no_grad(), count_collectives() as evaluation, autocast():
        model(local[1][:, :-1])
    sharded_after_eval = all(isinstance(p, DTensor) for p in model.block.parameters())
    return {"grads": grads, "weights": weights, "counts": counts, "step": totals(counts), "eval": totals(evaluation),
            "sharded_after_step": sharded_after_step, "sharded_after_eval": sharded_after_eval, "seen": seen,
            "master_dtypes": {n: p.dtype for n, p in model.named_parameters()}, **block_state}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PROCS)
    from looplab.training.fsdp import build_fsdp_mesh

    hsdp = build_fsdp_mesh("cpu", PROCS, num_nodes=2, hsdp="auto")  # ("replicate", "shard") = (2 nodes, 2 ranks)
    flat = build_fsdp_mesh("cpu", PROCS, num_nodes=2, hsdp=False)  # ("shard",) over the 4 ranks
    pair = hsdp["shard"]  # ranks {0, 1} (and {2, 3}, which wait): the 2-rank measurements
    res = {}

    def record(key, world, mesh=pair, **kw) -> None:
        if rank < world:
            try:
                res[key] = _run(rank, world, mesh, **kw)
            except Exception as e:  # recorded: the test fails with it
                res[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        dist.barrier()

    for R in LOOPS:
        for gather_once in (True, False):
            record((R, gather_once), WORLD, R=R, gather_once=gather_once)
    record((2, "checkpoint_loops"), WORLD, checkpoint_loops=True)
    for R, gather_once in ACCUM:
        record(("accum", R, gather_once), WORLD, R=R, gather_once=gather_once, k=K)
    record(("accum", 2, True, "sharded"), WORLD, k=K, keep=False)
    record(("bf16", 1), WORLD, mamba_bf16=True)
    record(("bf16", 2), WORLD, mamba_bf16=True, k=2)
    record(("hsdp", 1), PROCS, mesh=hsdp)
    record(("hsdp", 2), PROCS, mesh=hsdp, k=2)
    record(("hsdp", 2, "sharded"), PROCS, mesh=hsdp, k=2, keep=False)
    record(("flat4", 1), PROCS, mesh=flat)
    if rank == 0:
        torch.save(res, os.path.join(out_dir, "traffic.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    out = tmp_path_factory.mktemp("traffic")
    # forked from one server that imported torch and looplab once (spawn would import them in each of the 4:
    # seconds of CPU apiece); the server itself has run no torch code, so forking it is safe
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "looplab.training.fsdp", "torch.distributed.fsdp", "torch.distributed.tensor"])
    mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=PROCS, join=True, start_method="forkserver")
    res = torch.load(out / "traffic.pt", weights_only=False)
    for key, r in res.items():
        assert "error" not in r, f"{key}: {r['traceback']}"
    return res


def one_process(model, k: int = 1) -> tuple[dict, dict]:
    """Gradients and SGD-stepped weights of one process on the global batch."""
    loss_of(model, batches()[0]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_equal_to_one_process(res: dict, model, what: str, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    grads, weights = one_process(model)
    for n in grads:
        torch.testing.assert_close(res["grads"][n], grads[n], rtol=rtol, atol=atol, msg=lambda m: f"{what} grad {n}: {m}")
        torch.testing.assert_close(res["weights"][n], weights[n], rtol=rtol, atol=atol, msg=lambda m: f"{what} weight {n}: {m}")


def param_bytes(model, world: int = WORLD) -> dict[str, int]:
    """fp32 bytes of every parameter ("full"), and as gather_once gathers them ("gathered": the root twice), each
    padded as FSDP2 pads dim 0 to a multiple of the shard group's size."""
    def nbytes(p):
        return 4 * -(-p.shape[0] // world) * world * (p.numel() // p.shape[0])

    params = dict(model.named_parameters())
    full = sum(nbytes(p) for p in params.values())
    return {"full": full, "gathered": full + sum(nbytes(p) for n, p in params.items() if not n.startswith("block."))}


# ------------------------------------------------------------------------------------------- depth
def test_gather_once_traffic_is_the_same_at_every_depth(traffic):
    """Where R > 1, one all-gather and one reduce-scatter per block layer and optimizer step, at R = 2, 4, 8."""
    steps = {R: traffic[R, True]["step"] for R in LOOPS if R > 1}
    assert all(s == steps[2] for s in steps.values()), steps
    nbytes = param_bytes(make_model(2))
    assert steps[2] == {"all_gather": 2 + N, "all_gather_bytes": nbytes["gathered"],
                        "reduce_scatter": 1 + N, "reduce_scatter_bytes": nbytes["full"]}, steps[2]
    for R in LOOPS:  # the block is freed after the step and after a forward without a graph
        assert traffic[R, True]["sharded_after_step"] and traffic[R, True]["sharded_after_eval"], R
        assert traffic[R, True]["eval"]["all_gather"] == 1 + N, traffic[R, True]["eval"]
        # held gathered from forward to backward only where it is reused
        assert traffic[R, True]["sharded_in_backward"] == (R == 1), R


def test_gather_once_is_fsdp2_own_schedule_at_one_loop(traffic):
    """At R = 1 a layer is used once per forward: FSDP2's schedule (free after forward, gather again for backward:
    one all-gather more per layer than holding it, `reshard_after_forward: true`'s trade), and the block is not
    held gathered between forward and backward."""
    assert traffic[1, True]["step"] == traffic[1, False]["step"]
    assert traffic[1, True]["step"]["all_gather"] == 2 + 2 * N


def test_fsdp2_own_schedule_gathers_each_layer_at_each_use(traffic):
    """What gather_once removes: FSDP2 alone all-gathers a block layer 2R times per step."""
    for R in LOOPS:
        s = traffic[R, False]["step"]
        assert s["all_gather"] == 2 + 2 * R * N and s["reduce_scatter"] == 1 + N, (R, s)
        assert traffic[R, False]["eval"]["all_gather"] == 1 + R * N


@pytest.mark.parametrize("R", LOOPS)
def test_gather_once_gradients_equal_one_process(traffic, R):
    for gather_once in (True, False):
        assert_equal_to_one_process(traffic[R, gather_once], make_model(R), f"R={R} gather_once={gather_once}")


def test_gather_once_with_activation_checkpointing(traffic):
    """Per-loop checkpointing recomputes each loop in backward: the block is still gathered there (no extra
    all-gather) and the gradients are one process's."""
    res = traffic[2, "checkpoint_loops"]
    assert res["step"] == traffic[2, True]["step"] and res["sharded_after_step"]
    assert_equal_to_one_process(res, make_model(2), "checkpoint_loops")


# ------------------------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("R,gather_once", ACCUM)
def test_accumulation_traffic_does_not_depend_on_k(traffic, R, gather_once):
    """k = 4 micro-batches: the collectives of an optimizer step (kind, count, bytes) are k = 1's, and one
    process's gradients and weights at k = 1 come out."""
    acc = traffic["accum", R, gather_once]
    assert acc["counts"] == traffic[R, gather_once]["counts"], (acc["step"], traffic[R, gather_once]["step"])
    assert acc["sharded_after_step"] and acc["sharded_after_eval"]
    assert_equal_to_one_process(acc, make_model(R), f"k={K} R={R} gather_once={gather_once}")


def test_accumulate_sharded_reduces_every_micro_batch(traffic):
    """accumulate_unsharded=false: FSDP2's lowest-memory schedule, k times the collectives (the trade-off)."""
    acc, one = traffic["accum", 2, True, "sharded"], traffic[2, True]["step"]
    assert acc["step"] == {kind: K * v for kind, v in one.items()}, (acc["step"], one)
    assert_equal_to_one_process(acc, make_model(2), "accumulate_unsharded=false")


# ------------------------------------------------------------------------------------------- dtype policy
FP32_IN_MIXER = ("A_log", "dt_bias", "D", "conv1d.weight", "conv1d.bias", "norm.weight")


def test_bf16_gather_keeps_the_ssm_parameters_fp32(traffic):
    """param_dtype=bfloat16 (auto on GPUs under bf16-mixed): every parameter is gathered and used in bf16 but the
    Mamba-2 mixer's A_log, dt_bias, D (and the conv and gated norm that share its unit), which stay fp32; the
    master weights and gradients are fp32, reduced in fp32. Bytes: exactly that, parameter by parameter."""
    res = traffic["bf16", 1]
    seen = res["seen"]
    for name in FP32_IN_MIXER:
        assert seen[name] == torch.float32, (name, seen)
    assert seen["in_proj.weight"] == seen["layer.norm.weight"] == seen["embed"] == torch.bfloat16, seen
    assert set(res["master_dtypes"].values()) == {torch.float32}
    params = dict(make_mamba().named_parameters())
    fp32 = {n for n in params if n.startswith("block.0.mixer.") and n.removeprefix("block.0.mixer.") in FP32_IN_MIXER}
    assert len(fp32) == len(FP32_IN_MIXER)
    gathered = sum((4 if n in fp32 else 2) * p.numel() * (1 if n.startswith("block.") else 2) for n, p in params.items())
    units = 1 + 4  # the root (gathered twice: forward and backward), then the layer, its mixer (fp32), in_proj, out_proj
    assert res["step"] == {"all_gather": units + 1, "all_gather_bytes": gathered, "reduce_scatter": units,
                           "reduce_scatter_bytes": 4 * sum(p.numel() for p in params.values())}, res["step"]


def test_bf16_accumulation_traffic_and_gradients(traffic):
    """k = 2 under bf16 gathers: the same collectives as k = 1 (the micro-batches' bf16 gradients accumulated in
    fp32 by FSDP2), and gradients near one fp32 process's (bf16 compute: within 5 % in norm, per tensor)."""
    one, two = traffic["bf16", 1], traffic["bf16", 2]
    assert two["counts"] == one["counts"], (two["step"], one["step"])
    model = make_mamba()
    grads, _ = one_process(model)
    for res in (one, two):
        for n, g in grads.items():
            err = (res["grads"][n] - g).norm() / g.norm().clamp_min(1e-12)
            assert err < 5e-2, (n, float(err))


# ------------------------------------------------------------------------------------------- HSDP
def test_hsdp_shards_within_a_node_and_all_reduces_across(traffic):
    """2 "nodes" × 2 ranks: all-gathers and reduce-scatters within the node's 2 ranks, then one all-reduce of
    each rank's reduced half across the 2 nodes; nothing spans 4 ranks. The weights equal one process's."""
    res, nbytes = traffic["hsdp", 1], param_bytes(make_model(2))
    assert dict(res["counts"]) == {("all_gather", 2): 2 + N, ("all_gather", 2, "bytes"): nbytes["gathered"],
                                   ("reduce_scatter", 2): 1 + N, ("reduce_scatter", 2, "bytes"): nbytes["full"],
                                   ("all_reduce", 2): 1 + N, ("all_reduce", 2, "bytes"): nbytes["full"] // 2}, res["counts"]
    assert_equal_to_one_process(res, make_model(2), "hsdp")
    flat, nbytes = traffic["flat4", 1], param_bytes(make_model(2), world=4)  # FSDP over 4 ranks: all span both nodes
    assert dict(flat["counts"]) == {("all_gather", 4): 2 + N, ("all_gather", 4, "bytes"): nbytes["gathered"],
                                    ("reduce_scatter", 4): 1 + N, ("reduce_scatter", 4, "bytes"): nbytes["full"]}
    assert_equal_to_one_process(flat, make_model(2), "fsdp over 4")


def test_hsdp_accumulation(traffic):
    """HSDP at k = 2: accumulate_unsharded gives k = 1's collectives; accumulate_unsharded=false reduce-scatters
    within the node at every micro-batch but all-reduces across nodes once per optimizer step."""
    one = traffic["hsdp", 1]["counts"]
    assert traffic["hsdp", 2]["counts"] == one
    sharded = traffic["hsdp", 2, "sharded"]["counts"]
    for key, v in one.items():
        assert sharded[key] == (v if key[0] == "all_reduce" else 2 * v), (key, sharded)
    for key in (("hsdp", 2), ("hsdp", 2, "sharded")):
        assert_equal_to_one_process(traffic[key], make_model(2), str(key))
