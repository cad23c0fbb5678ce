"""Per-loop diagnostics of a looped model (LoopCoder-v2's; docs/evaluation.md#per-loop-diagnostics).

For a model run at R loops on a batch, per loop r = 1..R, over the batch's real tokens (left padding excluded):

    step_r            = mean ‖h^(r) − h^(r−1)‖                         (r ≥ 2)
    step_rel_r        = mean ‖h^(r) − h^(r−1)‖ / mean ‖h^(r−1)‖         (r ≥ 2)
    update_cos_r      = mean cos(h^(r) − h^(r−1), h^(r−1) − h^(r−2))    (r ≥ 3)
    effective_rank_r  = exp(H(σ / Σσ)), σ the singular values of the centred (tokens × d) matrix of h^(r)
    fixed_point_gap_r = mean ‖f(h^(r)) − h^(r)‖, f = one more loop (= h^(r+1); loop R+1 is run for r = R)
    fixed_point_gap_rel_r = mean ‖f(h^(r)) − h^(r)‖ / mean ‖h^(r)‖
    logit_lens_kl_r   = mean KL(p^(r) ‖ p^(r−1)), p^(r) = softmax(Head(FinalNorm(Coda(h^(r)))))   (r ≥ 2)
    exit_lambda_r     = mean λ_r, the exit gate after loop r            (gated models only)
    loop_gate_r       = mean g over heads and block layers, G-SWA's weight of loop 1's (global) branch at loop r
                        (r ≥ 2; parallel models with loop_kv=gswa only; 1 − g weighs the loop's own window)
    offset_cost_r     = Ω^(r) = mean_i ‖h_i^(r−1) − h_{i−1}^(r−1)‖ over positions i whose i−1 is real  (r ≥ 2)
    offset_cost_rel_r = Ω^(r) / mean_i ‖h_i^(r−1)‖ over the same positions

h^(r) is loop r's readout (`LoopedLM.readout`: what the head reads before the coda and the final norm,
h_r + W_o s_r under StateLoop), h^(0) the first loop's input e. "mean" is over real tokens; a relative form
is a ratio of means (sums over tokens of numerator and denominator), so batches combine by token weight.

`loop_states` is the one place that produces the per-loop states; the measures read only its `LoopStates`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F

__all__ = ["MEASURES", "POSITION", "LoopStates", "diagnose", "effective_rank", "loop_diagnostics", "loop_states",
           "plot_diagnostics"]

# every measure's name, in the order of the plot's panels (exit_lambda only where the model has an exit gate)
MEASURES = ("step", "step_rel", "update_cos", "effective_rank", "fixed_point_gap", "fixed_point_gap_rel",
            "logit_lens_kl", "exit_lambda", "loop_gate", "offset_cost", "offset_cost_rel")
POSITION = ("entry r−1 of each list is loop r = 1..R (h^(r) = loop r's readout, h^(0) = the first loop's input e); "
            "None where a measure is undefined: step, step_rel, logit_lens_kl, loop_gate, offset_cost, offset_cost_rel at "
            "r = 1, update_cos at r ≤ 2, fixed_point_gap(_rel) at r = R of a depth-routed model (its router has no loop "
            "R+1). Under a parallel loop schedule every measure is taken at the same position i.")


@dataclass
class LoopStates:
    """A call's per-loop states: readouts[r−1] = h^(r) (B, T, d) for r = 1..n_loops, e = h^(0) (B, T, d), the
    call's RoPE positions (B|1, T) and validity (B, T) (None = every token real)."""

    readouts: list[torch.Tensor]
    e: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    gates: list[torch.Tensor | None] | None = None  # G-SWA: gates[r−1] = loop r's mean g (B, T), None at r = 1

    @property
    def n_loops(self) -> int:
        return len(self.readouts)

    def h(self, r: int) -> torch.Tensor:
        """h^(r): e for r = 0, loop r's readout for r ≥ 1."""
        return self.e if r == 0 else self.readouts[r - 1]

    @property
    def mask(self) -> torch.Tensor:
        """(B, T) bool, True at real tokens."""
        if self.valid is not None:
            return self.valid.to(torch.bool)
        return torch.ones(self.e.shape[:2], dtype=torch.bool, device=self.e.device)


@contextlib.contextmanager
def _gathered(model):
    """An FSDP2-sharded model's root parameters (embedding, final norm, head, gate, state branch) are gathered by
    the root's forward only; the diagnostics call its parts, so gather them here (the layers gather themselves)
    and free everything afterwards. A plain model: nothing to do."""
    fsdp = None
    if torch.distributed.is_available():
        try:
            from torch.distributed.fsdp import FSDPModule as fsdp
        except ImportError:  # an older torch: no FSDP2
            fsdp = None
    if fsdp is None or not isinstance(model, fsdp):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        for m in model.modules():
            if isinstance(m, fsdp):
                m.reshard()


@contextlib.contextmanager
def _evaluating(model):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _gate_values(model, n_loops: int):
    """G-SWA's gates during a cache-free parallel forward → a list, filled on exit: entry r−1 = loop r's g (B, T)
    averaged over heads and block layers (None at loop 1, which attends without a gate); [] without gates. The
    forward runs loop by loop, each block layer once per loop ≥ 2, so the k-th gate call is loop 2 + k // N."""
    from looplab.models.parallel import LoopGate

    gates = [m for layer in model.block for m in layer.modules() if isinstance(m, LoopGate)]
    calls: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda mod, args, out: calls.append(out.detach().float().mean(dim=(1, 3))))
             for g in gates]
    out: list[torch.Tensor | None] = []
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()
    if gates:
        per = len(gates)
        out += [None] + [torch.stack(calls[k * per:(k + 1) * per]).mean(0) for k in range(n_loops - 1)]


def _loop_states(model, input_ids, attention_mask, n_loops) -> LoopStates:
    router = getattr(model, "router", None)
    if router is not None:
        router.check_call(n_loops, None)  # a routed model runs its R loops only
    R = model.loops(n_loops)
    if getattr(model.config, "loop_schedule", "sequential") == "parallel":
        from looplab.models.parallel import parallel_states  # the CLP forward's loops, every token at every loop

        with _gate_values(model, R) as gates:
            readouts, e, positions, valid = parallel_states(model, input_ids, attention_mask, R)
        return LoopStates(readouts=readouts, e=e, positions=positions, valid=valid, gates=gates or None)
    positions, valid = model.positions(input_ids, attention_mask)
    stream = model.start(input_ids, positions, valid)
    route = router.begin(model, stream.x) if router is not None else None  # the forward's routing (depths=None)
    readouts: list[torch.Tensor] = []
    model.run_loops(stream, range(R), step=route.loop_step if route is not None else None,
                    after=lambda r, st, rows: readouts.append(model.readout(st)))
    return LoopStates(readouts=readouts, e=stream.e, positions=positions, valid=valid)


def loop_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                n_loops: int | None = None) -> LoopStates:
    """Run `model` for n_loops loops (default its R; any R′ ≥ 1, a depth-routed model its R only) on input_ids
    (B, T), attention_mask (B, T) 1 = real, 0 = left padding, and keep every loop's readout. No gradients, eval
    mode (restored after).

    The single place that produces per-loop states: everything in this module reads them from here, so a new
    loop schedule only has to be handled here (branch on `model.config`). Under a parallel loop schedule, loop r
    at position i sits on a chain; `readouts[r−1][:, i]` is then loop r's state at position i, and every measure
    compares states taken at the same position i (Ω compares position i with i − 1 of the same loop)."""
    with _gathered(model), _evaluating(model):
        return _loop_states(model, input_ids, attention_mask, n_loops)


def effective_rank(x: torch.Tensor) -> float:
    """Roy & Vetterli's effective rank of the rows of x (N, d), centred over the rows: exp(H(p)) with
    p = σ / Σσ the normalised singular values. A rank-k matrix with k equal singular values gives k; an
    all-constant (or single-row) matrix gives 0.

    Singular values at rounding level are dropped (the effective rank is scale-free, so rounding noise alone
    would count as full rank): those below max(N, d)·eps of x's dtype times max |x| (the rounding of the data
    before centring) and eigenvalues of the Gram matrix below max(N, d)·eps·λ_max (its own rounding)."""
    with torch.autocast(x.device.type, enabled=False):
        if x.shape[0] < 2:
            return 0.0
        eps_in = torch.finfo(x.dtype if x.dtype.is_floating_point else torch.float32).eps
        x = x.double()
        n = max(x.shape)
        floor = float(x.abs().max()) * n * eps_in
        x = x - x.mean(0, keepdim=True)
        # σ² are the eigenvalues of the smaller Gram matrix (d × d or N × N): cheaper than an SVD of a tall matrix
        gram = x.T @ x if x.shape[0] >= x.shape[1] else x @ x.T
        lam = torch.linalg.eigvalsh(gram)
        keep = (lam > lam.max() * n * torch.finfo(lam.dtype).eps) & (lam > floor ** 2)
        s = torch.where(keep, lam, torch.zeros_like(lam)).sqrt()
        total = s.sum()
        if float(total) <= 0:
            return 0.0
        p = s / total
        p = p[p > 0]
        return float(torch.exp(-(p * p.log()).sum()))


def _sums(model, st: LoopStates, R: int) -> dict[str, list[tuple[float, float] | None]]:
    """Per measure and loop r = 1..R: (numerator sum, denominator) over this batch's real tokens, or None."""
    m = st.mask
    n = float(m.sum())
    with torch.autocast(st.e.device.type, enabled=False):
        H = [st.h(r).float() for r in range(st.n_loops + 1)]  # h^(0..n_loops)
        norms = [h.norm(dim=-1) for h in H]
        pair = m[:, 1:] & m[:, :-1]  # position i real and its predecessor i − 1 real
        n_pair = float(pair.sum())

        def tot(x, where=m):
            return float(x[where].double().sum())

        out: dict[str, list[Any]] = {k: [None] * R for k in MEASURES}
        for r in range(1, R + 1):
            i = r - 1
            if r >= 2:
                step = (H[r] - H[r - 1]).norm(dim=-1)
                out["step"][i] = (tot(step), n)
                out["step_rel"][i] = (tot(step), tot(norms[r - 1]))
                hp = H[r - 1]
                off = (hp[:, 1:] - hp[:, :-1]).norm(dim=-1)
                out["offset_cost"][i] = (tot(off, pair), n_pair)
                out["offset_cost_rel"][i] = (tot(off, pair), tot(norms[r - 1][:, 1:], pair))
            if r >= 3:
                cos = F.cosine_similarity(H[r] - H[r - 1], H[r - 1] - H[r - 2], dim=-1)
                out["update_cos"][i] = (tot(cos), n)
            out["effective_rank"][i] = (effective_rank(H[r][m]) * n, n)
            if r + 1 < len(H):
                gap = (H[r + 1] - H[r]).norm(dim=-1)
                out["fixed_point_gap"][i] = (tot(gap), n)
                out["fixed_point_gap_rel"][i] = (tot(gap), tot(norms[r]))
    # the logit lens and the gate: the model's own readout path, Head(FinalNorm(Coda(h^(r))))
    gated = getattr(model, "exit_gate", None) is not None
    prev = None
    for r in range(1, R + 1):
        normed = model.final_norm(model.coda_at(st.readouts[r - 1], r - 1, st.positions, st.valid))[m]  # (N, d)
        if prev is not None:
            out["logit_lens_kl"][r - 1] = (_kl_sum(model.head, normed, prev), n)
        prev = normed
        if gated:
            lam = model.exit_gate(normed).float()
            out["exit_lambda"][r - 1] = (float(lam.double().sum()), n)
    if not gated:
        del out["exit_lambda"]
    if st.gates:
        for r in range(2, R + 1):
            out["loop_gate"][r - 1] = (tot(st.gates[r - 1]), n)
    else:
        del out["loop_gate"]
    return out


def _kl_sum(head, normed: torch.Tensor, prev: torch.Tensor, max_elements: int = 1 << 24) -> float:
    """Σ over tokens of KL(softmax(head(normed)) ‖ softmax(head(prev))), (N, d) each, in chunks of tokens so that
    no more than a few (chunk, V) float32 tensors exist at once (N × V logits can be gigabytes)."""
    V = head.weight.shape[0]
    chunk = max(1, max_elements // V)
    total = 0.0
    for i in range(0, normed.shape[0], chunk):
        logp = F.log_softmax(head(normed[i:i + chunk]).float(), dim=-1)
        logq = F.log_softmax(head(prev[i:i + chunk]).float(), dim=-1)
        total += float((logp.exp() * (logp - logq)).sum().double())
    return total


def _finish(sums: dict[str, list], R: int) -> dict[str, Any]:
    result: dict[str, Any] = {k: [None if v is None or v[1] <= 0 else v[0] / v[1] for v in series]
                              for k, series in sums.items()}
    result["n_loops"] = R
    result["position"] = POSITION
    return result


def _batch_sums(model, input_ids, attention_mask, n_loops):
    R = model.loops(n_loops)
    extra = getattr(model, "router", None) is None  # loop R+1 for the fixed-point gap at r = R
    with _gathered(model), _evaluating(model):
        st = _loop_states(model, input_ids, attention_mask, R + 1 if extra else n_loops)
        return _sums(model, st, R), R, int(st.mask.sum())


def loop_diagnostics(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     n_loops: int | None = None) -> dict[str, Any]:
    """The per-loop diagnostics (module docstring) of one batch at n_loops loops (default the model's R):
    {measure: [value at loop 1, ..., loop R] (None where undefined)} for the measures of `MEASURES`
    (`exit_lambda` only with an exit gate), plus `n_loops` (R) and `position` (the indexing convention)."""
    sums, R, _ = _batch_sums(model, input_ids, attention_mask, n_loops)
    return _finish(sums, R)


def diagnose(model, batches: Iterable, max_batches: int | None = None, *, device=None,
             n_loops: int | None = None) -> dict[str, Any]:
    """`loop_diagnostics` over a dataloader's batches (dicts with `input_ids` and optionally `attention_mask`,
    or id tensors), the first max_batches of them: token-weighted over the batches (a mean's sums are added
    across batches; a batch's effective rank weighs by its real tokens). Adds `batches` and `tokens`."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    total: dict[str, list] | None = None
    R = model.loops(n_loops)
    count = tokens = 0
    for batch in batches:
        if max_batches is not None and count >= max_batches:
            break
        ids, mask = (batch["input_ids"], batch.get("attention_mask")) if isinstance(batch, dict) else (batch, None)
        sums, R, n = _batch_sums(model, ids.to(device), None if mask is None else mask.to(device), n_loops)
        if total is None:
            total = {k: [None if v is None else list(v) for v in series] for k, series in sums.items()}
        else:
            for k, series in sums.items():
                for i, v in enumerate(series):
                    if v is not None:
                        acc = total[k][i]
                        total[k][i] = list(v) if acc is None else [acc[0] + v[0], acc[1] + v[1]]
        count += 1
        tokens += n
    if total is None:
        raise ValueError("no batches to diagnose (an empty dataloader, or max_batches=0)")
    result = _finish(total, R)
    result["batches"], result["tokens"] = count, tokens
    return result


def plot_diagnostics(diag: dict[str, Any], path) -> None:
    """One small panel per measure against loop r (PNG at path; matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in MEASURES if k in diag and any(v is not None for v in diag[k])]
    cols = 4
    rows = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        pts = [(r, v) for r, v in enumerate(diag[name], start=1) if v is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("loop r", fontsize=8)
        ax.set_xticks(range(1, len(diag[name]) + 1))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
