"""Mamba-2 backbone layer (docs/formulations.md#backbones): mixer, gated norm, and the pre-norm layer.

    in_proj(x) → z, xBC, dt_raw
    xBC = SiLU(causal depthwise conv1d(xBC));  x, B, C = split(xBC)
    dt = softplus(dt_raw + dt_bias),  A = −exp(A_log)
    y = SSD(x, dt, A, B, C) + D·x
    out = out_proj(RMSNorm(y ⊙ SiLU(z)))

One module, two implementations of the scan with one state dict: the pure-PyTorch
chunked SSD (`looplab.models.ops.ssd`, CPU and reference) and mamba_ssm's fused Triton
kernels (`kernel=auto` picks them on CUDA when importable), with causal_conv1d's CUDA conv
for kernel widths 2..4 (the only ones it has; other widths keep the torch conv under
`kernel=auto`, and `kernel=mamba_ssm` refuses them in LoopedLMConfig.validate). Each scan
has its own chunk length (`chunk_size` 64 for the torch scan, `fused_chunk_size` 256 for
mamba_ssm's, its Mamba2 default); the chunk length does not change what is computed.

`kernel=auto` falls back to the torch path without a word on the CPU (that is the CPU's
implementation, not a fallback), and warns once per process where the fallback costs
(`fallback_warning`): a layer on CUDA whose kernels do not import (naming mamba_ssm, or
causal_conv1d, with the import error), or a machine where mamba_ssm is installed but CUDA
is not usable (naming CUDA). Fake tensors (`python -m looplab.plan`) always take the torch
path: the fused kernels cannot run on them.

mamba_ssm is imported once, eagerly, by `resolve_fused_ops()`: at layer construction when
CUDA is available, never while Dynamo traces (every released version needs CUDA just to
import, and an import inside a traced region is a graph break each time). The fused calls
are wrapped in `torch.compiler.disable`: with `compile=true` Dynamo compiles the projections,
gating and norm around them and runs the Triton/CUDA kernels eagerly (one graph break each).
When causal-conv1d does not import, the layer keeps the torch conv, warns once and keeps the
reason in `FusedOps.causal_conv1d_error`; `CONV_CALLS` counts which conv actually ran, so a
check (`looplab.gpu_check`) can tell the CUDA conv from the fallback instead of assuming it.

Decoding keeps an SSMCache per (loop, layer): the last d_conv−1 conv inputs (B, conv_dim,
d_conv−1) and the (B, nheads, headdim, d_state) fp32 SSM state, both constant in sequence
length, one layout for both paths. A call with T > 1 tokens (prefill, possibly continuing a
cache) runs the chunked scan from the cached state; a call with one token runs the step
recurrence: on CUDA with the kernels, causal_conv1d's `causal_conv1d_update` and mamba_ssm's
`selective_state_update` (which update those two buffers in place, as mamba_ssm's
Mamba2.step does), else the torch step (`ssd_step`, the reference). Both equal the full
forward pass. `STEP_CALLS` counts which SSM step ran, as `CONV_CALLS` counts the conv.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from looplab.models.cache import SSMCache
from looplab.models.config import CAUSAL_CONV1D_WIDTHS, ConfigError, LoopedLMConfig, fused_conv_width_error
from looplab.models.llama import RMSNorm, SwiGLU
from looplab.models.ops.ssd import ssd_chunked, ssd_step
from looplab.models.backbone import Layer
from looplab.models.registry import LAYERS, Supports

_FP32_PARAMS = ("A_log", "dt_bias", "D")


class FusedOps(NamedTuple):
    chunk_scan: Callable  # mamba_ssm's mamba_chunk_scan_combined
    causal_conv1d: Callable | None  # causal_conv1d_fn; None when causal-conv1d does not import
    causal_conv1d_error: str | None = None  # why it does not: the import error's text
    # one-token decoding (None: the torch step runs instead): mamba_ssm's selective_state_update and
    # causal_conv1d's causal_conv1d_update, and why one did not import
    selective_state_update: Callable | None = None
    causal_conv1d_update: Callable | None = None
    step_error: str | None = None


_FUSED: FusedOps | str | None = None  # resolved once: the ops, or why they are unavailable

# Which depthwise conv ran, counted as it runs: "causal_conv1d" (the CUDA kernel), "torch" (the
# fallback, no cache), "torch_cached" (the torch conv with a cache: a prefill, or a one-token step
# without the kernel) and "causal_conv1d_update" (causal_conv1d's one-token decoding kernel).
# Counted in eager code only: a count inside a compiled graph would guard on the counter's value
# and recompile every call, so a compiled torch conv goes uncounted (the CUDA kernel never is: it
# runs eagerly behind torch.compiler.disable). Clear it before the calls you want to attribute.
CONV_CALLS: Counter[str] = Counter()
# Which one-token SSM step ran (decoding): "selective_state_update" (mamba_ssm's kernel) or "torch" (ssd_step).
STEP_CALLS: Counter[str] = Counter()


def _count_conv(path: str) -> None:
    if not torch.compiler.is_compiling():
        CONV_CALLS[path] += 1


def _count_step(path: str) -> None:
    if not torch.compiler.is_compiling():
        STEP_CALLS[path] += 1


def resolve_fused_ops() -> FusedOps | str:
    """Import the fused kernels once per process; returns them or the import error's text.

    Called eagerly (layer construction on a CUDA machine, or the first CUDA forward outside a
    compiled region); the forward pass then only reads the module global `_FUSED`."""
    global _FUSED
    if _FUSED is None:
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except Exception as e:  # ImportError, or a CUDA error raised at import time
            _FUSED = f"{type(e).__name__}: {e}"
            return _FUSED
        try:
            from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

            conv_error = None
        except Exception as e:  # the torch conv still works (a small part of the layer's cost), but say so
            causal_conv1d_fn = causal_conv1d_update = None
            conv_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"causal_conv1d does not import ({conv_error}); Mamba-2 layers use the torch conv "
                          "instead of its CUDA kernel, and decode with the torch conv step instead of "
                          "causal_conv1d_update (make gpu-install builds it)", RuntimeWarning, stacklevel=2)
        try:
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update

            step_error = None
        except Exception as e:  # the same package as the scan: unlikely, but decoding still works
            selective_state_update, step_error = None, f"{type(e).__name__}: {e}"
            warnings.warn(f"mamba_ssm's selective_state_update does not import ({step_error}); Mamba-2 layers "
                          "decode with the torch step recurrence", RuntimeWarning, stacklevel=2)
        _FUSED = FusedOps(mamba_chunk_scan_combined, causal_conv1d_fn, conv_error,
                          selective_state_update, causal_conv1d_update, step_error)
    return _FUSED


# ----------------------------------------------------------------------------- kernel=auto's fallback warning
_WARNED: set[str] = set()  # what kernel=auto has warned about in this process: "mamba_ssm", "cuda"


def _cuda_problem() -> str | None:
    """Why CUDA is not usable here (None when it is); the cheap part of gpu_check.cuda_problems."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _mamba_ssm_installed() -> bool:
    """Whether mamba_ssm is installed, without importing it (it needs CUDA to import)."""
    import importlib.util
    import sys

    if "mamba_ssm" in sys.modules:
        return sys.modules["mamba_ssm"] is not None
    try:
        return importlib.util.find_spec("mamba_ssm") is not None
    except (ImportError, ValueError):
        return False


def fallback_warning(kernel: str, device_type: str, fused: "FusedOps | str | None", *,
                     cuda_problem: str | None = None, mamba_ssm_installed: bool = False) -> str | None:
    """What `kernel=auto` says when a Mamba-2 layer falls back to the torch path; None: nothing to say.

    The rule: warn where the fallback costs, stay silent where the torch path is simply the device's path.

    - On CUDA (device_type "cuda"): mamba_ssm does not import (`fused` is its import error) → the torch SSD scan
      runs, slower and saving far more for backward (244 MiB against 17.5 MiB per layer and 2048-token sequence at
      the 370M width in bf16, docs/gpu.md#kernels): warn, naming mamba_ssm and its import error.
      (causal_conv1d, or one decoding kernel, not importing beside a working scan is warned about where it is
      found, in `resolve_fused_ops`, once.)
    - Not on CUDA: silent, unless mamba_ssm is installed and CUDA is not usable (`cuda_problem`): the kernels
      were meant to run and CUDA is what is missing, so the warning names CUDA. A CPU run on a machine without
      mamba_ssm — the tests, the demo, every CPU user who never asked for the kernels — says nothing.
    - `kernel=torch` asked for the torch path, and `kernel=mamba_ssm` raises instead of falling back: neither warns.
    """
    if kernel != "auto":
        return None
    if device_type == "cuda":
        if isinstance(fused, str):
            return (f"backbone.kernel=auto: mamba_ssm does not import ({fused}); Mamba-2 layers on CUDA run the "
                    "pure-PyTorch SSD scan instead of its fused kernels (slower, and several times the activation "
                    "memory). make gpu-install builds them (docs/gpu.md#gpu-install); backbone.kernel=torch "
                    "silences this")
        return None
    if cuda_problem and mamba_ssm_installed:
        return (f"backbone.kernel=auto: mamba_ssm is installed but CUDA is not usable ({cuda_problem}); Mamba-2 "
                "layers run the pure-PyTorch SSD scan on the CPU. backbone.kernel=torch silences this")
    return None


def _warn_once(key: str, message: str | None) -> None:
    _WARNED.add(key)  # decided: not looked at again in this process, whether or not there was something to say
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@torch.compiler.disable
def _warn_cuda_fallback_once(kernel: str, fused) -> None:
    """The CUDA case of `fallback_warning`, once per process (eager: never traced)."""
    if "mamba_ssm" not in _WARNED:
        _warn_once("mamba_ssm", fallback_warning(kernel, "cuda", fused))


def _warn_cpu_fallback_once(kernel: str) -> None:
    """The no-CUDA case of `fallback_warning`, decided once per process at layer construction (eager)."""
    if "cuda" not in _WARNED and kernel == "auto":
        problem = _cuda_problem()
        _warn_once("cuda", fallback_warning(kernel, "cpu", None, cuda_problem=problem,
                                            mamba_ssm_installed=problem is not None and _mamba_ssm_installed()))


def _is_fake(x: torch.Tensor) -> bool:
    """A FakeTensor outside a Dynamo trace: `python -m looplab.plan`'s dry run, which the fused kernels cannot
    run (they read data pointers). Under torch.compile the traced tensors are fake too, but that is not a plan."""
    return not torch.compiler.is_compiling() and isinstance(x, FakeTensor)


_resolve_fused_ops_outside_trace = torch.compiler.disable(resolve_fused_ops)


@torch.compiler.disable
def _fused_conv_update(conv_update, x, conv_state, weight, bias):
    """causal_conv1d_update: x (b, C) one token, conv_state (b, C, K−1) updated in place (its kernel shifts the
    window left by one and writes x last, as looplab's torch step does); returns SiLU(conv) (b, C)."""
    CONV_CALLS["causal_conv1d_update"] += 1
    return conv_update(x, conv_state, weight, bias, "silu")


@torch.compiler.disable
def _fused_state_update(state_update, state, x, dt_raw, A, Bm, Cm, D, dt_bias):
    """mamba_ssm's selective_state_update for one token, called as mamba_ssm's Mamba2.step calls it.

    state (b, H, P, N) fp32, updated in place; x (b, H, P); dt_raw (b, H) before softplus; A, D, dt_bias (H,) fp32;
    Bm, Cm (b, G, N). A, dt, dt_bias and D are broadcast over headdim (and A over d_state) as stride-0 views, so
    the kernel takes its scalar-per-head branch (TIE_HDIM); dt_softplus=True adds dt_bias and applies softplus
    in fp32 inside the kernel, as the torch path does before its step. z=None: looplab applies the gated RMSNorm
    itself afterwards (mamba_ssm's Mamba2 with rmsnorm=True passes z=None too). Returns y = state·C + D·x (b, H, P)."""
    STEP_CALLS["selective_state_update"] += 1
    H, P, N = state.shape[1:]
    return state_update(state, x, dt_raw[..., None].expand(-1, H, P), A[:, None, None].expand(H, P, N), Bm, Cm,
                        D=D[:, None].expand(H, P), z=None, dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True)


@torch.compiler.disable
def _fused_chunk_scan(scan, xs, dt, A, Bm, Cm, chunk_size, D, init, want_state):
    """mamba_ssm's Triton scan, run eagerly under torch.compile (Dynamo does not trace into it)."""
    return scan(xs, dt, A, Bm, Cm, chunk_size, D=D, initial_states=init, return_final_states=want_state)


@torch.compiler.disable
def _fused_conv_silu(conv_fn, xBC, weight, bias):
    """causal_conv1d's CUDA kernel on xBC (B, T, C) → (B, T, C), run eagerly under torch.compile
    (the layout test reads the data pointer, which a traced tensor does not have)."""
    CONV_CALLS["causal_conv1d"] += 1
    return conv_fn(_conv_input(xBC), weight, bias, activation="silu").transpose(1, 2)


def _conv_channel_last_ok(x: torch.Tensor) -> bool:
    """Whether causal_conv1d's channel-last kernel takes x (B, C, T) as it is, without a copy.

    Its checks (causal_conv1d.cpp, fwd and bwd): channel stride 1, C % 8 == 0, x.stride(0)
    and x.stride(2) multiples of 8. It also loads 8 (16-bit) or 4 (fp32) channels per 16-byte
    vector from the data pointer without checking it, so that pointer must be 16-byte aligned
    (the xBC slice starts d_inner elements into the in_proj output)."""
    if x.dim() != 3:
        return False
    _, C, T = x.shape
    return (
        x.stride(1) == 1
        and (x.stride(2) > 1 or T == 1)
        and C % 8 == 0
        and x.stride(0) % 8 == 0
        and x.stride(2) % 8 == 0
        and x.data_ptr() % 16 == 0
    )


def _conv_input(xBC: torch.Tensor) -> torch.Tensor:
    """The (B, C, T) tensor to hand to causal_conv1d for xBC (B, T, C), copying only when needed.

    Preferred: the channel-last view, as mamba_ssm's Mamba2 passes it (no copy; the output
    comes back channel-last, i.e. (B, T, C) contiguous after the transpose, so the scan reads
    a head dim of stride 1). Else a channel-last copy; channel-first only when C % 8 != 0."""
    x = xBC.transpose(1, 2)
    if _conv_channel_last_ok(x):
        return x
    x = xBC.contiguous().transpose(1, 2)
    if _conv_channel_last_ok(x):
        return x
    return xBC.transpose(1, 2).contiguous()


class _CausalConvSiLU(torch.autograd.Function):
    """SiLU(depthwise causal conv1d) in the (B, T, C) layout the projections produce.

    Written as K shifted multiply-adds with a hand-written backward: on CPU this measured
    ~1.5x faster than F.conv1d, whose (B, C, T) layout costs two transposes and whose
    depthwise backward is slow. The fused CUDA path uses causal_conv1d instead.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, history):
        K, T = weight.shape[1], x.shape[1]
        if history is None:
            xp = F.pad(x, (0, 0, K - 1, 0))  # (B, K-1+T, C): zeros before the first token
        else:
            xp = torch.cat([history, x], dim=1)
        u = torch.addcmul(bias, xp[:, :T], weight[:, 0]) if bias is not None else xp[:, :T] * weight[:, 0]
        for k in range(1, K):
            u.addcmul_(xp[:, k : k + T], weight[:, k])
        ctx.save_for_backward(xp, weight, u)
        ctx.has_bias = bias is not None
        return F.silu(u)

    @staticmethod
    def backward(ctx, grad):
        xp, weight, u = ctx.saved_tensors
        K, T = weight.shape[1], grad.shape[1]
        du = torch.ops.aten.silu_backward(grad.contiguous(), u)
        dpad = F.pad(du, (0, 0, 0, K - 1))  # input step s feeds outputs s .. s+K-1
        dx = dpad[:, K - 1 : K - 1 + T] * weight[:, 0]
        for k in range(1, K):
            dx.addcmul_(dpad[:, K - 1 - k : K - 1 - k + T], weight[:, k])
        dw = torch.stack([(du * xp[:, k : k + T]).sum((0, 1)) for k in range(K)], dim=1)
        return dx, dw, du.sum((0, 1)) if ctx.has_bias else None, None


def causal_conv_silu(x, weight, bias=None, history=None):
    """x (B, T, C), weight (C, K), history (B, K-1, C) or None (zeros) → SiLU(conv) (B, T, C)."""
    return _CausalConvSiLU.apply(x, weight, bias, history)


class GatedRMSNorm(nn.Module):
    """RMSNorm(y ⊙ SiLU(z)) · weight, normalised per group of channels (one group per B/C group),
    so a checkpoint computes the same thing as mamba_ssm's RMSNormGated(norm_before_gate=False)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        if self.group_size == h.shape[-1]:
            return F.rms_norm(h, (self.group_size,), self.weight.float(), self.eps).to(y.dtype)
        h = F.rms_norm(h.unflatten(-1, (-1, self.group_size)), (self.group_size,), eps=self.eps).flatten(-2)
        return (h * self.weight.float()).to(y.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        headdim: int = 64,
        expand: int = 2,
        ngroups: int = 1,
        d_conv: int = 4,
        chunk_size: int = 64,
        kernel: str = "auto",
        norm_eps: float = 1e-5,
        A_init: tuple[float, float] = (1.0, 16.0),
        dt_init: tuple[float, float] = (1e-3, 1e-1),
        fused_chunk_size: int = 256,
    ):
        super().__init__()
        d_inner = expand * d_model
        if d_inner % headdim:
            raise ValueError(f"expand*d_model={d_inner} is not divisible by headdim={headdim}")
        nheads = d_inner // headdim
        if nheads % ngroups:
            raise ValueError(f"ngroups={ngroups} must divide the number of heads {nheads}")
        if kernel not in ("auto", "torch", "mamba_ssm"):
            raise ValueError(f"kernel={kernel!r} is unknown; choose auto, torch or mamba_ssm")
        if kernel == "mamba_ssm" and d_conv not in CAUSAL_CONV1D_WIDTHS:
            raise ConfigError(fused_conv_width_error(d_conv))
        self.d_model, self.d_inner, self.d_state = d_model, d_inner, d_state
        self.headdim, self.nheads, self.ngroups, self.d_conv = headdim, nheads, ngroups, d_conv
        self.chunk_size, self.kernel = chunk_size, kernel  # chunk_size: the torch scan's
        self.fused_chunk_size = fused_chunk_size  # mamba_ssm's scan's (its Mamba2 default, 256)
        self.A_init, self.dt_init = tuple(A_init), tuple(dt_init)
        self.conv_dim = d_inner + 2 * ngroups * d_state

        # Order [z, x, B, C, dt] as in mamba_ssm, so weights map one to one.
        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * ngroups * d_state + nheads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1)
        self.dt_bias = nn.Parameter(torch.empty(nheads))
        self.A_log = nn.Parameter(torch.empty(nheads))
        self.D = nn.Parameter(torch.empty(nheads))
        for name in _FP32_PARAMS:
            getattr(self, name)._no_weight_decay = True  # mamba_ssm's convention for optimiser grouping
        self.norm = GatedRMSNorm(d_inner, d_inner // ngroups, norm_eps)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        self.scan_fn = ssd_chunked  # the benchmark swaps in the token-by-token reference
        self.reset_special_parameters()
        if kernel != "torch" and torch.cuda.is_available():
            resolve_fused_ops()  # import now, not inside a compiled forward
        elif kernel == "auto":
            _warn_cpu_fallback_once(kernel)  # silent unless mamba_ssm is installed and CUDA is what is missing

    @classmethod
    def from_config(cls, cfg: LoopedLMConfig, d_model: int | None = None) -> "Mamba2Mixer":
        """The backbone mixer (width cfg.d_model) or StateLoop's state mixer (d_model=cfg.state_dim)."""
        return cls(
            d_model=d_model or cfg.d_model,
            d_state=cfg.d_state,
            headdim=cfg.headdim,
            expand=cfg.expand,
            ngroups=cfg.ngroups,
            d_conv=cfg.d_conv,
            chunk_size=cfg.chunk_size,
            kernel=cfg.kernel,
            fused_chunk_size=cfg.fused_chunk_size,
            norm_eps=cfg.norm_eps,
            A_init=cfg.mamba_A_init,
            dt_init=cfg.mamba_dt_init,
        )

    @torch.no_grad()
    def reset_special_parameters(self, generator: torch.Generator | None = None) -> None:
        """A ~ U[A_init] stored as log, softplus(dt_bias) ~ logU[dt_init], D = 1, conv at PyTorch's default.
        Called by LoopedLM after its generic init (which zeroes every bias, dt_bias and conv bias included);
        generator: the mixer's own (models/rng.py), None: the global one."""
        lo, hi = self.A_init
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(lo, hi, generator=generator).log())
        lo, hi = self.dt_init
        dt = torch.exp(torch.empty_like(self.dt_bias, dtype=torch.float32).uniform_(math.log(lo), math.log(hi),
                                                                                    generator=generator))
        dt = dt.clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.D.fill_(1.0)
        # nn.Conv1d.reset_parameters, drawn from `generator`
        w, b = self.conv1d.weight, self.conv1d.bias
        nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
        if b is not None:
            bound = 1 / math.sqrt(w.shape[1] * w.shape[2])  # fan_in
            nn.init.uniform_(b, -bound, bound, generator=generator)

    def _apply(self, fn, *args, **kwargs):
        """Keep A_log, dt_bias and D in fp32 through model.to(bf16) / .half(): exp(A_log) and the
        decay products lose too much in 8 mantissa bits (mamba_ssm keeps them fp32 for the same reason)."""
        super()._apply(fn, *args, **kwargs)
        for name in _FP32_PARAMS:
            p = getattr(self, name)
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
                if p.grad is not None:
                    p.grad.data = p.grad.data.float()
        return self

    # ------------------------------------------------------------------ kernels
    def _fused_ops(self, x: torch.Tensor) -> FusedOps | None:
        """The fused kernels for this input, or None for the torch path (kernel=auto without them, where
        kernel=auto warns by `fallback_warning`'s rule; and fake tensors, under any kernel: a plan's dry run)."""
        if self.kernel == "torch" or _is_fake(x):
            return None
        ops = None
        if x.is_cuda:
            ops = _FUSED if _FUSED is not None else _resolve_fused_ops_outside_trace()
        if isinstance(ops, FusedOps):
            return ops
        if self.kernel == "mamba_ssm":
            why = "the input is not on CUDA" if not x.is_cuda else f"mamba_ssm does not import ({ops})"
            raise RuntimeError(
                f"backbone.kernel=mamba_ssm but {why}; build the gpu extra on a CUDA machine (make gpu-install: "
                "pip --no-build-isolation against this torch), or use backbone.kernel=auto / torch"
            )
        if x.is_cuda and "mamba_ssm" not in _WARNED:
            _warn_cuda_fallback_once(self.kernel, ops)
        return None

    def _step_kernels(self, ops: FusedOps | None, cache: SSMCache | None, T: int) -> tuple[Callable | None, Callable | None]:
        """(causal_conv1d_update, selective_state_update) for this call, each None where the torch step runs.

        Only a one-token call with a cache takes them, and not between a speculative checkpoint() and rollback()
        (`cache.trail`: the rollback needs the state after every position, kept as separate tensors, which the
        in-place kernels would overwrite). The conv kernel has widths 2..4 only, like causal_conv1d_fn."""
        if ops is None or cache is None or T != 1 or cache.trail is not None:
            return None, None
        conv = ops.causal_conv1d_update if self.d_conv in CAUSAL_CONV1D_WIDTHS else None
        return conv, ops.selective_state_update

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,  # (B, T, d_model)
        positions: torch.Tensor | None = None,  # unused: the conv and the scan are position-free
        valid: torch.Tensor | None = None,  # (B, L) bool, the last T columns are these tokens
        cache: SSMCache | None = None,
        skip: torch.Tensor | None = None,  # (B, T) bool: tokens that neither decay nor write the state
    ) -> torch.Tensor:
        Bsz, T, _ = x.shape
        H, P, G, N, K = self.nheads, self.headdim, self.ngroups, self.d_state, self.d_conv
        ops = self._fused_ops(x)
        conv_step, state_step = self._step_kernels(ops, cache, T)
        z, xBC, dt_raw = self.in_proj(x).split((self.d_inner, self.conv_dim, H), dim=-1)
        if cache is not None:  # an exited token's deeper loops reuse these (models/exit_compute.py)
            cache.write_last(xBC[:, -1].detach(), dt_raw[:, -1].detach())

        # Left padding must leave real tokens untouched: zero the conv input (else it leaks through
        # the conv window), then x, B and dt after the conv (the conv bias makes them non-zero), so
        # a padding step neither decays the state (dt = 0 → exp(0) = 1) nor writes to it.
        keep = valid[:, -T:, None] if valid is not None else None
        if keep is not None:
            xBC = xBC * keep
        xBC = self._conv(xBC, cache, ops, conv_step)
        if keep is not None:
            xBC = xBC * keep
        xs, Bm, Cm = xBC.split((self.d_inner, G * N, G * N), dim=-1)
        xs, Bm, Cm = xs.unflatten(-1, (H, P)), Bm.unflatten(-1, (G, N)), Cm.unflatten(-1, (G, N))
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())  # (B, T, H), fp32 under autocast too
        if keep is not None:
            dt = dt * keep
        if skip is not None:  # exit handling ssm_skip: the token is absent from this loop's state
            dt = dt.masked_fill(skip[..., None], 0.0)
        A = -torch.exp(self.A_log.float())
        D = self.D.float()

        states = None  # the state after each position, when the cache records them for a rollback
        if state_step is not None:  # T == 1 with a cache, on CUDA: mamba_ssm's kernel (_step_kernels)
            y = self._kernel_step(state_step, cache, xs[:, 0], dt_raw[:, 0], keep, skip, A, Bm[:, 0], Cm[:, 0], D)
            y, state = y[:, None], None  # the cache's state was written by the kernel (or by _kernel_step)
        elif cache is not None and T == 1:
            _count_step("torch")
            y, state = ssd_step(cache.state(), xs[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], D)
            y, states = y[:, None], [state]
        elif cache is not None and cache.trail is not None:
            # a speculative verify (models/speculative.py) may keep any prefix of these T tokens, so it
            # needs the state after each one: the step recurrence gives them, with the arithmetic of
            # one-token decoding, on every device (the fused chunk scan returns the final state only).
            # Cost: T small steps instead of one chunked scan, T ≤ draft_tokens + 1.
            ys, states, state = [], [], cache.state()
            for t in range(T):
                y_t, state = ssd_step(state, xs[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D)
                ys.append(y_t)
                states.append(state)
            y = torch.stack(ys, 1)
        else:
            init = cache.state() if cache is not None else None  # a fresh row's state is zeros: the same scan
            want_state = cache is not None
            if ops is not None:
                out = _fused_chunk_scan(ops.chunk_scan, xs, dt, A, Bm, Cm, self.fused_chunk_size, D, init, want_state)
            else:
                out = self.scan_fn(xs, dt, A, Bm, Cm, self.chunk_size, D=D, initial_state=init, return_final_state=want_state)
            y, state = out if want_state else (out, None)
        if cache is not None:
            if state is not None:
                cache.write_state(state, T)
            if cache.trail is not None:
                cache.trail[-1][1].extend(states)  # the window was appended by _conv

        y = self.norm(y.flatten(-2), z)
        return self.out_proj(y.to(x.dtype))

    def _kernel_step(self, state_step, cache: SSMCache, x, dt_raw, keep, skip, A, Bm, Cm, D) -> torch.Tensor:
        """One token through selective_state_update on the cache's SSM state; returns y (b, H, P).

        The kernel updates the state in place: the cache's own buffer when this call covers all its rows (no
        copy), else a gathered fp32 copy of the call's rows, written back. A padded or skipped token must neither
        decay nor write the state (the torch path zeroes its dt): its raw dt is set to −inf, which the kernel's
        softplus turns into dt = 0 exactly (exp(0·A) = 1, dt·B = 0)."""
        state = cache.state()
        live = state is cache.ssm_state and state.dtype == torch.float32
        if not live:
            state = state.to(torch.float32, copy=state is cache.ssm_state)
        if keep is not None:  # (b, 1) per row
            dt_raw = dt_raw.masked_fill(~keep[:, -1].bool(), float("-inf"))
        if skip is not None:
            dt_raw = dt_raw.masked_fill(skip[:, -1, None], float("-inf"))
        y = _fused_state_update(state_step, state, x, dt_raw, A, Bm, Cm, D, self.dt_bias.float())
        if not live:
            cache.write_state(state, 1)
        return y

    def _conv(self, xBC: torch.Tensor, cache: SSMCache | None, ops: FusedOps | None,
              conv_step: Callable | None = None) -> torch.Tensor:
        """Depthwise causal conv + SiLU over (B, T, conv_dim); with a cache the window starts from its history.
        conv_step: causal_conv1d_update, for a one-token call with a cache (`_step_kernels`)."""
        w = self.conv1d.weight.squeeze(1)  # (conv_dim, K)
        if cache is None:
            if ops is not None and ops.causal_conv1d is not None and self.d_conv in CAUSAL_CONV1D_WIDTHS:
                return _fused_conv_silu(ops.causal_conv1d, xBC, w, self.conv1d.bias)
            _count_conv("torch")
            return causal_conv_silu(xBC, w, self.conv1d.bias)
        if conv_step is not None:
            # the kernel needs conv_state in x's dtype (its TORCH_CHECK) and shifts it in place: the cache's own
            # buffer when the call covers all its rows and the dtypes agree, else a copy, written back
            state = cache.history()
            live = state is cache.conv_state and state.dtype == xBC.dtype
            if not live:
                state = state.to(xBC.dtype, copy=state is cache.conv_state)
            out = _fused_conv_update(conv_step, xBC[:, 0], state, w, self.conv1d.bias)
            if not live:
                cache.write_conv(state.transpose(1, 2))  # (b, K−1, conv_dim): its last K−1 inputs are all of it
            return out[:, None]
        _count_conv("torch_cached")
        history = cache.history().transpose(1, 2).to(xBC.dtype)  # (b, K-1, conv_dim)
        out = causal_conv_silu(xBC, w, self.conv1d.bias, history)
        window = torch.cat([history, xBC], dim=1)
        cache.write_conv(window)
        if cache.trail is not None:  # the conv history after every position of this call lies in it
            cache.trail.append((window, []))
        return out

    # ------------------------------------------------------------------ exited tokens
    @torch.no_grad()
    def step_from(self, cache: SSMCache, source: SSMCache, rows: torch.Tensor, write: bool) -> None:
        """Advance this loop's cache by one token that exited at an earlier loop, whose cache is `source`.

        The block is shared across loops, so the exit loop's in-projection of the token's (frozen)
        input is exactly what this loop would compute: its raw conv input and dt are reused, and no
        projection runs. write=False (`ssm_skip`): the conv history takes the raw input, the SSM state
        is left as it is (dt = 0). write=True (`ssm_propagate`): this loop's conv over its own history
        gives x and B, and the state is decayed and written with the exit loop's dt (output path skipped).
        rows: (b,) indices of the rows to advance.
        """
        xBC = source.last_xBC[rows]  # (b, conv_dim)
        history = cache.conv_state[rows]  # (b, conv_dim, K-1)
        if write:
            w = self.conv1d.weight.squeeze(1)  # (conv_dim, K)
            conv = causal_conv_silu(xBC[:, None].to(history.dtype), w, self.conv1d.bias, history.transpose(1, 2))[:, 0]
            xs, Bm, Cm = conv.split((self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state), dim=-1)
            dt = F.softplus(source.last_dt_raw[rows].float() + self.dt_bias.float())
            _, state = ssd_step(cache.ssm_state[rows], xs.unflatten(-1, (self.nheads, self.headdim)), dt,
                                -torch.exp(self.A_log.float()), Bm.unflatten(-1, (self.ngroups, self.d_state)),
                                Cm.unflatten(-1, (self.ngroups, self.d_state)))
            cache.ssm_state[rows] = state.to(cache.ssm_state.dtype)
        if self.d_conv > 1:
            cache.conv_state[rows] = torch.cat([history[..., 1:], xBC[..., None].to(history.dtype)], dim=-1)
        if cache.last_xBC is None:
            cache.last_xBC, cache.last_dt_raw = torch.zeros_like(source.last_xBC), torch.zeros_like(source.last_dt_raw)
        cache.last_xBC[rows], cache.last_dt_raw[rows] = xBC.to(cache.last_xBC.dtype), source.last_dt_raw[rows]

    # ------------------------------------------------------------------ cache / cost
    def allocate_cache(self, batch_size: int, max_len: int, device, dtype) -> SSMCache:
        """Constant-size state (max_len is not needed); the SSM state stays fp32 like the scan."""
        return SSMCache(
            conv_state=torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, device=device, dtype=dtype),
            ssm_state=torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=torch.float32),
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token: projections, conv, and the chunked scan's matmuls.

        Per token and chunk length Q: C·Bᵀ scores (2·Q·n per group), scores·x (2·Q·p per head),
        the chunk-state write and the state read (2·n·p each per head); the intra-chunk products
        are counted over the whole chunk (like attention over all keys). Q is the torch scan's
        chunk_size: the count is one convention for every device (the fused scan, at
        fused_chunk_size, does more intra-chunk work per token for fewer chunk states).
        """
        Q = max(1, min(self.chunk_size, seq_len))
        proj = 2 * (self.in_proj.weight.numel() + self.out_proj.weight.numel())
        conv = 2 * self.conv_dim * self.d_conv
        n, p = self.d_state, self.headdim
        scan = 2 * Q * n * self.ngroups + self.nheads * (2 * Q * p + 4 * n * p)
        return proj + conv + scan


@LAYERS.register("M")
class Mamba2Layer(nn.Module, Layer):
    """Pre-norm residual Mamba-2 layer: x + Mixer(RMSNorm(x)), then optionally x + SwiGLU(RMSNorm(x))."""

    kind = "M"
    title = "Mamba-2"
    supports = Supports(
        cache="ssm",
        compile="a Mamba-2 step keeps no static-shape state yet; decode with compile=False",
        depthwise_routed="routed Mamba-2 states are not batched across loops; use schedule='lockstep'",
        parallel_loops="a Mamba-2 layer's state would have to run loop by loop over time with a shifted input, which "
                       "is not defined here yet; use backbone=llama or loop_schedule=sequential",
        export="Mamba-2 layers would need transformers' hybrid cache conventions, which the export does not "
               "implement; export mamba2 models unrolled with --transformers")

    @classmethod
    def validate(cls, cfg: LoopedLMConfig) -> None:
        cfg.validate_mamba_fields()

    def __init__(self, cfg: LoopedLMConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = Mamba2Mixer.from_config(cfg)
        if cfg.mamba_mlp:
            self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)
        else:
            self.mlp_norm = self.mlp = None

    def forward(self, x, positions, valid=None, cache=None, skip=None):
        x = x + self.mixer(self.norm(x), positions, valid, cache, skip)
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x

    def allocate_cache(self, batch_size, max_len, device, dtype):
        return self.mixer.allocate_cache(batch_size, max_len, device, dtype)

    def flops_per_token(self, seq_len: int) -> int:
        flops = self.mixer.flops_per_token(seq_len)
        if self.mlp is not None:
            flops += 2 * sum(p.numel() for p in self.mlp.parameters())
        return flops
