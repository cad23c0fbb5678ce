"""Which loop's readout each token's prediction uses (docs/formulations.md#exit-gate): the ExitPolicy a caller hands to a forward.

`LoopedLM.forward` runs the loops and the readout; what is read out is chosen here, by the policy:

    exits=None              the last loop's readout (the coda runs on it only); with return_all_loops,
                            every loop's logits and, with a gate, its exit distribution
    ExitPolicy(at_step=t)   every token at depth t
    ExitPolicy(threshold=q, rule=...)
                            each token at the first depth where the rule stops it (exit_rules.first_exit;
                            rule "gate": the Ouro gate's CDF ≥ q), no earlier than min_loops
    ExitPolicy(expected=True)
                            Σ_t p(t)·logits_t under the gate's distribution (stage-1 gate training)
    ExitPolicy(skip=HANDLING, steps=S | threshold/rule)
                            the loops after a token's exit are not run for it (exit_compute.forward_with_exits:
                            the reference of skip decoding and exit-aware training's forward)

Cached decoding (models/generation.py: plain steps, exit rules with skip handling, self-speculation) takes
the same policy; every decoder runs its loops through `LoopedLM.run_loops` and reads depths through
`LoopedLM.logits_at`, and none is chosen by a flag of `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looplab.models.exit_compute import forward_with_exits, resolve_handling, skip_compute_unsupported
from looplab.models.exit_gate import exit_distribution, logits_at_depth
from looplab.models.exit_rules import check_rule, first_exit, get_rule, zero_shot_rules
from looplab.models.outputs import LoopedLMOutput

@dataclass(frozen=True)
class ExitPolicy:
    """Which depth each token's prediction reads, for a forward or a decoder (see the module docstring).
    The flat keys of the CLIs and the lm-eval adapter build one with `from_kwargs`."""

    threshold: float | None = None  # the rule's threshold (gate: q in (0, 1])
    rule: str | None = None  # a registered exit rule (models/registry.py EXIT_RULES); None = "gate"
    min_loops: int = 1  # no token stops before this loop
    at_step: int | None = None  # every token at this depth (1-based)
    expected: bool = False  # the gate-weighted mixture of every depth's logits
    skip: str | None = None  # a skip handling (kv_copy | ssm_skip | ssm_propagate): later loops not run
    steps: torch.Tensor | None = None  # (B, T) 1-based exit steps given, with skip

    def __post_init__(self):
        if self.rule is not None and self.threshold is None:
            raise ValueError(f"exit_rule={self.rule!r} needs exit_threshold (the rule's threshold)")
        if self.skip is not None:
            object.__setattr__(self, "skip", resolve_handling(self.skip))
        if self.steps is not None and self.skip is None:
            raise ValueError("exit_steps needs skip_compute (kv_copy, ssm_skip or ssm_propagate), got skip_compute=None")

    @property
    def rule_name(self) -> str:
        return self.rule or "gate"

    def check(self, model, n_loops: int) -> None:
        """Refuse, naming the option, what this model cannot do at depth n_loops (before anything runs)."""
        if self.threshold is not None:
            if get_rule(self.rule).reads == "exit_probs" and model.exit_gate is None:
                raise ValueError(f"exit_rule={self.rule_name!r} needs a model with an exit gate (exit_gate=ouro), or "
                                 f"a zero-shot exit_rule ({', '.join(zero_shot_rules())})")
            check_rule(self.rule_name, self.threshold, self.min_loops, n_loops)
        if self.skip is not None:
            reason = skip_compute_unsupported(model.config, self.rule, self.skip)
            if reason:
                raise ValueError(reason)
            if self.threshold is None and self.steps is None:
                raise ValueError(f"skip_compute={self.skip} needs exit_threshold=q (the depth at which a token stops)")

    @classmethod
    def from_kwargs(cls, exit_threshold=None, exit_rule=None, exit_min_loops: int = 1, exit_at_step=None,
                    expected_exit: bool = False, skip_compute=None, exit_steps=None) -> "ExitPolicy | None":
        """The policy of the flat keys (`python -m looplab.generate exit_threshold=...`, lm-eval model_args);
        None when they ask for nothing."""
        skip = resolve_handling(skip_compute)
        if (exit_threshold is None and exit_rule is None and exit_at_step is None and not expected_exit
                and skip is None and exit_steps is None):
            return None
        return cls(exit_threshold, exit_rule, exit_min_loops, exit_at_step, bool(expected_exit), skip, exit_steps)


def forward_with_skips(model, input_ids, attention_mask, policy: ExitPolicy, n_loops, targets=None, cache=None,
                       **unsupported) -> LoopedLMOutput:
    """A forward in which each token stops running loops after its exit (exit_compute.forward_with_exits); the
    output holds every loop's logits (with targets: each token's loss at its exit instead). cache: a prefill under
    the same rule (the cache's deeper entries of an exited token hold its exit loop's)."""
    unsupported = {**unsupported, "exit_at_step": policy.at_step, "expected_exit": policy.expected}
    bad = [k for k, v in unsupported.items() if v not in (None, False)]
    if bad:
        raise ValueError(f"skip_compute={policy.skip!r} runs the cache-free exit reference, which does not take "
                         f"{', '.join(bad)}; call the model without them")
    return forward_with_exits(model, input_ids, policy.steps, policy.skip, attention_mask, rule=policy.rule_name,
                              threshold=policy.threshold, min_loops=policy.min_loops, n_loops=n_loops, targets=targets,
                              cache=cache)


def read_depths(model, readouts: list[torch.Tensor], policy: ExitPolicy | None, return_all_loops: bool,
                positions, valid, cache, diagnostics: dict, targets: torch.Tensor | None = None) -> LoopedLMOutput:
    """The output of a forward from its loops' readouts (R′ of (B, T, d)), as the policy asks. With targets
    (a training loss, policy None): per-token losses instead of logits (`token_loss`, `loop_token_loss`)."""
    R = len(readouts)
    if policy is None and not return_all_loops:  # the coda on the last readout only
        z = model.final_norm(model.coda_at(readouts[-1], R - 1, positions, valid, cache))
        if targets is not None:
            return LoopedLMOutput(logits=None, token_loss=model.token_losses(z, targets), diagnostics=diagnostics)
        return LoopedLMOutput(logits=model.head(z), diagnostics=diagnostics)

    coda_out = [model.coda_at(z, r, positions, valid, cache) for r, z in enumerate(readouts)]
    loop_hidden = model.final_norm(torch.stack(coda_out))  # (R′, B, T, d)
    if targets is not None:  # every depth's loss, never every depth's (R′, B, T, V) logits
        if policy is not None:
            raise ValueError("forward(targets=...) reads the last loop or every loop (return_all_loops); an exit "
                             "policy picks logits per token: call without targets")
        loop_losses = model.token_losses(loop_hidden, targets[None].expand(R, *targets.shape))  # (R′, B, T)
        out = LoopedLMOutput(logits=None, loop_hidden=loop_hidden, token_loss=loop_losses[-1],
                             loop_token_loss=loop_losses, diagnostics=diagnostics)
    else:
        loop_logits = model.head(loop_hidden)  # (R′, B, T, V)
        out = LoopedLMOutput(logits=loop_logits[-1], loop_logits=loop_logits, loop_hidden=loop_hidden,
                             diagnostics=diagnostics)
    if model.exit_gate is not None:
        out.exit_gate_logits = model.exit_gate.logit(loop_hidden).permute(1, 2, 0)  # (B, T, R′)
        out.exit_probs = exit_distribution(torch.sigmoid(out.exit_gate_logits))
    if policy is None:
        return out
    B, T = loop_logits.shape[1:3]
    device = loop_logits.device
    if policy.at_step is not None:
        if not 1 <= policy.at_step <= R:
            raise ValueError(f"exit_at_step={policy.at_step} must lie in 1..{R} (the loops this call runs)")
        out.exit_steps = torch.full((B, T), policy.at_step, dtype=torch.long, device=device)
    elif policy.threshold is not None or policy.expected:
        rule = policy.rule or "gate"
        if out.exit_probs is None and (policy.expected or get_rule(rule).reads == "exit_probs"):
            raise ValueError("exit_threshold / expected_exit need a model with an exit gate (exit_gate=ouro), "
                             f"or a zero-shot exit_rule ({', '.join(zero_shot_rules())})")
        if policy.expected:
            out.logits = torch.einsum("btr,rbtv->btv", out.exit_probs.to(loop_logits.dtype), loop_logits)
            steps = torch.arange(1, R + 1, device=device, dtype=out.exit_probs.dtype)
            out.diagnostics["expected_exit_step"] = [float((out.exit_probs.detach() * steps).sum(-1).mean())]
        else:
            out.exit_steps = first_exit(rule, policy.threshold, R, min_loops=policy.min_loops, logits=loop_logits,
                                        hidden=loop_hidden, exit_probs=out.exit_probs)
    if out.exit_steps is not None:
        out.logits = logits_at_depth(loop_logits, out.exit_steps)
    return out
