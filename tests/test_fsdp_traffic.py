"""FSDP2 traffic of a looped model does not grow with R: collectives counted per optimizer step.

On 2 CPU processes (gloo), a 2⊗R model at R = 1, 2, 4, 8, sharded as hardware=fsdp shards it
(`shard_looped_model`: one unit per block layer, then the root). With looplab's default
(`gather_once`) each block layer is all-gathered once and reduce-scattered once per step, the root
twice and once (it reshards after forward); its gradients equal one process's at every R. FSDP2's
own schedule (`gather_once=False`) is counted too, as the figure the default removes: 2R all-gathers
per block layer (one before each use in forward, one before each use's backward) and, because the R
uses of a parameter feed one autograd accumulator, already one reduce-scatter. One spawn runs it all.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from test_distributed import _free_port

pytestmark = pytest.mark.slow
WORLD, B, T, V, N = 2, 4, 8, 30, 2  # even sizes: no shard padding, so bytes are the parameters' own
LOOPS = (1, 2, 4, 8)


def make_model(R: int):
    from looplab.models import LoopedLM, LoopedLMConfig

    torch.manual_seed(0)
    return LoopedLM(LoopedLMConfig(vocab_size=V, d_model=32, n_heads=2, ffn_hidden=64, n_layers=N, n_loops=R))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(2)]


def loss_of(model, ids):
    return F.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())


def _run(R: int, gather_once: bool, rank: int, checkpoint_loops: bool = False) -> dict:
    from torch.distributed.tensor import DTensor

    from looplab.bench.fsdp_traffic import count_collectives, summarize
    from looplab.training.distributed import shard_looped_model

    model = make_model(R)
    model.checkpoint_loops = checkpoint_loops  # hardware.activation_checkpointing: each loop recomputed in backward
    shard_looped_model(model, gather_once=gather_once)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = [ids[rank * B // WORLD:(rank + 1) * B // WORLD] for ids in batches()]
    loss_of(model, local[0]).backward()  # step 1 (FSDP2's lazy init): its gradients against one process
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    with count_collectives() as step:  # step 2: one optimizer step's traffic
        loss_of(model, local[1]).backward()
        opt.step()
        opt.zero_grad()
    sharded_after_step = all(isinstance(p, DTensor) for layer in model.block for p in layer.parameters())
    with torch.no_grad(), count_collectives() as evaluation:
        model(local[1][:, :-1])
    sharded_after_eval = all(isinstance(p, DTensor) for layer in model.block for p in layer.parameters())
    return {"grads": grads, "step": summarize(step), "eval": summarize(evaluation),
            "sharded_after_step": sharded_after_step, "sharded_after_eval": sharded_after_eval}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    res = {}
    for R in LOOPS:
        for gather_once in (True, False):
            try:
                res[R, gather_once] = _run(R, gather_once, rank)
            except Exception as e:  # recorded: the test fails with it
                res[R, gather_once] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            dist.barrier()
    try:
        res[2, "checkpoint_loops"] = _run(2, True, rank, checkpoint_loops=True)
    except Exception as e:
        res[2, "checkpoint_loops"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    if rank == 0:
        torch.save(res, os.path.join(out_dir, "traffic.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    out = tmp_path_factory.mktemp("traffic")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    res = torch.load(out / "traffic.pt", weights_only=False)
    for key, r in res.items():
        assert "error" not in r, f"{key}: {r['traceback']}"
    return res


def test_gather_once_traffic_is_the_same_at_every_depth(traffic):
    """One all-gather and one reduce-scatter per block layer and optimizer step, at R = 1, 2, 4, 8."""
    steps = {R: traffic[R, True]["step"] for R in LOOPS}
    assert all(s == steps[1] for s in steps.values()), steps
    root_and_layers = {n: p for n, p in make_model(1).named_parameters()}
    nbytes = 4 * sum(p.numel() for p in root_and_layers.values())  # fp32, every parameter once
    assert steps[1] == {"all_gather": 2 + N, "all_gather_bytes": nbytes + 4 * sum(p.numel() for n, p in root_and_layers.items()
                                                                                   if not n.startswith("block.")),
                        "reduce_scatter": 1 + N, "reduce_scatter_bytes": nbytes}, steps[1]
    for R in LOOPS:  # the block is freed after the step and after a forward without a graph
        assert traffic[R, True]["sharded_after_step"] and traffic[R, True]["sharded_after_eval"], R
        assert traffic[R, True]["eval"]["all_gather"] == 1 + N, traffic[R, True]["eval"]


def test_fsdp2_own_schedule_gathers_each_layer_at_each_use(traffic):
    """What gather_once removes: FSDP2 alone all-gathers a block layer 2R times per step (at R = 1 too: it
    frees the layer after forward and gathers it again for backward, where gather_once keeps it)."""
    for R in LOOPS:
        s = traffic[R, False]["step"]
        assert s["all_gather"] == 2 + 2 * R * N and s["reduce_scatter"] == 1 + N, (R, s)
        assert traffic[R, False]["eval"]["all_gather"] == 1 + R * N


@pytest.mark.parametrize("R", LOOPS)
def test_gather_once_gradients_equal_one_process(traffic, R):
    model = make_model(R)
    loss_of(model, batches()[0]).backward()
    for gather_once in (True, False):
        grads = traffic[R, gather_once]["grads"]
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"R={R} {gather_once} {n}: {m}")


def test_gather_once_with_activation_checkpointing(traffic):
    """Per-loop checkpointing recomputes each loop in backward: the block is still gathered there (no extra
    all-gather) and the gradients are one process's."""
    res = traffic[2, "checkpoint_loops"]
    assert res["step"] == traffic[1, True]["step"] and res["sharded_after_step"]
    model = make_model(2)
    loss_of(model, batches()[0]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(res["grads"][n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
