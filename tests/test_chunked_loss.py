"""The training loss's head and cross-entropy in chunks (models/loss.py, `LoopedLM.forward(targets=...)`): the same
losses and gradients as the plain computation, without the fp32 copy of the whole (B, T, V) logits at the peak,
and with no host sync in the LightningModule's loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplab.models import ExitPolicy, LoopedLM, LoopedLMConfig
from looplab.models.loss import IGNORE, chunk_tokens, chunked_token_losses


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def _targets(B, T, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (B, T), generator=g)
    t[:, ::3] = IGNORE  # unsupervised positions, as the tasks have
    return t


@pytest.mark.parametrize("chunk", [None, 1, 7, 16, 1000])
def test_chunked_losses_and_gradients_equal_the_plain_ones(chunk):
    torch.manual_seed(0)
    B, T, d, V = 2, 8, 12, 40
    head = torch.nn.Linear(d, V, bias=False)
    hidden = torch.randn(B, T, d, requires_grad=True)
    targets = _targets(B, T, V)
    ref = F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    g_ref = torch.autograd.grad((ref * torch.arange(B * T)).sum(), [hidden, head.weight])
    got = chunked_token_losses(head, hidden, targets, chunk)
    assert got.shape == (B, T) and got.dtype == torch.float32
    torch.testing.assert_close(got.flatten(), ref, rtol=1e-6, atol=1e-6)
    assert torch.all(got[targets == IGNORE] == 0)
    g = torch.autograd.grad((got.flatten() * torch.arange(B * T)).sum(), [hidden, head.weight])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunk_size_rule():
    assert chunk_tokens(32 * 256, 4096) == 32 * 256  # every tiny CPU run: one piece, the plain computation
    assert chunk_tokens(2 * 2048, 50_304) < 2 * 2048  # the paper presets' micro-batch: chunked
    assert chunk_tokens(10, 10, chunk=3) == 3
    with pytest.raises(ValueError, match="loss_chunk_tokens=0"):
        chunk_tokens(10, 10, chunk=0)


@pytest.mark.parametrize("kind", ["plain", "all_loops", "parallel", "exit_aware"])
def test_model_token_loss_equals_the_loss_of_its_logits(kind):
    """forward(targets=) gives the per-token cross-entropy of forward()'s logits (every path that trains), and the
    same gradients."""
    kw = dict(vocab_size=50, d_model=16, n_heads=2, n_layers=1, n_loops=3)
    if kind == "parallel":
        kw.update(loop_schedule="parallel", loop_kv="share_first")
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(**kw))
    model.loss_chunk_tokens = 5  # several chunks
    ids = torch.randint(0, 50, (2, 9))
    targets = _targets(2, 9, 50)
    call = {"plain": {}, "parallel": {}, "all_loops": {"return_all_loops": True},
            "exit_aware": {"exits": ExitPolicy(skip="kv_copy", steps=torch.randint(1, 4, (2, 9)))}}[kind]

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, -2), targets.expand(*logits.shape[:-1]).flatten(), ignore_index=IGNORE,
                               reduction="none").view(logits.shape[:-1])

    out = model(ids, **call)
    ref = ce(out.loop_logits) if kind == "all_loops" else ce(out.logits)
    g_ref = torch.autograd.grad(ref.sum(), list(model.parameters()), allow_unused=True)
    got = model(ids, targets=targets, **call)
    assert got.logits is None and got.loop_logits is None
    loss = got.loop_token_loss if kind == "all_loops" else got.token_loss
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    g = torch.autograd.grad(loss.sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(g, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _step_peak(chunk: int | None) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Peak bytes allocated by one training step (forward with targets, backward) of a d 16 model with V = 32k,
    T = 512 (tests/peak_bytes.py: tensor bytes, no wall time), with its loss and gradients."""
    from peak_bytes import PeakBytes

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=32_768, d_model=16, n_heads=2, n_layers=1, n_loops=2, max_seq_len=512))
    model.loss_chunk_tokens = chunk
    ids = torch.randint(0, 32_768, (1, 512))
    targets = torch.randint(0, 32_768, (1, 512))
    with PeakBytes(exclude=model.parameters()) as pb:
        loss = model(ids, targets=targets).token_loss.mean()
        loss.backward()
    return pb.peak, loss.detach(), [p.grad for p in model.parameters()]


def test_peak_memory_no_longer_holds_the_fp32_logits():
    fp32_logits = 512 * 32_768 * 4  # 64 MiB, the model's parameters and their gradients are 4 MiB each
    plain, loss, grads = _step_peak(None)  # 512 × 32k: under the size rule's threshold, one piece (the plain path)
    chunked, loss_c, grads_c = _step_peak(64)
    assert plain > 2 * fp32_logits  # the logits, their fp32 copy and log-softmax's output live at once
    assert chunked < fp32_logits / 2  # one 64-token chunk at a time
    torch.testing.assert_close(loss_c, loss)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("stage", [None, "stage1", "stage2", "exit_aware"])
def test_module_losses_keep_their_values_without_host_syncs(stage):
    """LoopedLMModule.training_step: the same loss as the logits-based formula (mean over supervised tokens), and
    no boolean-mask indexing (nonzero / masked_select: a host sync on a GPU) anywhere in the step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from looplab.models.exit_gate import stage1_loss, stage2_loss
    from looplab.training.module import LoopedLMModule, per_token_loss

    cfg = dict(vocab_size=30, d_model=16, n_heads=2, n_layers=1, n_loops=3,
               exit_gate="ouro" if stage in ("stage1", "stage2") else "none")
    objective = {"exit_stage": stage if stage != "exit_aware" else None, "beta": 0.1, "final_loop_weight": 0.5,
                 "k": 50.0, "gamma": 0.005}
    if stage == "exit_aware":
        objective.update(skip_train_prob=0.5, skip_handling="kv_copy")
    torch.manual_seed(0)
    module = LoopedLMModule(cfg, {"lr": 1e-3}, objective)
    module.train()
    ids = torch.randint(0, 30, (3, 7))
    targets = _targets(3, 7, 30, seed=1)
    batch = {"input_ids": ids, "targets": targets}

    class HostSyncs(TorchDispatchMode):
        """The ops of a step that read a device value on the host: a boolean-mask index, nonzero, an item()."""

        def __init__(self):
            super().__init__()
            self.syncs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("nonzero", "masked_select", "_local_scalar_dense") or (
                    name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])):
                self.syncs.append(name)
            return func(*args, **(kwargs or {}))

    with HostSyncs() as mode:
        loss = module.training_step(batch, 0)
    # the exit reference decides per loop on the host whether any token has left (exit_compute.FrozenInputs.set_loop)
    allowed = {"_local_scalar_dense"} if stage == "exit_aware" else set()
    assert not set(mode.syncs) - allowed, mode.syncs

    mask = targets != IGNORE
    if stage is None:
        ref = per_token_loss(module.model(ids).logits, targets).mean()
    elif stage == "exit_aware":
        steps = module.sample_exit_steps(ids)
        out = module.model(ids, exits=ExitPolicy(skip="kv_copy", steps=steps))
        ref = per_token_loss(out.logits, targets).mean()
    else:
        out = module.model(ids, return_all_loops=True)
        losses = torch.stack([per_token_loss(lg, targets) for lg in out.loop_logits])
        ref = (stage1_loss(losses, out.exit_probs[mask], 0.1, 0.5) if stage == "stage1"
               else stage2_loss(losses, out.exit_gate_logits[mask], 50.0, 0.005))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
