"""Mamba2Mixer on mamba_ssm's fused kernels against the same weights on the torch path.

On a GPU (marked `gpu`; skipped, saying why, without CUDA and mamba_ssm): forward, backward (input and
parameter gradients), and prefill through the fused scan then step decoding through the decoding kernels
(mamba_ssm's selective_state_update, causal_conv1d's causal_conv1d_update), in fp32 and in bf16 autocast,
for three shapes: one hands causal-conv1d the channel-last view of its input, one needs a copy, one has a
width causal-conv1d lacks (d_conv 5, kernel=auto: torch conv, fused scan); the decoding kernels' step
against the torch step from one cache; and the fused mixer under torch.compile. Which conv and which SSM
step ran are counted as they run (`mamba2.CONV_CALLS`, `mamba2.STEP_CALLS`): the torch path where a kernel
was due fails the case even when the numbers agree. Each test records its figures (`record_property`),
which `make gpu-check` keeps in gpu-check.json (docs/gpu.md#gpu-check).

On the CPU the same harness runs the torch path against itself and against stand-ins for the kernels: those
tests check the harness (its comparisons, its conv check) and the dispatch's plumbing (which function is
called, with which arguments, on which buffers), not the kernels. kernel=auto's fallback warning is tested
through its decision function, with CUDA's absence and mamba_ssm's presence given to it, no kernel involved.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from looplab.gpu_check import conv_verdict, cuda_problems
from looplab.models.config import CAUSAL_CONV1D_WIDTHS
from looplab.models.mamba2 import CONV_CALLS, STEP_CALLS, FusedOps, Mamba2Mixer, _conv_channel_last_ok

pytestmark = pytest.mark.usefixtures("one_thread_module")  # the CPU tests use tiny mixers (conftest)


def _missing_for_fused_kernels() -> list[str]:
    missing = cuda_problems()
    if not missing and importlib.util.find_spec("mamba_ssm") is None:
        missing = ["mamba_ssm is not installed (make gpu-install)"]
    return missing


MISSING = _missing_for_fused_kernels()
needs_fused_kernels = pytest.mark.skipif(bool(MISSING), reason="needs CUDA and mamba_ssm: " + "; ".join(MISSING))

# max |a - b| / max |ref| per tensor. bf16 cases are also allowed 2x the torch path's own bf16-vs-fp32
# error (the noise floor bf16 itself adds), whichever is larger.
TOLERANCES = {
    "fp32": {"forward": 5e-3, "grad": 2e-2, "decode": 5e-3},  # Triton's fp32 dots may run in tf32
    "bf16": {"forward": 2e-2, "grad": 5e-2, "decode": 2e-2},
    "compile": {"forward": 1e-2, "grad": 3e-2},  # compiled vs eager, both fused, bf16 autocast
}

# name → (Mamba2Mixer kwargs, kernel); test_parity_shapes_exercise_each_conv_layout pins the layout of each.
# The fused scan runs at mamba_ssm's chunk of 256 (the default fused_chunk_size) except in d96-g2 (48), the torch
# scan at chunk_size: the two paths chunk differently, which must not change what they compute.
PARITY_SHAPES = {
    "d256": (dict(d_model=256, d_state=64, headdim=64, ngroups=1, d_conv=4, chunk_size=64), "mamba_ssm"),
    "d96-g2": (dict(d_model=96, d_state=32, headdim=32, ngroups=2, d_conv=4, chunk_size=32, fused_chunk_size=48),
               "mamba_ssm"),
    "d256-conv5": (dict(d_model=256, d_state=64, headdim=64, ngroups=1, d_conv=5, chunk_size=64), "auto"),
}
BATCH, LENGTH, PREFILL = 2, 300, 250  # not multiples of any chunk size above; 300 spans two fused chunks of 256
GRAD_PARAMS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "D", "norm.weight",
               "out_proj.weight")


# ----------------------------------------------------------------------------- the harness
def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _diff(a, b) -> dict[str, float]:
    return {"max_abs": (a.float() - b.float()).abs().max().item(), "max_rel": _rel(a, b)}


def conv_layout(mixer, x) -> str:
    """Which input causal-conv1d gets for this mixer (mirrors Mamba2Mixer._conv)."""
    if mixer.d_conv not in CAUSAL_CONV1D_WIDTHS:
        return f"torch conv (d_conv={mixer.d_conv})"
    with torch.no_grad():
        proj = mixer.in_proj(x[:, :4])
    xBC = proj[..., mixer.d_inner : mixer.d_inner + mixer.conv_dim]
    if _conv_channel_last_ok(xBC.transpose(1, 2)):
        return "channel-last view (no copy)"
    if _conv_channel_last_ok(xBC.contiguous().transpose(1, 2)):
        return "channel-last copy"
    return "channel-first copy"


def conv_ran(mixer, x, calls: dict) -> dict[str, Any]:
    """The conv the mixer's forward ran (calls: CONV_CALLS over that forward) against the one it should run."""
    expected = "causal_conv1d" if mixer.kernel != "torch" and mixer.d_conv in CAUSAL_CONV1D_WIDTHS else "torch"
    ops = mixer._fused_ops(x)
    error = ops.causal_conv1d_error if isinstance(ops, FusedOps) else None
    fused, fallback = calls.get("causal_conv1d", 0), calls.get("torch", 0)
    ran = " + ".join(k for k, n in (("causal_conv1d", fused), ("torch", fallback)) if n) or "none counted"
    out: dict[str, Any] = {"ran": ran, "expected": expected, "calls": calls}
    if fused:
        out["layout"] = conv_layout(mixer, x)
    if error:
        out["causal_conv1d_error"] = error
    why = conv_verdict(expected, calls, f"causal_conv1d: {error}" if error else None)
    if why:
        out["why"] = why
    return out


def mixer_pair(kw: dict, kernel: str, device: str):
    """The torch mixer and one on `kernel` with its weights (non-trivial conv bias and norm weight)."""
    torch.manual_seed(0)
    ref = Mamba2Mixer(kernel="torch", **kw).to(device)
    with torch.no_grad():
        ref.conv1d.bias.normal_()
        ref.norm.weight.uniform_(0.5, 1.5)
    fused = Mamba2Mixer(kernel=kernel, **kw).to(device)
    fused.load_state_dict(ref.state_dict())  # one state-dict layout for both paths
    return ref, fused


def _autocast(x, bf16: bool):
    return torch.autocast(x.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def fwd_bwd(mixer, x, g, bf16: bool, call=None):
    """Forward (through `call`, e.g. a compiled wrapper, if given) and backward: output and gradients."""
    xi = x.clone().requires_grad_()
    with _autocast(x, bf16):
        y = (mixer if call is None else call)(xi)
    y.float().backward(g)
    grads = {"x": xi.grad.detach().clone()}
    grads.update({n: mixer.get_parameter(n).grad.detach().float().clone() for n in GRAD_PARAMS})
    mixer.zero_grad(set_to_none=True)
    return y.detach().float(), grads


def prefill_then_steps(mixer, x, bf16: bool, prefill: int):
    """Prefill `prefill` tokens into a cache (the chunked scan), then decode the rest one token at a time."""
    with torch.no_grad(), _autocast(x, bf16):
        cache = mixer.allocate_cache(x.shape[0], x.shape[1], x.device, x.dtype)
        parts = [mixer(x[:, :prefill], None, None, cache)]
        parts += [mixer(x[:, t : t + 1], None, None, cache) for t in range(prefill, x.shape[1])]
    return torch.cat(parts, 1).float()


def decode_kernels_ran(mixer, steps: int, step_calls: dict, conv_calls: dict, prefills: int = 1) -> dict[str, Any]:
    """Which SSM step and conv step ran over `prefills` prefills + `steps` one-token calls, against what should
    have: with the fused kernels, selective_state_update every step and causal_conv1d_update at the widths it
    has; a prefill with a cache takes the torch conv ("torch_cached") on every path."""
    fused = mixer.kernel != "torch"
    step = "selective_state_update" if fused else "torch"
    conv = "causal_conv1d_update" if fused and mixer.d_conv in CAUSAL_CONV1D_WIDTHS else "torch_cached"
    want_step = {step: steps}
    want_conv = {"torch_cached": prefills + steps} if conv == "torch_cached" else {"torch_cached": prefills, conv: steps}
    want_conv = {k: v for k, v in want_conv.items() if v}
    out: dict[str, Any] = {"step_calls": step_calls, "conv_calls": conv_calls, "expected_step": want_step,
                           "expected_conv": want_conv}
    why = [f"decode: the SSM step calls were {step_calls}, expected {want_step}"] if step_calls != want_step else []
    if conv_calls != want_conv:
        why.append(f"decode: the conv calls were {conv_calls}, expected {want_conv}")
    if why:
        out["why"] = "; ".join(why)
    return out


def _failures(worst: dict, tol: dict, conv: dict, decode: dict | None = None) -> list[str]:
    bad = [f"{k} {v:.3g} > {tol[k]:.3g}" for k, v in worst.items() if not v <= tol[k]]
    return bad + [c["why"] for c in (conv, decode) if c is not None and "why" in c]


def parity_case(kw: dict, kernel: str, precision: str, device: str = "cuda", length: int = LENGTH,
                prefill: int = PREFILL) -> dict[str, Any]:
    """Mixer on `kernel` vs the torch mixer, same weights: forward, gradients, prefill + step decoding, and
    which conv ran. Returns the figures and `failures` (empty when every one is within its tolerance)."""
    ref, fused = mixer_pair(kw, kernel, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(BATCH, length, kw["d_model"], device=device, generator=gen)
    g = torch.randn(x.shape, device=device, generator=gen)
    bf16 = precision == "bf16"
    tol = dict(TOLERANCES[precision])
    yr, gr = fwd_bwd(ref, x, g, bf16)
    CONV_CALLS.clear()
    yf, gf = fwd_bwd(fused, x, g, bf16)
    conv = conv_ran(fused, x, dict(CONV_CALLS))
    out: dict[str, Any] = {"kernel": kernel, "precision": "bf16 autocast" if bf16 else "fp32", "conv": conv,
                           "forward": _diff(yf, yr), "grad": {n: _diff(gf[n], gr[n]) for n in gr}}
    STEP_CALLS.clear()
    CONV_CALLS.clear()
    dec = prefill_then_steps(fused, x, bf16, prefill)
    out["decode_kernels"] = decode_kernels_ran(fused, length - prefill, dict(STEP_CALLS), dict(CONV_CALLS))
    out["decode"] = {"vs_own_forward": _diff(dec, yf), "vs_torch_forward": _diff(dec, yr)}
    if bf16:  # the noise floor: what bf16 alone does to the torch path
        y32, g32 = fwd_bwd(ref, x, g, False)
        noise = {"forward": _rel(yr, y32), "grad": max(_rel(gr[n], g32[n]) for n in gr)}
        noise["decode"] = noise["forward"]
        out["bf16_noise_floor"] = noise
        tol = {k: max(v, 2 * noise[k]) for k, v in tol.items()}
    out["tolerance"] = tol
    out["worst"] = {"forward": out["forward"]["max_rel"], "grad": max(d["max_rel"] for d in out["grad"].values()),
                    "decode": max(d["max_rel"] for d in out["decode"].values())}
    out["failures"] = _failures(out["worst"], tol, conv, out["decode_kernels"])
    return out


def step_case(kw: dict, kernel: str, precision: str, device: str = "cuda", prefill: int = 100,
              steps: int = 30) -> dict[str, Any]:
    """The decoding kernels' step against the torch step from one cache: both mixers (same weights) start from
    the cache the torch mixer's prefill leaves, then decode `steps` tokens one at a time; their outputs and
    their caches (conv state, SSM state) are compared, and which step and conv ran is counted."""
    ref, fused = mixer_pair(kw, kernel, device)
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(BATCH, prefill + steps, kw["d_model"], device=device, generator=gen)
    bf16 = precision == "bf16"
    with torch.no_grad(), _autocast(x, bf16):
        cache_ref = ref.allocate_cache(BATCH, x.shape[1], x.device, x.dtype)
        ref(x[:, :prefill], None, None, cache_ref)
        cache_fused = fused.allocate_cache(BATCH, x.shape[1], x.device, x.dtype)
        cache_fused.conv_state.copy_(cache_ref.conv_state)
        cache_fused.ssm_state.copy_(cache_ref.ssm_state)
        STEP_CALLS.clear()
        CONV_CALLS.clear()
        yf = torch.cat([fused(x[:, t : t + 1], None, None, cache_fused) for t in range(prefill, x.shape[1])], 1)
        ran = decode_kernels_ran(fused, steps, dict(STEP_CALLS), dict(CONV_CALLS), prefills=0)
        yr = torch.cat([ref(x[:, t : t + 1], None, None, cache_ref) for t in range(prefill, x.shape[1])], 1)
    tol = TOLERANCES[precision]["decode"]
    out: dict[str, Any] = {"kernel": kernel, "precision": "bf16 autocast" if bf16 else "fp32", "steps": steps,
                           "decode_kernels": ran, "y": _diff(yf, yr),
                           "conv_state": _diff(cache_fused.conv_state, cache_ref.conv_state),
                           "ssm_state": _diff(cache_fused.ssm_state, cache_ref.ssm_state), "tolerance": tol}
    out["worst"] = max(out[k]["max_rel"] for k in ("y", "conv_state", "ssm_state"))
    out["failures"] = ([f"step {out['worst']:.3g} > {tol:.3g}"] if not out["worst"] <= tol else []) + (
        [ran["why"]] if "why" in ran else [])
    return out


def compile_case(kw: dict, kernel: str = "mamba_ssm", device: str = "cuda", length: int = LENGTH,
                 backend: str = "inductor") -> dict[str, Any]:
    """The mixer on `kernel` under torch.compile (bf16 autocast) against itself eager, its graph breaks
    counted (expected: the scan's and the conv's, each kept out of the graph by torch.compiler.disable)."""
    import torch._dynamo.utils as dynamo_utils

    _, fused = mixer_pair(kw, kernel, device)
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(BATCH, length, kw["d_model"], device=device, generator=gen)
    g = torch.randn(x.shape, device=device, generator=gen)
    ye, ge = fwd_bwd(fused, x, g, True)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(fused, backend=backend)
    CONV_CALLS.clear()
    fwd_bwd(fused, x, g, True, call=compiled)
    yc, gc = fwd_bwd(fused, x, g, True, call=compiled)  # the second call reuses the graphs
    conv = conv_ran(fused, x, dict(CONV_CALLS))
    breaks = dict(dynamo_utils.counters.get("graph_break", {}))
    tol = TOLERANCES["compile"]
    worst = {"forward": _rel(yc, ye), "grad": max(_rel(gc[n], ge[n]) for n in ge)}
    out = {"precision": "bf16 autocast", "worst": worst, "tolerance": tol, "conv": conv,
           "graph_breaks": sum(breaks.values()), "graph_break_reasons": {str(k)[:300]: v for k, v in breaks.items()},
           "unique_graphs": dict(dynamo_utils.counters.get("stats", {})).get("unique_graphs", 0),
           "failures": _failures(worst, tol, conv)}
    torch._dynamo.reset()
    return out


def _record(record_property, case: dict) -> None:
    for key, value in case.items():
        if key != "failures":
            record_property(key, value)


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@needs_fused_kernels
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(PARITY_SHAPES))
def test_fused_mixer_matches_torch_path(shape, precision, record_property):
    kw, kernel = PARITY_SHAPES[shape]
    case = parity_case(kw, kernel, precision)
    _record(record_property, case)
    assert not case["failures"], "; ".join(case["failures"])


@pytest.mark.gpu
@needs_fused_kernels
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(PARITY_SHAPES))
def test_decoding_kernels_step_matches_torch_step(shape, precision, record_property):
    """selective_state_update (+ causal_conv1d_update where the width allows) against ssd_step and the torch conv,
    from one cache, step by step: outputs and both cache buffers."""
    kw, kernel = PARITY_SHAPES[shape]
    case = step_case(kw, kernel, precision)
    _record(record_property, case)
    assert not case["failures"], "; ".join(case["failures"])


@pytest.mark.gpu
@needs_fused_kernels
def test_fused_mixer_under_compile_matches_eager(record_property):
    case = compile_case(PARITY_SHAPES["d256"][0])
    _record(record_property, case)
    assert not case["failures"], "; ".join(case["failures"])


# ----------------------------------------------------------------------------- the harness on the CPU
SMALL = dict(d_model=32, d_state=16, headdim=8, ngroups=2, d_conv=4, chunk_size=8)


def test_parity_shapes_exercise_each_conv_layout():
    """One shape takes causal-conv1d's channel-last view, one needs the copy, one a width it lacks."""
    layouts = {name: conv_layout(Mamba2Mixer(kernel="torch", **kw), torch.randn(1, 8, kw["d_model"]))
               for name, (kw, _) in PARITY_SHAPES.items()}
    assert layouts == {"d256": "channel-last view (no copy)", "d96-g2": "channel-last copy",
                       "d256-conv5": "torch conv (d_conv=5)"}


def test_parity_harness_on_the_cpu():
    """The torch path against itself, so every difference is 0: forward, gradients, prefill + step decoding,
    the bf16 noise floor, and the compiled case (Dynamo with the eager backend)."""
    case = parity_case(SMALL, "torch", "fp32", device="cpu", length=20, prefill=12)
    assert case["failures"] == [] and case["forward"]["max_abs"] == 0
    assert case["conv"] == {"ran": "torch", "expected": "torch", "calls": {"torch": 1}}
    assert set(case["grad"]) == {"x", *GRAD_PARAMS}
    assert case["decode"]["vs_own_forward"]["max_rel"] <= 1e-4
    assert set(case["worst"]) == {"forward", "grad", "decode"}
    bf16 = parity_case(SMALL, "torch", "bf16", device="cpu", length=20, prefill=12)
    assert bf16["failures"] == [] and bf16["bf16_noise_floor"]["forward"] > 0
    assert all(bf16["tolerance"][k] >= TOLERANCES["bf16"][k] for k in bf16["tolerance"])
    compiled = compile_case(SMALL, "torch", device="cpu", length=20, backend="eager")
    assert compiled["failures"] == [] and compiled["graph_breaks"] == 0


def test_conv_calls_count_the_conv_that_ran():
    """The torch conv is counted per call, with a cache apart; never inside a compiled graph."""
    m = Mamba2Mixer(32, d_state=16, headdim=8, d_conv=4, kernel="torch").eval()
    x = torch.randn(1, 5, 32)
    CONV_CALLS.clear()
    with torch.no_grad():
        m(x)
        cache = m.allocate_cache(1, 5, x.device, x.dtype)
        m(x[:, :3], None, None, cache)
        m(x[:, 3:4], None, None, cache)
        assert dict(CONV_CALLS) == {"torch": 1, "torch_cached": 2}
        torch._dynamo.reset()
        torch.compile(m, backend="eager")(x)
    assert dict(CONV_CALLS) == {"torch": 1, "torch_cached": 2}
    torch._dynamo.reset()


def _cpu_fused_ops(monkeypatch, conv_fn, conv_error=None, step_kernels=True, every_kernel=False):
    """Make a kernel=mamba_ssm mixer on the CPU take the fused branch: the torch SSD behind mamba_ssm's
    scan signature, conv_fn as causal_conv1d_fn (None: it "did not import", and so did causal_conv1d_update,
    from the same package) and, with step_kernels, the decoding stand-ins below. every_kernel: every mixer
    takes them, kernel=torch ones too (a model built by a helper that fixes kernel=torch)."""
    from looplab.models.ops.ssd import ssd_chunked

    def scan(x, dt, A, B, C, chunk_size, D=None, initial_states=None, return_final_states=False):
        SCAN_CHUNKS.append(chunk_size)
        return ssd_chunked(x, dt, A, B, C, chunk_size, D=D, initial_state=initial_states,
                           return_final_state=return_final_states)

    ops = FusedOps(scan, conv_fn, conv_error,
                   _stand_in_selective_state_update if step_kernels else None,
                   _stand_in_causal_conv1d_update if step_kernels and conv_fn is not None else None)
    monkeypatch.setattr(Mamba2Mixer, "_fused_ops",
                        lambda self, x: None if self.kernel == "torch" and not every_kernel else ops)
    SCAN_CHUNKS.clear()
    KERNEL_CALLS.clear()
    return ops


SCAN_CHUNKS: list[int] = []  # the chunk length each call of the stand-in fused scan was given
KERNEL_CALLS: list[dict] = []  # what the decoding stand-ins were called with


def _stand_in_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                                   conv_state_indices=None):
    """causal_conv1d_update's contract (causal_conv1d/causal_conv1d_interface.py; the checks of
    csrc/causal_conv1d.cpp's causal_conv1d_update), written in torch: x (b, dim) one token; conv_state
    (b, dim, state_len ≥ width − 1) in x's dtype, shifted left by one in place with x written last; weight
    (dim, width), width 2..4; bias (dim,) in weight's dtype, contiguous. Returns act(bias + Σ weight · window).
    A stand-in to test looplab's plumbing (what it passes, which buffer it updates), not the CUDA kernel."""
    assert activation in (None, "silu", "swish") and cache_seqlens is None and conv_state_indices is None
    assert x.dim() == 2, "looplab passes one token as (batch, dim)"
    b, dim = x.shape
    width = weight.shape[-1]
    assert conv_state.dtype == x.dtype, "TORCH_CHECK(conv_state.scalar_type() == input_type)"
    assert weight.shape == (dim, width) and 2 <= width <= 4
    assert conv_state.shape[:2] == (b, dim) and conv_state.shape[2] >= width - 1
    if bias is not None:
        assert bias.dtype == weight.dtype and bias.shape == (dim,) and bias.stride(-1) == 1
    KERNEL_CALLS.append({"fn": "causal_conv1d_update", "x": (tuple(x.shape), x.dtype),
                         "conv_state": (tuple(conv_state.shape), conv_state.dtype, conv_state.data_ptr()),
                         "activation": activation})
    window = torch.cat([conv_state[..., conv_state.shape[2] - (width - 1):].float(), x.float()[..., None]], -1)
    conv_state.copy_(torch.cat([conv_state[..., 1:], x[..., None]], -1))
    u = (window * weight.float()).sum(-1) + (bias.float() if bias is not None else 0.0)
    return (F.silu(u) if activation in ("silu", "swish") else u).to(x.dtype)


def _stand_in_selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                     state_batch_indices=None):
    """selective_state_update's contract (mamba_ssm/ops/triton/selective_state_update.py: its docstring and
    asserts), written in torch: state (b, nheads, dim, dstate) updated in place; x, dt (b, nheads, dim); A
    (nheads, dim, dstate); B, C (b, ngroups, dstate); D, dt_bias (nheads, dim); z (b, nheads, dim) or None.
    dt ← softplus(dt + dt_bias) (if dt_softplus), state ← state·exp(dt·A) + dt·B·x, out = state·C + D·x (·SiLU(z)).
    A stand-in to test looplab's plumbing (what it passes, which buffer it updates), not the Triton kernel."""
    batch, nheads, dim, dstate = state.shape
    assert state_batch_indices is None
    assert x.shape == (batch, nheads, dim) and dt.shape == x.shape and A.shape == (nheads, dim, dstate)
    ngroups = B.shape[1]
    assert nheads % ngroups == 0 and B.shape == (batch, ngroups, dstate) and C.shape == B.shape
    assert D is None or D.shape == (nheads, dim)
    assert z is None or z.shape == x.shape
    assert dt_bias is None or dt_bias.shape == (nheads, dim)
    # the wrapper computes this before launching, dereferencing dt_bias: None here would raise there
    tie_hdim = A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias.stride(-1) == 0
    KERNEL_CALLS.append({"fn": "selective_state_update", "state": (tuple(state.shape), state.dtype, state.data_ptr()),
                         "x": (tuple(x.shape), x.dtype), "tie_hdim": tie_hdim, "dt_softplus": dt_softplus,
                         "z": z, "has_D": D is not None})
    d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    d = F.softplus(d) if dt_softplus else d
    Bh = B.float().repeat_interleave(nheads // ngroups, 1)[:, :, None, :]  # (b, h, 1, n)
    Ch = C.float().repeat_interleave(nheads // ngroups, 1)[:, :, None, :]
    new = state.float() * torch.exp(d[..., None] * A.float()) + (d * x.float())[..., None] * Bh
    state.copy_(new)
    out = (new * Ch).sum(-1) + (x.float() * D.float() if D is not None else 0.0)
    return (out if z is None else out * F.silu(z.float())).to(x.dtype)


def _stand_in_causal_conv1d(x, weight, bias, activation):
    """causal_conv1d_fn's contract: x (B, C, T) → SiLU(causal depthwise conv) in x's layout."""
    y = F.silu(F.conv1d(x, weight[:, None], bias, padding=weight.shape[1] - 1, groups=x.shape[1])[..., : x.shape[2]])
    return torch.empty_like(x).copy_(y)


def test_parity_fails_when_the_torch_conv_ran_instead_of_causal_conv1d(monkeypatch):
    """The fused mixer falls back to the torch conv (causal_conv1d did not import): its numbers still match
    the torch path, but the conv check, measured from the calls, fails the case."""
    error = "ImportError: causal_conv1d_cuda.so: undefined symbol: _ZN3c10"
    _cpu_fused_ops(monkeypatch, None, error)
    case = parity_case(SMALL, "mamba_ssm", "fp32", device="cpu", length=20, prefill=12)
    assert case["worst"]["forward"] <= 1e-5  # the numbers are fine: only the conv check can catch this
    assert case["conv"]["ran"] == "torch" and case["conv"]["expected"] == "causal_conv1d"
    assert case["conv"]["calls"] == {"torch": 1} and "layout" not in case["conv"]
    assert case["failures"] == ["conv: the torch conv ran 1x, causal_conv1d ran 0x, expected causal_conv1d "
                                f"(causal_conv1d: {error})",  # and its decoding conv, from the same package
                                "decode: the conv calls were {'torch_cached': 9}, expected "
                                "{'torch_cached': 1, 'causal_conv1d_update': 8}"]
    compiled = compile_case(SMALL, "mamba_ssm", device="cpu", length=20, backend="eager")
    assert compiled["conv"]["ran"] == "none counted"  # compiled, the torch conv is not even counted: still a fail
    assert len(compiled["failures"]) == 1 and "no causal_conv1d call was counted" in compiled["failures"][0]


def test_parity_passes_the_conv_check_when_causal_conv1d_ran(monkeypatch):
    _cpu_fused_ops(monkeypatch, _stand_in_causal_conv1d)
    case = parity_case(SMALL, "mamba_ssm", "fp32", device="cpu", length=20, prefill=12)
    assert case["failures"] == []
    assert case["conv"] == {"ran": "causal_conv1d", "expected": "causal_conv1d", "calls": {"causal_conv1d": 1},
                            "layout": "channel-last view (no copy)"}
    assert case["decode_kernels"]["step_calls"] == {"selective_state_update": 8}
    assert case["decode_kernels"]["conv_calls"] == {"torch_cached": 1, "causal_conv1d_update": 8}
    compiled = compile_case(SMALL, "mamba_ssm", device="cpu", length=20, backend="eager")
    assert compiled["failures"] == [] and compiled["conv"]["calls"] == {"causal_conv1d": 2}  # eager behind disable
    # a d_conv 5 mixer (kernel=auto): causal-conv1d has no such width, the torch conv is the right one
    case = parity_case({**SMALL, "d_conv": 5}, "auto", "fp32", device="cpu", length=20, prefill=12)
    assert case["failures"] == [] and case["conv"] == {"ran": "torch", "expected": "torch", "calls": {"torch": 1}}


# ----------------------------------------------------------------------------- decoding kernels: the dispatch on the CPU
def _cache_rel(a, b) -> float:
    return max(_rel(a.conv_state, b.conv_state), _rel(a.ssm_state, b.ssm_state))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_decoding_dispatch_runs_the_step_kernels_on_the_cache_buffers(monkeypatch, bf16):
    """Plumbing, not kernels: with the decoding kernels "present" (stand-ins that implement their documented
    contract in torch and assert what the real ones check), a one-token call with a cache calls
    selective_state_update and causal_conv1d_update — each once per step, as mamba_ssm's Mamba2.step calls them
    (A, dt, dt_bias, D broadcast over headdim as stride-0 views, dt_softplus=True, z=None: the gated norm stays
    looplab's) — on the cache's own buffers, in place, when the dtypes allow (fp32), and on a copy written back
    when they do not (bf16 autocast: the kernel wants the conv state in x's dtype). Outputs and caches equal the
    torch step's. A prefill with a cache keeps the torch conv and runs the (stand-in) fused scan."""
    _cpu_fused_ops(monkeypatch, _stand_in_causal_conv1d)
    ref, fused = mixer_pair(SMALL, "mamba_ssm", "cpu")  # 2 groups: B/C shared by 2 heads each
    x = torch.randn(BATCH, 14, SMALL["d_model"], generator=torch.Generator().manual_seed(4))
    outs, caches = {}, {}
    for name, m in (("ref", ref), ("fused", fused)):
        STEP_CALLS.clear()
        CONV_CALLS.clear()
        KERNEL_CALLS.clear()
        with torch.no_grad(), _autocast(x, bf16):
            cache = m.allocate_cache(BATCH, 14, x.device, x.dtype)
            ys = [m(x[:, :9], None, None, cache)] + [m(x[:, t : t + 1], None, None, cache) for t in range(9, 14)]
        outs[name], caches[name] = torch.cat(ys, 1).float(), cache
        if name == "ref":
            assert dict(STEP_CALLS) == {"torch": 5} and dict(CONV_CALLS) == {"torch_cached": 6} and not KERNEL_CALLS
    assert dict(STEP_CALLS) == {"selective_state_update": 5}
    assert dict(CONV_CALLS) == {"torch_cached": 1, "causal_conv1d_update": 5}
    calls = {fn: [c for c in KERNEL_CALLS if c["fn"] == fn] for fn in ("selective_state_update", "causal_conv1d_update")}
    assert len(calls["selective_state_update"]) == 5 and len(calls["causal_conv1d_update"]) == 5
    cache = caches["fused"]
    for c in calls["selective_state_update"]:
        assert c["tie_hdim"] and c["dt_softplus"] and c["z"] is None and c["has_D"]
        assert c["state"] == ((BATCH, 8, 8, 16), torch.float32, cache.ssm_state.data_ptr())  # the cache's buffer
        assert c["x"][1] == (torch.bfloat16 if bf16 else torch.float32)
    for c in calls["causal_conv1d_update"]:
        assert c["activation"] == "silu"
        if bf16:  # a bf16 copy of the fp32 buffer, written back
            assert c["conv_state"][1] == torch.bfloat16 and c["conv_state"][2] != cache.conv_state.data_ptr()
        else:
            assert c["conv_state"] == ((BATCH, 128, 3), torch.float32, cache.conv_state.data_ptr())
    tol = 2e-2 if bf16 else 1e-5
    assert _rel(outs["fused"], outs["ref"]) <= tol
    assert _cache_rel(caches["fused"], caches["ref"]) <= tol
    assert SCAN_CHUNKS == [256]  # the prefill ran the fused scan at fused_chunk_size, the torch one at chunk_size


def test_decoding_dispatch_follows_masks_rows_and_widths(monkeypatch):
    """Left padding and exit skipping (dt = 0: the kernel gets raw dt = −inf, whose softplus is 0), a call on
    some rows of the cache (a gathered copy, written back to those rows only), and a conv width causal_conv1d
    lacks (d_conv 5: the torch conv step beside the SSM kernel) — each against the torch step. Plumbing: the
    kernels are the stand-ins above."""
    from looplab.models.cache import LoopCache

    _cpu_fused_ops(monkeypatch, _stand_in_causal_conv1d)
    for kw in (SMALL, {**SMALL, "d_conv": 5}):
        ref, fused = mixer_pair(kw, "mamba_ssm" if kw["d_conv"] == 4 else "auto", "cpu")
        g = torch.Generator().manual_seed(5)
        x = torch.randn(3, 10, kw["d_model"], generator=g)
        valid = torch.ones(3, 11, dtype=torch.bool)
        valid[0, :4] = False  # row 0 left-padded
        skip = torch.tensor([[False], [True], [False]])  # row 1's token exits: neither decays nor writes
        step_valid = valid.clone()
        step_valid[2, -1] = False  # row 2's step token is padding: neither decays nor writes either
        caches = {}
        for name, m in (("ref", ref), ("fused", fused)):
            with torch.no_grad():
                cache = m.allocate_cache(3, 11, x.device, x.dtype)
                m(x, None, valid[:, :10], cache)  # prefill, padding included
                y1 = m(x[:, -1:] * 0.5, None, step_valid, cache, skip)  # a step with a skipped and a padded row
                owner = LoopCache({(0, 0): cache}, 3, 11, x.device)  # rows 0 and 2 only: the cache reads its owner's step
                owner.step = type("Step", (), {"rows": torch.tensor([0, 2])})()
                y2 = m(x[[0, 2], -1:] * -0.3, None, None, cache)
            caches[name] = (y1, y2, cache)
        (r1, r2, rc), (f1, f2, fc) = caches["ref"], caches["fused"]
        assert _rel(f1, r1) <= 1e-5 and _rel(f2, r2) <= 1e-5 and _cache_rel(fc, rc) <= 1e-5
    assert dict(CONV_CALLS)["torch_cached"] >= 2 and STEP_CALLS["selective_state_update"] >= 4


@pytest.mark.parametrize("decoder", ["plain", "skip_ssm_skip", "skip_ssm_propagate"])
def test_decoders_give_the_same_tokens_through_the_decoding_kernels_dispatch(monkeypatch, decoder):
    """Whole decoders (left-padded batch of 4; exits with ssm_skip / ssm_propagate on the hybrid) through the
    dispatch, with the stand-ins for every kernel, against the torch path: the same tokens and logits. Plumbing:
    the cache layout and its row handling are shared by both paths."""
    from looplab.models.generation import generate
    from looplab.testing import decode_matrix as dm

    cfg, options = dm.DECODERS[decoder] if decoder != "plain" else (dict(backbone="mamba2"), {})
    model = dm.make(**cfg)
    ids, mask = dm.padded(dm.prompts())
    with torch.no_grad():
        ref = generate(model, ids, 6, attention_mask=mask, return_logits=True, **options)
        _cpu_fused_ops(monkeypatch, _stand_in_causal_conv1d, every_kernel=True)
        STEP_CALLS.clear()
        out = generate(model, ids, 6, attention_mask=mask, return_logits=True, **options)
    assert STEP_CALLS["selective_state_update"] > 0 and "torch" not in STEP_CALLS
    assert torch.equal(out.sequences, ref.sequences)
    assert _rel(out.logits, ref.logits) <= 1e-4


# ----------------------------------------------------------------------------- chunk lengths, fake tensors
def test_each_scan_gets_its_own_chunk_length(monkeypatch):
    """chunk_size is the torch scan's, fused_chunk_size (default 256, mamba_ssm's) the fused scan's; neither is
    an architecture field, and fused_chunk_size stays out of a default model's dict (and so of old checkpoints')."""
    from looplab.models import LoopedLMConfig
    from looplab.models.config import ConfigError

    base = dict(vocab_size=32, d_model=32, n_heads=2, n_layers=1, n_loops=1, backbone="mamba2", d_state=16, headdim=8)
    default, other = LoopedLMConfig(**base), LoopedLMConfig(**base, chunk_size=16, fused_chunk_size=128)
    assert default.fused_chunk_size == 256 and default.chunk_size == 64
    assert "fused_chunk_size" not in default.to_dict() and other.to_dict()["fused_chunk_size"] == 128
    assert default.architecture_dict() == other.architecture_dict()
    with pytest.raises(ConfigError, match="fused_chunk_size=0 must be a positive integer"):
        LoopedLMConfig(**base, fused_chunk_size=0)
    m = Mamba2Mixer.from_config(other)
    assert (m.chunk_size, m.fused_chunk_size) == (16, 128)
    _cpu_fused_ops(monkeypatch, None, step_kernels=False, every_kernel=True)
    with torch.no_grad():
        m(torch.randn(1, 20, 32))
    assert SCAN_CHUNKS == [128]


def test_fake_tensors_take_the_torch_path_under_every_kernel():
    """`python -m looplab.plan` runs a step on fake tensors, which no fused kernel can run: every kernel setting
    takes the torch scan there (kernel=mamba_ssm included, which refuses a real CPU input), forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for kernel in ("auto", "mamba_ssm"):
        m = Mamba2Mixer(32, d_state=16, headdim=8, kernel=kernel)
        with pytest.raises(RuntimeError, match="backbone.kernel=mamba_ssm") if kernel == "mamba_ssm" \
                else contextlib.nullcontext():
            m(torch.randn(1, 4, 32))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            x = mode.from_tensor(torch.randn(2, 70, 32)).requires_grad_()
            m(x).sum().backward()
            assert x.grad.shape == (2, 70, 32)


# ----------------------------------------------------------------------------- kernel=auto's fallback warning
def test_fallback_warning_rule():
    """Warn where the fallback costs (CUDA without mamba_ssm; mamba_ssm installed but no usable CUDA), never for
    the CPU's own path, nor for kernel=torch (asked for) or kernel=mamba_ssm (raises instead)."""
    from looplab.models.mamba2 import fallback_warning

    missing = "ModuleNotFoundError: No module named 'mamba_ssm'"
    ops = FusedOps(object(), object())
    cuda = fallback_warning("auto", "cuda", missing)
    assert "mamba_ssm does not import (ModuleNotFoundError: No module named 'mamba_ssm')" in cuda
    assert "make gpu-install" in cuda and "backbone.kernel=torch silences this" in cuda
    assert fallback_warning("auto", "cuda", ops) is None  # the kernels run
    no_cuda = "torch 2.13.0+cpu is built without CUDA"
    assert fallback_warning("auto", "cpu", None, cuda_problem=no_cuda, mamba_ssm_installed=False) is None
    assert fallback_warning("auto", "cpu", None, cuda_problem=None, mamba_ssm_installed=True) is None  # CPU by choice
    msg = fallback_warning("auto", "cpu", None, cuda_problem=no_cuda, mamba_ssm_installed=True)
    assert "mamba_ssm is installed but CUDA is not usable (torch 2.13.0+cpu is built without CUDA)" in msg
    for kernel in ("torch", "mamba_ssm"):
        assert fallback_warning(kernel, "cuda", missing) is None
        assert fallback_warning(kernel, "cpu", None, cuda_problem=no_cuda, mamba_ssm_installed=True) is None


def test_kernel_auto_warns_once_per_process_and_never_for_a_plain_cpu_run(monkeypatch):
    """The decision's inputs are given (CUDA's absence, mamba_ssm's presence): no kernel is involved."""
    import warnings as _warnings

    from looplab.models import mamba2

    def built(kernel="auto") -> list[str]:
        with _warnings.catch_warnings(record=True) as seen:
            _warnings.simplefilter("always")
            m = Mamba2Mixer(32, d_state=16, headdim=8, kernel=kernel)
            if kernel != "mamba_ssm":
                m(torch.randn(1, 4, 32))
        return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]

    monkeypatch.setattr(mamba2, "_WARNED", set())
    monkeypatch.setattr(mamba2, "_mamba_ssm_installed", lambda: False)
    monkeypatch.setattr(mamba2, "_cuda_problem", lambda: "torch 2.13.0+cpu is built without CUDA")
    assert built() == [] and built() == []  # a CPU machine without mamba_ssm: the CPU's path, nothing to say
    monkeypatch.setattr(mamba2, "_WARNED", set())
    monkeypatch.setattr(mamba2, "_mamba_ssm_installed", lambda: True)
    assert built("torch") == [] and built("mamba_ssm") == []
    first = built()
    assert len(first) == 1 and "CUDA is not usable (torch 2.13.0+cpu is built without CUDA)" in first[0]
    assert built() == []  # once per process
    # on CUDA, without mamba_ssm (what the first CUDA forward calls): once, naming mamba_ssm
    with _warnings.catch_warnings(record=True) as seen:
        _warnings.simplefilter("always")
        for _ in range(3):
            mamba2._warn_cuda_fallback_once("auto", "ModuleNotFoundError: No module named 'mamba_ssm'")
    assert len(seen) == 1 and "mamba_ssm does not import (ModuleNotFoundError" in str(seen[0].message)
