"""The compiled training step (`compile=true`; `compile=auto` on GPUs, docs/training.md#compile): one Dynamo graph for
every layer of a kind — prelude, block and coda alike — reused by every loop, at any depth, at every step.

Dynamo traces here with its `aot_eager` backend (forward and backward graphs, no code generation): the graph count is
Dynamo's and the same under inductor, which on the CPU spends seconds generating C++ for each graph.
"""

from __future__ import annotations

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig

pytestmark = pytest.mark.usefixtures("one_thread_module")


class Calls(torch.nn.Module):
    """Counts the calls of a compiled layer."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.n = inner, 0

    def forward(self, *args, **kwargs):
        self.n += 1
        return self.inner(*args, **kwargs)


def test_compiled_training_is_one_graph_over_layers_loops_depths_and_steps():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=48, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, n_layers=2,
                                    n_loops=3, prelude_layers=1, coda_layers=1, max_seq_len=16)).train()
    eager = LoopedLM(LoopedLMConfig(**model.config.to_dict())).train()
    eager.load_state_dict(model.state_dict())
    model.compile_block(backend="aot_eager")
    spies = {part: [Calls(c) for c in model._compiled_ends[part]] for part in ("prelude", "coda")}
    model._compiled_ends = spies
    model._compiled_layers = block = [Calls(c) for c in model._compiled_layers]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (model, eager)]
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    depths = (2, 3, 2, 3)  # a depth per step, as randomized-depth training draws them (loop_depth.sampler)
    for R in depths:
        for m, opt in zip((model, eager), opts):
            m(ids, n_loops=R).logits.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # after each step: still one
    assert counters["frames"]["total"] == counters["frames"]["ok"] == 1, dict(counters["frames"])  # no recompile
    assert not counters["recompiles"] and not counters["graph_break"], (dict(counters["recompiles"]),
                                                                        dict(counters["graph_break"]))
    # every layer ran compiled: the prelude and the coda once a step, each block layer once per loop
    steps, loops = len(depths), sum(depths)
    assert [s.n for s in spies["prelude"]] == [steps] and [s.n for s in spies["coda"]] == [steps]
    assert [b.n for b in block] == [loops, loops]
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):  # and trained as the eager model does
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    assert not any(k.startswith("_compiled") for k in model.state_dict())  # checkpoints keep their keys
    # evaluation and cached decoding stay eager: no new graph
    model.eval()
    with torch.no_grad():
        model(ids)
        model.generate(ids[:, :4], 3)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(("accelerator", "d_model", "on"), [("gpu", 64, True), ("cuda", 4096, True), ("mps", 1024, False),
                                                            ("cpu", 64, False)])
def test_compile_auto_is_on_for_gpu_training(accelerator, d_model, on):
    from looplab.training.run_utils import resolve_compile

    got, why = resolve_compile("auto", d_model, accelerator)
    assert got == on and why.startswith("compile=auto"), why


def test_compile_auto_on_the_gpu_lightning_picks(monkeypatch):
    from looplab.training import run_utils

    monkeypatch.setattr(run_utils, "auto_accelerator", lambda: "cuda")
    on, why = run_utils.resolve_compile("auto", 64, "auto")
    assert on and "accelerator=auto (cuda on this machine)" in why
