"""`python -m looplab.bench`: throughput, MFU and memory measured side by side with the references (issue 9).

Parts: `train` (train.py), `mamba2`, `decode`, `data` (data.py); each exposes
`run(threads, quick) -> dict`. common.py holds the shared timing and memory tools.
"""
