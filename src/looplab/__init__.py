"""looplab: looped language models (N⊗R) — StateLoop, looped Mamba-2/hybrid, exit gates."""

import os

# Idle OpenMP threads sleep instead of spinning, unless the user chose otherwise. torch's CPU wheel uses GNU
# OpenMP, which reads this once, when torch is first imported, so it is set here, before any looplab module
# imports torch. Alone on 2 cores it costs nothing measurable; on a shared machine a spinning thread burns the
# time slices its partner needs to reach the next barrier, and each parallel region waits on a descheduled
# thread (docs/performance.md#on-a-shared-machine: beside three busy torch processes the demo trained at 706
# tokens/s spinning and 2,663 sleeping, against 13,500 alone).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
