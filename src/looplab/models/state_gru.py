"""A GRU update of the StateLoop state (Cho et al. 2014; docs/formulations.md#stateloop): the gates read both the
block output h_r and the state s_{r−1}, where StateLoop's selective update reads h_r only.

    z = σ(W_z h_r + U_z s_{r−1} + b_z)              update gate: how much of the candidate enters
    g = σ(W_g h_r + U_g s_{r−1} + b_g)              reset gate: how much of s_{r−1} the candidate sees
    ŝ = tanh(W_c h_r + U_c (g ⊙ s_{r−1}))
    s_r = (1 − z) ⊙ s_{r−1} + z ⊙ ŝ                 retention 1 − z

b_z starts at `update_bias` (σ(−1) ≈ 0.27: the state keeps most of its past at first); the other biases at 0.
W_o is zero at init, as for every update rule: the untrained model is Vanilla Looped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from looplab.models.state import StateBranch


class GRUState(StateBranch):
    @dataclass
    class Options:
        update_bias: float = -1.0  # b_z at init

    def build_update(self, d, ds):
        self.gate_in = nn.Linear(d, 2 * ds)  # [W_z; W_g], [b_z; b_g]
        self.gate_state = nn.Linear(ds, 2 * ds, bias=False)  # [U_z; U_g]
        self.cand_in = nn.Linear(d, ds, bias=False)  # W_c
        self.cand_state = nn.Linear(ds, ds, bias=False)  # U_c

    def update(self, h, s_prev):
        z, g = torch.sigmoid(self.gate_in(h) + self.gate_state(s_prev)).chunk(2, dim=-1)
        cand = torch.tanh(self.cand_in(h) + self.cand_state(g * s_prev))
        return (1 - z) * s_prev + z * cand, 1 - z

    def reset_update_parameters(self, generator=None):
        ds = self.cand_state.weight.shape[0]
        self.gate_in.bias.zero_()
        self.gate_in.bias[:ds].fill_(self.options.update_bias)

    def update_flops(self, d, ds):
        return 2 * (3 * d * ds + 3 * ds * ds) + 12 * ds
