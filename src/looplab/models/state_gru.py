"""A GRU update of the StateLoop state (Cho et al. 2014; docs/formulations.md#stateloop): the gates read both the
block output h_r and the state s_{r−1}, where StateLoop's selective update reads h_r only.

    z = σ(W_z h_r + U_z s_{r−1} + b_z)              update gate: how much of the candidate enters
    g = σ(W_g h_r + U_g s_{r−1} + b_g)              reset gate: how much of s_{r−1} the candidate sees
    ŝ = tanh(W_c h_r + U_c (g ⊙ s_{r−1}))
    s_r = (1 − z) ⊙ s_{r−1} + z ⊙ ŝ                 retention 1 − z

b_z starts at `update_bias` (σ(−1) ≈ 0.27: the state keeps most of its past at first); the other biases at 0.
W_o is zero at init, as for every update rule: the untrained model is Vanilla Looped.

The computation itself (`build_update`, `update`) lives in state_gru_export.py, the GRU's `export_source`: the file a
`convert to-hf` folder ships for it (docs/extending.md#bring-your-export-code). Only what the export does not need
(the init, the FLOP count, the options) is here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from looplab.models.state import StateBranch
from looplab.models.state_gru_export import StateUpdate


class GRUState(StateUpdate, StateBranch):
    supports = replace(StateBranch.supports, export=True)  # its export code: export_source
    export_source = "looplab.models.state_gru_export"

    @dataclass
    class Options:
        update_bias: float = -1.0  # b_z at init

    def reset_update_parameters(self, generator=None):
        ds = self.cand_state.weight.shape[0]
        self.gate_in.bias.zero_()
        self.gate_in.bias[:ds].fill_(self.options.update_bias)

    def update_flops(self, d, ds):
        return 2 * (3 * d * ds + 3 * ds * ds) + 12 * ds
