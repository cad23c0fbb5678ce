"""Mamba2Mixer on mamba_ssm's fused kernels against the same weights on the torch path.

On a GPU (marked `gpu`; skipped, saying why, without CUDA and mamba_ssm): forward, backward (input and
parameter gradients), and prefill through the fused scan then step decoding, in fp32 and in bf16 autocast,
for three shapes: one hands causal-conv1d the channel-last view of its input, one needs a copy, one has a
width causal-conv1d lacks (d_conv 5, kernel=auto: torch conv, fused scan); and the fused mixer under
torch.compile. Which conv ran is counted as it runs (`mamba2.CONV_CALLS`): the torch conv where
causal-conv1d's kernel was due fails the case even when the numbers agree. Each test records its figures
(`record_property`), which `make gpu-check` keeps in gpu-check.json (docs/gpu.md#gpu-check).

On the CPU the same harness runs the torch path against itself and against stand-ins for the kernels: those
tests check the harness (its comparisons, its conv check), not the kernels.
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
from looplab.models.mamba2 import CONV_CALLS, FusedOps, Mamba2Mixer, _conv_channel_last_ok

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

# name → (Mamba2Mixer kwargs, kernel); test_parity_shapes_exercise_each_conv_layout pins the layout of each
PARITY_SHAPES = {
    "d256": (dict(d_model=256, d_state=64, headdim=64, ngroups=1, d_conv=4, chunk_size=64), "mamba_ssm"),
    "d96-g2": (dict(d_model=96, d_state=32, headdim=32, ngroups=2, d_conv=4, chunk_size=32), "mamba_ssm"),
    "d256-conv5": (dict(d_model=256, d_state=64, headdim=64, ngroups=1, d_conv=5, chunk_size=64), "auto"),
}
BATCH, LENGTH, PREFILL = 2, 200, 150  # 200 and 150 are not multiples of any chunk size above
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


def _failures(worst: dict, tol: dict, conv: dict) -> list[str]:
    bad = [f"{k} {v:.3g} > {tol[k]:.3g}" for k, v in worst.items() if not v <= tol[k]]
    return bad + ([conv["why"]] if "why" in conv else [])


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
    dec = prefill_then_steps(fused, x, bf16, prefill)
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
    out["failures"] = _failures(out["worst"], tol, conv)
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


def _cpu_fused_ops(monkeypatch, conv_fn, conv_error=None):
    """Make a kernel=mamba_ssm mixer on the CPU take the fused branch: the torch SSD behind mamba_ssm's
    scan signature, and conv_fn as causal_conv1d_fn (None: it "did not import")."""
    from looplab.models.ops.ssd import ssd_chunked

    def scan(x, dt, A, B, C, chunk_size, D=None, initial_states=None, return_final_states=False):
        return ssd_chunked(x, dt, A, B, C, chunk_size, D=D, initial_state=initial_states,
                           return_final_state=return_final_states)

    ops = FusedOps(scan, conv_fn, conv_error)
    monkeypatch.setattr(Mamba2Mixer, "_fused_ops", lambda self, x: None if self.kernel == "torch" else ops)


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
                                f"(causal_conv1d: {error})"]
    compiled = compile_case(SMALL, "mamba_ssm", device="cpu", length=20, backend="eager")
    assert compiled["conv"]["ran"] == "none counted"  # compiled, the torch conv is not even counted: still a fail
    assert len(compiled["failures"]) == 1 and "no causal_conv1d call was counted" in compiled["failures"][0]


def test_parity_passes_the_conv_check_when_causal_conv1d_ran(monkeypatch):
    _cpu_fused_ops(monkeypatch, _stand_in_causal_conv1d)
    case = parity_case(SMALL, "mamba_ssm", "fp32", device="cpu", length=20, prefill=12)
    assert case["failures"] == []
    assert case["conv"] == {"ran": "causal_conv1d", "expected": "causal_conv1d", "calls": {"causal_conv1d": 1},
                            "layout": "channel-last view (no copy)"}
    compiled = compile_case(SMALL, "mamba_ssm", device="cpu", length=20, backend="eager")
    assert compiled["failures"] == [] and compiled["conv"]["calls"] == {"causal_conv1d": 2}  # eager behind disable
    # a d_conv 5 mixer (kernel=auto): causal-conv1d has no such width, the torch conv is the right one
    case = parity_case({**SMALL, "d_conv": 5}, "auto", "fp32", device="cpu", length=20, prefill=12)
    assert case["failures"] == [] and case["conv"] == {"ran": "torch", "expected": "torch", "calls": {"torch": 1}}
