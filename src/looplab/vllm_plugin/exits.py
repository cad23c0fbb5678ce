"""Exits that skip compute in vLLM: `hf_overrides={"exit_threshold": q, "exit_skip": "kv_copy"}` (docs/vllm.md).

looplab's rule (models/exit_compute.py, `ExitPolicy(threshold=q, skip="kv_copy")`): a token that exits after loop e
does not run loops e+1..R; at each later (loop, layer) slot — block layers, the StateLoop mixer, the coda at each
depth — later tokens still attend to it, and find there the keys and values it had at its exit loop. The block's
weights are shared across loops, so those are what the layer would compute from the token's frozen exit-loop
input: nothing needs recomputing, only copying.

Here, loop r runs on the rows still looping only (gathered): their projections, MLP, state update, coda and exit
gate. Each attention slot is still called for every token of the forward, as vLLM's attention metadata (one per
forward) requires: the rows still looping bring their new keys and values, the exited rows the ones kept from the
last loop they ran (`Rows`), and their queries are zeros (their outputs are not read). So an exited token costs a
copy of its keys and values per later slot, and its share of the attention; no projection or MLP.

Which rows still loop is data: it reaches the host once per loop (a `nonzero`). vLLM compiles the model with
torch.compile and, on CUDA, captures piecewise graphs; both need the loops to be one opaque op: the custom op
`vllm::looplab_exit_loops` runs them eagerly, and the plugin lists it among the ops the compiled graph is split at
(`vllm_plugin.graphs`), so no graph records one forward's rows. Inside it, each layer's arithmetic on the rows
(before and after its attention slot) is compiled on its own, dynamic in the number of rows, unless vLLM runs
eagerly (`DecoderLayer.forward_rows`; docs/vllm.md#speed).
"""

from __future__ import annotations

from collections import Counter

import torch
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

# rows that ran a block layer and rows that would have without skipping, over the process's forwards (what a test
# reads to see compute skipped; the engine runs in the test's process)
ROWS = Counter()


class Rows:
    """The rows still looping in one forward of T tokens, and each attention call's kept keys and values.

    idx: the rows (LongTensor, ascending) or None while every row loops. kept[key] = (k, v), (T, kv width) each:
    per row, the keys and values of the last loop in which the row ran that call (its exit loop, once it exits)."""

    def __init__(self, T: int):
        self.T, self.idx = T, None
        self.kept: dict = {}

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.idx is None else y.index_select(0, self.idx)

    def full(self, key, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Rows' q, k, v → every token's (T rows): an exited row's keys and values are the kept ones (kv_copy), its
        query zeros. The result's k, v are kept for the next loop."""
        if self.idx is None:
            k, v = k.clone(), v.clone()  # kept past this call (vLLM's rotary embedding may work in place)
            self.kept[key] = (k, v)
            return q, k, v
        kk, vv = self.kept[key]
        kk.index_copy_(0, self.idx, k)
        vv.index_copy_(0, self.idx, v)
        qq = q.new_zeros(self.T, q.shape[1])
        qq.index_copy_(0, self.idx, q)
        return qq, kk, vv


class ExitLoops:
    """The R loops with exits that skip compute, run eagerly by the custom op (see the module docstring). Holds the
    model (not a submodule of it: it is found by name in vLLM's forward context, as vLLM's attention layers are)."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (T, d): the prelude's output → (T, d): FinalNorm(Coda(readout)) at each token's exit depth."""
        m = self.model
        cfg, at, slots = m.cfg, m.layout, m.slots
        N, R, q = cfg.n_layers, cfg.n_loops, float(m.exit_threshold)
        T = x.shape[0]
        rows = Rows(T)
        e, pos = x, positions  # the rows still looping: their injection input and positions
        s = m.state.initial_state(x) if m.state is not None else None
        survival = x.new_ones(T)  # the gate's S_{r−1}, CDF and exit choice, as LoopedLMModel._exit_step
        cdf = x.new_zeros(T)
        chosen = torch.empty_like(x)
        for r in range(R):
            n = T if rows.idx is None else rows.idx.numel()
            ROWS["run"] += n * N
            ROWS["full"] += T * N
            if m.inject is not None and r > 0:
                x = m.inject(x, e)
            h = x
            for l, layer in enumerate(m.block):
                h = layer.forward_rows(h, pos, slots[at["block"] + r * N + l], rows, ("block", l))
            if m.state is not None:
                mixer_slot = slots[at["state"] + r] if m.state.mixer is not None else None
                s, x = m.state(h, s, pos, mixer_slot, rows)
                readout = x if cfg.state_in_output else h
            else:
                x = readout = h
            hidden = m.head_input_rows(readout, pos, r, rows)
            if r < R - 1:
                lam = torch.sigmoid(m.exit_gate.proj(hidden)[0].squeeze(-1))
                surv = rows.gather(survival)
                p = lam * surv
                survival = _put(survival, rows.idx, surv * (1 - lam))
            else:
                p = rows.gather(survival)
            c = rows.gather(cdf) + p
            cdf = _put(cdf, rows.idx, c)
            now = (c >= q) if r < R - 1 else torch.ones_like(c, dtype=torch.bool)
            here = torch.arange(T, device=x.device) if rows.idx is None else rows.idx
            chosen.index_copy_(0, here[now], hidden[now])
            stay = ~now
            rows.idx = here[stay]
            x, e, pos = x[stay], e[stay], pos[stay]
            if s is not None:
                s = s[stay]
        return chosen


def _put(full: torch.Tensor, idx, rows: torch.Tensor) -> torch.Tensor:
    if idx is None:
        return rows
    return full.index_copy(0, idx, rows)


def looplab_exit_loops(x: torch.Tensor, positions: torch.Tensor, layer_name: str) -> torch.Tensor:
    return get_forward_context().no_compile_layers[layer_name](x, positions)


def _exit_loops_fake(x: torch.Tensor, positions: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(x)


direct_register_custom_op(op_name="looplab_exit_loops", op_func=looplab_exit_loops, fake_impl=_exit_loops_fake)
