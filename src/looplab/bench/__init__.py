"""`python -m looplab.bench`: throughput, MFU and memory measured side by side with the references.

Parts: `train` (train.py), `mamba2`, `decode`, `overhead` (decode_overhead.py), `data`, `router`; each
exposes `run(threads, quick) -> dict`. common.py holds the one timer (`time_round_robin`) and the memory
tools. Run on their own: the decoding benchmarks of trained checkpoints (exit_grid, speculative,
routed_decode; trained_runs.py reads their run folders), router_kv and fsdp_traffic.
"""
