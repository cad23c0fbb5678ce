"""The GRU state update's computation, as looplab runs it and as an exported folder ships it (state_gru.py).

This file is the GRU's `export_source` (docs/extending.md#bring-your-export-code): `convert to-hf` copies it into the
folder, where the remote code (modeling_looplab.py) mixes `StateUpdate` into its state branch, and looplab's own
`GRUState` mixes in the same class, so the two cannot compute different things. It must stay self-contained: torch
and the standard library only, since the folder runs where looplab is not installed.

    z = σ(W_z h_r + U_z s_{r−1} + b_z)              update gate
    g = σ(W_g h_r + U_g s_{r−1} + b_g)              reset gate
    ŝ = tanh(W_c h_r + U_c (g ⊙ s_{r−1}))
    s_r = (1 − z) ⊙ s_{r−1} + z ⊙ ŝ                 retention 1 − z
"""

import torch
import torch.nn as nn


class StateUpdate:
    """Mixed into a state branch (an nn.Module): `build_update` creates the rule's parameters on it, under the names
    looplab's checkpoints use; `update` computes (s_r, retention)."""

    def build_update(self, d, ds):
        self.gate_in = nn.Linear(d, 2 * ds)  # [W_z; W_g], [b_z; b_g]
        self.gate_state = nn.Linear(ds, 2 * ds, bias=False)  # [U_z; U_g]
        self.cand_in = nn.Linear(d, ds, bias=False)  # W_c
        self.cand_state = nn.Linear(ds, ds, bias=False)  # U_c

    def update(self, h, s_prev):
        z, g = torch.sigmoid(self.gate_in(h) + self.gate_state(s_prev)).chunk(2, dim=-1)
        cand = torch.tanh(self.cand_in(h) + self.cand_state(g * s_prev))
        return (1 - z) * s_prev + z * cand, 1 - z
