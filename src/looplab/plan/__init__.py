"""`python -m looplab.plan`: a dry run of a training configuration, before any node is booked (docs/scale.md).

    python -m looplab.plan +experiment=lm_1.4b trainer.num_nodes=1 trainer.devices=8 plan.gpu=h100 [plan.out=plan.json]

It builds what `python -m looplab.train` would build with the same overrides, through the same functions, on fake
tensors with a fake process group of the run's world size, and runs one whole optimizer step (plan/step.py). It
reports, per GPU: the peak memory by category and whether it fits; the collectives of a step; the FLOPs of a step
with causal attention counted as causal; a roofline step time on the named GPU plus the collectives' time at a
stated bandwidth (plan/cost.py, plan/gpus.py), hence tokens/s and an estimated MFU. When it does not fit it says by
how much and proposes the largest micro-batch, and the activation-checkpointing setting, that fit at the same global
batch. Every time and MFU is an estimate and is labelled so.
"""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig, OmegaConf

from looplab.plan.gpus import GPUS, get_gpu

GiB = 2**30
REQUIRED_KEYS = ("fits", "peak_bytes", "capacity_bytes", "breakdown", "micro_batch", "grad_accum",
                 "collective_bytes_per_step", "flops_per_step", "est_step_s", "est_mfu")

__all__ = ["GPUS", "REQUIRED_KEYS", "ac_candidates", "compose", "plan", "format_plan"]


def ac_candidates() -> tuple[Any, ...]:
    """What `hardware.activation_checkpointing` can be set to, as the proposal tries them: off, then every mode the
    model knows (models/checkpointing.py MODES: a new mode is one more candidate), or true where it has no modes."""
    try:
        from looplab.models.checkpointing import MODES
    except ImportError:
        return (False, True)
    return (False, *MODES)


def compose(overrides: list[str]) -> DictConfig:
    """conf/plan.yaml (conf/train.yaml plus the `plan` node) with `python -m looplab.train`'s overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from looplab.tables.sweeps import CONF

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return hydra_compose(config_name="plan", overrides=list(overrides))


def _with(cfg: DictConfig, **values: Any) -> DictConfig:
    """A copy of cfg with dotted keys set (`_with(cfg, **{"dataset.batch_size": 64})`)."""
    out = copy.deepcopy(cfg)
    OmegaConf.set_struct(out, False)
    for key, value in values.items():
        OmegaConf.update(out, key, value, force_add=True)
    return out


def capacity_bytes(cfg: DictConfig) -> int:
    """Memory a run may use per GPU: the card's (or plan.memory_gib), less plan.reserve_gib."""
    gpu = get_gpu(OmegaConf.select(cfg, "plan.gpu", default="h100"))
    memory = OmegaConf.select(cfg, "plan.memory_gib", default=None)
    reserve = float(OmegaConf.select(cfg, "plan.reserve_gib", default=2.0) or 0.0)
    return int((gpu.memory_bytes if memory is None else float(memory) * GiB) - reserve * GiB)


def _figures(cfg: DictConfig, m, gpu) -> dict[str, Any]:
    """A Measurement → the plan's figures (the JSON keys)."""
    import torch

    cap = capacity_bytes(cfg)
    world = m.world
    sequences = m.micro_batch * world * m.grad_accum  # sequences per optimizer step, all ranks
    tokens = sequences * m.seq_len
    model_flops = m.flops - m.recompute_flops
    step = m.compute_seconds + m.collective_seconds
    peak = gpu.peak_flops(torch.bfloat16 if "16" in m.precision else torch.float32)
    return {
        "fits": m.peak_bytes <= cap,
        "peak_bytes": m.peak_bytes,
        "capacity_bytes": cap,
        "over_by_bytes": max(0, m.peak_bytes - cap),
        "breakdown": dict(m.breakdown),
        "tracker_breakdown": dict(m.tracker_breakdown),
        "micro_batch": m.micro_batch,
        "grad_accum": m.grad_accum,
        "global_batch": sequences,
        "seq_len": m.seq_len,
        "tokens_per_step": tokens,
        "world_size": world,
        "activation_checkpointing": m.activation_checkpointing,
        "collective_bytes_per_step": m.collective_bytes,
        "collectives": m.collectives,
        "flops_per_step": m.flops * world,
        "flops_per_gpu_step": m.flops,
        "recompute_flops_per_step": m.recompute_flops * world,
        "est_compute_s": m.compute_seconds,
        "est_comm_s": m.collective_seconds,
        "est_step_s": step,
        "est_step_s_overlapped": max(m.compute_seconds, m.collective_seconds),
        "est_tokens_per_s": tokens / step if step else None,
        "est_mfu": model_flops / (step * peak) if step else None,
        "est_hbm_bytes_per_gpu_step": m.bytes_moved,
        "est_top_ops_s": m.top_ops,
    }


def plan(cfg: DictConfig, overrides: list[str] | None = None) -> dict[str, Any]:
    """The plan of one configuration (module docstring): a JSON-ready dict with at least REQUIRED_KEYS.
    overrides: the command line it was composed from, recorded in the plan."""
    from looplab.plan.step import measure, world_of

    gpu = get_gpu(OmegaConf.select(cfg, "plan.gpu", default="h100"))
    world, per_node = world_of(cfg)
    m = measure(cfg, gpu)
    out = {
        "config": {"overrides": list(overrides or []),
                   "task_name": cfg.get("task_name"), "backbone": cfg.backbone.get("name"),
                   "loop_depth": f"{cfg.loop_depth.layers}x{cfg.loop_depth.loops}", "state_mode": cfg.state_mode.get("name"),
                   "parameters": m.parameters, "vocab_size": m.vocab_size},
        "gpu": {"key": str(cfg.plan.gpu).lower(), **gpu.to_dict()},
        "nodes": world // per_node, "devices_per_node": per_node,
        "accelerator": m.accelerator, "precision": m.precision, "strategy": m.strategy, "compile": m.compiled,
        "faked_on": f"fake {m.device} tensors, fake process group of {world} ranks",
        **_figures(cfg, m, gpu),
        "notes": list(m.notes),
        "estimates": ("est_* are estimates: the roofline of torch's RuntimeEstimator on the GPU table's peak FLOP/s (75%) "
                      "and HBM bandwidth, plus ring collectives at its NVLink / inter-node bandwidth, not overlapped; "
                      "MFU counts model FLOPs (recomputation excluded, causal attention as causal)"),
    }
    if not out["fits"] and OmegaConf.select(cfg, "plan.propose", default=True):
        out["proposal"] = propose(cfg, m, gpu)
    return out


def propose(cfg: DictConfig, base, gpu) -> dict[str, Any]:
    """The largest micro-batch that fits at each activation-checkpointing setting, the global batch kept (sequences
    per rank per step = micro-batch × accumulation), and the fastest of them (estimated step time).

    A setting's peak is predicted from its last measured step as fixed + per-sequence × micro-batch (activations
    and temporaries scale with the micro-batch; parameters, gradients and optimizer state do not); the largest
    divisor predicted to fit is measured, then smaller ones until one fits, and the next larger one when the
    prediction put it within 10% of the capacity. Every figure in the proposal is measured, none predicted."""
    from looplab.plan.step import measure

    cap = capacity_bytes(cfg)
    world = base.world
    per_rank = base.micro_batch * base.grad_accum
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]

    def candidate(ac, micro):
        return _with(cfg, **{"hardware.activation_checkpointing": ac, "dataset.micro_batch": micro,
                             "trainer.accumulate_grad_batches": per_rank // micro})

    def entry(ac, m):
        fig = _figures(candidate(ac, m.micro_batch), m, gpu)
        return {"activation_checkpointing": ac, "micro_batch": m.micro_batch, "grad_accum": per_rank // m.micro_batch,
                "peak_bytes": m.peak_bytes, "fits": fig["fits"], "est_step_s": fig["est_step_s"],
                "est_tokens_per_s": fig["est_tokens_per_s"], "est_mfu": fig["est_mfu"],
                "overrides": [f"hardware.activation_checkpointing={str(ac).lower()}", f"dataset.micro_batch={m.micro_batch}"]}

    def predicted(m, micro):
        scaled = m.breakdown["activations"] + m.breakdown["temporaries"]
        return m.peak_bytes - scaled + scaled / m.micro_batch * micro

    tried: list[dict[str, Any]] = []
    configured = base.activation_checkpointing
    for ac in ac_candidates():
        same = ac == configured or (ac is False and configured in (None, "none", "false"))
        measured = {base.micro_batch: base} if same else {}
        ref = base if same else measure(candidate(ac, base.micro_batch), gpu)
        measured[ref.micro_batch] = ref
        fits = {}
        while True:
            fits.update({d: m.peak_bytes <= cap for d, m in measured.items()})
            best = max((d for d, ok in fits.items() if ok), default=None)
            smaller_fail = min((d for d, ok in fits.items() if not ok), default=per_rank + 1)
            if best is not None:  # a fit: look up only at a borderline next divisor
                up = [d for d in divisors if best < d < smaller_fail and d not in measured]
                nxt = up[0] if up and predicted(measured[best], up[0]) <= 1.1 * cap else None
            else:
                down = [d for d in sorted(divisors, reverse=True) if d < smaller_fail and d not in measured]
                if not down:
                    break
                last = measured[min(measured)]
                nxt = next((d for d in down if predicted(last, d) <= cap), down[-1])
            if nxt is None:
                break
            measured[nxt] = measure(candidate(ac, nxt), gpu)
        tried += [entry(ac, measured[d]) for d in sorted(measured)]
    fitting = [t for t in tried if t["fits"]]
    largest = {}
    for t in fitting:
        key = str(t["activation_checkpointing"])
        if key not in largest or t["micro_batch"] > largest[key]["micro_batch"]:
            largest[key] = t
    best = min(largest.values(), key=lambda t: t["est_step_s"]) if largest else None
    return {"global_batch": per_rank * world, "best": best, "largest_fitting": list(largest.values()), "tried": tried,
            "note": None if best else f"nothing fits on {gpu.name} at the global batch of {per_rank * world} sequences, "
                                      "even at a micro-batch of 1 with every activation-checkpointing setting; "
                                      "use more GPUs (trainer.num_nodes / trainer.devices) or a larger card"}


def _size(n: float) -> str:
    """Bytes as GiB (MiB, KiB, B below one of them)."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.{1 if unit == 'GiB' else 2}f} {unit}"
    return f"{int(n)} B"


def format_plan(p: dict[str, Any]) -> str:
    """The plan as the lines `python -m looplab.plan` prints."""
    c, g = p["config"], p["gpu"]
    b = p["breakdown"]
    lines = [
        f"plan: {c['task_name']} · {c['backbone']} {c['loop_depth']} {c['state_mode']} · "
        f"{c['parameters'] / 1e9:.3g}B parameters · "
        f"{p['strategy']} on {p['nodes']}×{p['devices_per_node']} {g['name']}"
        + (" (a CPU run, planned against this GPU)" if p.get("accelerator") == "cpu" else "") + f" · {p['precision']} · "
        f"activation checkpointing {p['activation_checkpointing']} · compile {p['compile']}",
        f"batch: {p['global_batch']} sequences × {p['seq_len']} tokens per optimizer step ({p['tokens_per_step']:,} tokens): "
        f"micro-batch {p['micro_batch']} per GPU × accumulation {p['grad_accum']} × {p['world_size']} GPUs",
        f"peak memory per GPU: {_size(p['peak_bytes'])} of {_size(p['capacity_bytes'])} usable — "
        + ("fits" if p["fits"] else f"does NOT fit (over by {_size(p['over_by_bytes'])})"),
        "  at the peak: " + " · ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in b.items()),
        "collectives per optimizer step, per GPU: " + (", ".join(
            f"{k} {v['count']}× ({_size(v['bytes'])})" for k, v in p["collectives"].items()) or "none"),
        f"FLOPs per optimizer step (all GPUs, causal attention as causal): {p['flops_per_step']:.4g}"
        + (f" (recomputation {p['recompute_flops_per_step']:.3g})" if p["recompute_flops_per_step"] else ""),
        f"estimated step time on {g['key']}: compute {p['est_compute_s']:.3f} s + communication {p['est_comm_s']:.3f} s = "
        f"{p['est_step_s']:.3f} s → estimated {p['est_tokens_per_s']:,.0f} tokens/s, estimated MFU {100 * p['est_mfu']:.1f}%",
    ]
    prop = p.get("proposal")
    if prop:
        best = prop["best"]
        if best:
            lines.append(f"proposal (global batch kept at {prop['global_batch']} sequences): micro-batch {best['micro_batch']} "
                         f"per GPU × accumulation {best['grad_accum']}, "
                         f"activation checkpointing {best['activation_checkpointing']}: "
                         f"peak {_size(best['peak_bytes'])}, estimated {best['est_tokens_per_s']:,.0f} tokens/s, "
                         f"estimated MFU {100 * best['est_mfu']:.1f}%")
            lines.append("  overrides: " + " ".join(best["overrides"]))
        else:
            lines.append("proposal: " + prop["note"])
        for t in prop["tried"]:
            lines.append(f"  tried: activation checkpointing {t['activation_checkpointing']}, micro-batch {t['micro_batch']}: "
                         f"peak {_size(t['peak_bytes'])} ({'fits' if t['fits'] else 'does not fit'})")
    for n in p.get("notes") or []:
        lines.append(f"note: {n}")
    return "\n".join(lines)
