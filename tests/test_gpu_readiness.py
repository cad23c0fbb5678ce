"""Decoding that survives its first GPU, checked on the CPU (docs/decoding.md#on-a-gpu).

What a GPU run would hit first, each reproduced here without one: bf16 models and fp32 models under
`torch.autocast("cpu", torch.bfloat16)` through every decoder and both serving schedules (the dtype matrix); more
compiled decoders than Dynamo's recompile limit; a compiled decoder outliving its model; the logits a long `generate`
keeps; the cache buffers a CUDA graph needs at fixed addresses; the lockstep engine's gathering copies; host-device
syncs per step (`looplab.testing.syncs.HostSyncs` counts what would make a GPU wait); the engine's decode timer; the
bookkeeping that grew for an engine's life.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from looplab.models import ExitPolicy, LoopedLM, LoopedLMConfig, generation
from looplab.models.cache import KVCache
from looplab.models.generation import decode_one_token, generate, prefill
from looplab.serve import Engine
from looplab.testing import decode_matrix as matrix
from looplab.testing.syncs import HostSyncs

pytestmark = pytest.mark.usefixtures("one_thread_module")

V = 61
# bf16's rounding as measured here: batched and solo decoding of these models differ by at most 0.031 in a logit
# (self-speculation's verify, which runs γ+1 positions at once; every other decoder: 0); twice that is a tie
BF16_TIE = 0.0625


def make(seed: int = 0, **kw) -> LoopedLM:
    return matrix.make(seed, **kw)


def prompts(n=(3, 7, 5, 6), seed=3):
    return matrix.prompts(n, seed)


def padded(ps):
    return matrix.padded(ps)


# ------------------------------------------------------------------ the dtype matrix
@pytest.mark.parametrize("mode", matrix.DTYPES)
@pytest.mark.parametrize("name", matrix.DECODERS)
def test_every_decoder_in_every_dtype_gives_each_row_its_solo_tokens(name, mode):
    assert matrix.decoder_agrees(name, mode, 1e-4 if mode == "fp32" else BF16_TIE) == []


@pytest.mark.parametrize("mode", matrix.DTYPES)
@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
@pytest.mark.parametrize("name", matrix.ENGINES)
def test_both_serving_schedules_in_every_dtype(name, schedule, mode):
    got = matrix.engine_agreement(name, schedule, mode, 1e-4 if mode == "fp32" else BF16_TIE)
    if got is None:  # parallel loops under depth-wise batching: refused by name
        assert name == "plain_parallel" and schedule == "depthwise"
        return
    assert got["equal"] + got["ties"] == 6, got["differences"]


def test_exit_probabilities_are_float32_in_every_path_of_a_bf16_model():
    """One accumulation dtype for the gate's λ, survival and p(t): a bf16 product in one path and a float32 one in
    another picked other exit depths for a few tokens."""
    model = make(exit_gate="ouro").to(torch.bfloat16)
    ids, _ = padded(prompts())
    with torch.no_grad():
        out = model(ids, return_all_loops=True)
        assert out.exit_probs.dtype == torch.float32 and out.loop_logits.dtype == torch.bfloat16
        assert model.exit_gate(out.loop_hidden).dtype == torch.float32
        engine = Engine(model, max_batch=2, max_len=32, exits=ExitPolicy(threshold=0.5, skip="kv_copy"),
                        schedule="depthwise")
        assert engine.depthwise.probs.dtype == torch.float32 and engine.depthwise.survival.dtype == torch.float32


# ------------------------------------------------------------------ compiled decoders
@pytest.fixture
def eager_dynamo(monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(generation, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny(**kw):
    torch.manual_seed(0)
    return LoopedLM(LoopedLMConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, n_loops=2, max_seq_len=256,
                                   **kw)).eval()


def test_more_compiled_decoders_than_dynamos_recompile_limit(eager_dynamo):
    """Each decoder compiles its own copy of the step's code: ten (batch, length bucket) decoders, past Dynamo's
    limit of 8 variants per code object, each still one graph."""
    model = tiny()
    ids = torch.randint(0, 64, (10, 3), generator=torch.Generator().manual_seed(0))
    for b in range(1, 11):
        assert torch.equal(generate(model, ids[:b], 2, compile=True), generate(model, ids[:b], 2))
    assert len(model._compiled_decoders) == generation.MAX_COMPILED


def test_compiled_decoders_go_with_their_model(eager_dynamo):
    model = tiny()
    generate(model, torch.tensor([[1, 2, 3]]), 2, compile=True)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "a compiled decoder kept its model (and its static caches) alive"


def test_a_compiled_step_mutates_only_static_addresses_and_hands_out_a_copy(eager_dynamo):
    """CUDA-graph trees capture a step only when what it mutates keeps its address: every cache buffer is marked
    static, and the logits come out of the graph's memory cloned."""
    model = tiny()
    dec = generation.compiled_decoder(model, 2, 16, 2, "reduce-overhead")
    buffers = list(dec.cache.buffers())
    assert len(buffers) >= 5 and all(getattr(t, "_dynamo_static_input_type", None) for t in buffers)
    dec.prefill(torch.tensor([[1, 2], [3, 4]]))
    logits = dec.decode(torch.tensor([5, 6]))
    ptrs = {t.untyped_storage().data_ptr() for t in buffers}
    assert logits.untyped_storage().data_ptr() not in ptrs and logits.shape == (2, 64)


# ------------------------------------------------------------------ memory of a long generate
def test_a_long_generate_keeps_only_the_tokens():
    """Without return_logits, generate keeps no step's (B, V) logits: at V 50,000, batch 8 and 400 tokens they were
    640 MB (peak resident memory, glibc made to return large blocks at once so the peak shows what is held)."""
    code = textwrap.dedent("""
        import resource, torch
        from looplab.models import LoopedLM, LoopedLMConfig
        torch.set_num_threads(1)
        torch.manual_seed(0)
        m = LoopedLM(LoopedLMConfig(vocab_size=50000, d_model=16, n_heads=2, n_layers=1, n_loops=1,
                                    max_seq_len=512)).eval()
        ids = torch.randint(0, 50000, (8, 4))
        m.generate(ids, 2)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m.generate(ids, 400)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
    """)
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) < 100, f"peak resident memory grew by {out.stdout.strip()} MB"


# ------------------------------------------------------------------ the engine on a GPU
def test_lockstep_engine_reads_whole_buffers_when_every_row_runs(monkeypatch):
    """With every row running, the lockstep step writes and reads the cache's buffers as they are: no gathering copy
    of each row's key/value prefix at every attention call."""
    gathered = []
    update = KVCache.update

    def spy(self, k, v):
        gathered.append(self.owner.step.rows is not None)
        return update(self, k, v)

    monkeypatch.setattr(KVCache, "update", spy)
    model = make()
    engine = Engine(model, max_batch=3, max_len=32)
    for p in prompts((3, 6, 4)):
        engine.add(p, 6)
    engine.step()  # admissions (each prefill its own row) and a step of every row
    gathered.clear()
    engine.step()
    assert gathered and not any(gathered)


def _step_syncs(engine, warm=3):
    for _ in range(warm):
        engine.step()
    with HostSyncs() as syncs:
        engine.step()
    return syncs


@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
def test_an_engine_step_syncs_a_constant_number_of_times(schedule):
    """Host syncs per step do not grow with the rows, the cache entries or the loops: depth-wise batching sends one
    index tensor and reads one decision and the tokens; lockstep reads the tokens, and with a skip handling which
    rows still run after each loop (one transfer per loop: gathering them is what saves their compute)."""
    counts = {}
    for rows, layers, loops in ((4, 1, 2), (12, 1, 2), (4, 3, 2), (4, 1, 4)):
        torch.manual_seed(0)
        model = LoopedLM(LoopedLMConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=layers, n_loops=loops,
                                        exit_gate="ouro", max_seq_len=64)).eval()
        engine = Engine(model, max_batch=rows, max_len=64, exits=ExitPolicy(threshold=0.5, skip="kv_copy"),
                        schedule=schedule)
        for p in prompts((5,) * rows, seed=rows):
            engine.add(p, 40)
        syncs = _step_syncs(engine)
        counts[(rows, layers, loops)] = syncs.count
        limit = 4 if schedule == "depthwise" else 1 + (loops - 1)
        assert syncs.count <= limit, (rows, layers, loops, syncs.report())
    if schedule == "depthwise":
        assert len(set(counts.values())) == 1, counts
    else:  # constant in rows and entries; one more per loop
        assert counts[(4, 1, 2)] == counts[(12, 1, 2)] == counts[(4, 3, 2)], counts


@pytest.mark.parametrize("name, options", [("plain", {}), ("exit_readout", dict(exits=ExitPolicy(threshold=0.5))),
                                           ("parallel", {})])
def test_plain_exit_and_parallel_decoding_never_sync(name, options):
    cfg = {"plain": {}, "exit_readout": dict(exit_gate="ouro"),
           "parallel": dict(loop_schedule="parallel", loop_kv="gswa", loop_window=4)}[name]
    model = make(**cfg)
    ids, mask = padded(prompts())
    with torch.no_grad():
        cache = model.allocate_cache(4, 24)
        logits, _ = prefill(model, ids, mask, cache, 3, options.get("exits"))
        tok = logits.argmax(-1)
        with HostSyncs() as syncs:
            for _ in range(5):
                logits, _ = decode_one_token(model, tok, cache, **options)
                tok = logits.argmax(-1)
    assert syncs.count == 0, syncs.report()
    with HostSyncs() as syncs:  # generate itself: per token nothing, and one check with eos
        out = generate(model, ids, 6, attention_mask=mask, eos_token_id=0, **options)
    per_token = syncs.count / 6
    assert out.shape[1] == ids.shape[1] + 6 and per_token <= 1 + 5 / 6, syncs.report()


def test_sampling_draws_without_a_host_sync():
    probs = torch.softmax(torch.randn(4, V), -1)
    with HostSyncs() as syncs:
        generation.draw(probs, torch.Generator().manual_seed(0))
    assert syncs.count == 0
    counts = torch.zeros(5)  # and it draws from p: 20,000 draws of a 5-way distribution
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    tokens = generation.draw(p.expand(20000, 5), torch.Generator().manual_seed(1))
    counts += torch.bincount(tokens, minlength=5)
    torch.testing.assert_close(counts / 20000, p, atol=0.015, rtol=0)


def test_the_decode_timer_stops_after_the_step_reads_the_device():
    """On a GPU a step's kernels run after the host has moved on; the decode time is read once the step has waited
    for them (its transfer of the tokens), so it counts them."""
    events = []

    class Spy(HostSyncs):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            before = self.count
            out = super().__torch_function__(func, types, args, kwargs)
            if self.count > before:
                events.append("sync")
            return out

    def clock(_t=[0.0]):
        events.append("clock")
        _t[0] += 1.0
        return _t[0]

    model = make()
    engine = Engine(model, max_batch=2, max_len=32, clock=clock)
    for p in prompts((3, 5)):
        engine.add(p, 6)
    engine.step()
    with Spy():
        events.clear()
        before = engine.stats["decode_s"]
        engine.step()
    assert engine.stats["decode_s"] > before
    last_sync = max(i for i, e in enumerate(events) if e == "sync")
    assert "clock" in events[last_sync:], events


def test_depthwise_decode_timer_counts_every_step():
    """A depth-wise step in which no token leaves (it ran a loop of tokens still in flight) is decoding time too:
    with a clock that ticks once per read, decode_s grows at every step that ran a block call."""
    model = make(exit_gate="ouro")
    ticks = [0.0]

    def clock():
        ticks[0] += 1.0
        return ticks[0]

    engine = Engine(model, max_batch=2, max_len=32, exits=ExitPolicy(threshold=1.1, skip="kv_copy"),
                    schedule="depthwise", clock=clock)  # threshold > 1: every token runs every loop
    for p in prompts((3, 5)):
        engine.add(p, 3)
    engine.step()  # admission and the first loop
    loops_only = 0  # steps whose block call ran and no token left (every token runs all R loops: most steps)
    while engine.depthwise.in_flight:
        before, calls = engine.stats["decode_s"], engine.stats["decode_calls"]
        starting = sum(engine.depthwise.loop[b] < 0 for b in range(2))
        engine.step()
        if engine.stats["decode_calls"] > calls:
            assert engine.stats["decode_s"] > before
            loops_only += starting == 0 and all(engine.depthwise.loop[b] > 0 for b in range(2))
    assert loops_only > 0  # the case under test happened


def test_engine_bookkeeping_is_bounded():
    model = make(exit_gate="ouro")
    engine = Engine(model, max_batch=2, max_len=32, exits=ExitPolicy(threshold=0.5, skip="kv_copy"),
                    schedule="depthwise")
    assert engine.depthwise.block_calls.maxlen is not None
    skip = generation.SkipDecoding(model, ExitPolicy(threshold=0.5, skip="kv_copy"), 3)
    assert skip.block_rows.maxlen is not None
