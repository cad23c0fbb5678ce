"""python -m looplab.convert from-hf: exact conversion of small random transformers models (offline)."""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM  # noqa: E402

from looplab import convert  # noqa: E402
from looplab.models import LoopedLM  # noqa: E402

LLAMA = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
MAMBA2 = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, expand=2, n_groups=2,
              state_size=16, conv_kernel=4, chunk_size=8)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Perturb every parameter (norm weights and SSM scalars included) so that a swapped or
    missing tensor changes the logits; transformers' init leaves norms at exactly 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _write_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(99)} | {"</s>": 99}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def _save(model, folder, tokenizer: bool = True):
    model.save_pretrained(folder)
    if tokenizer:
        _write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    _randomise(model)
    return _save(model, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mamba2_src(tmp_path_factory):
    torch.manual_seed(0)
    model = Mamba2ForCausalLM(Mamba2Config(**MAMBA2, tie_word_embeddings=True))  # as the released Mamba-2 models
    _randomise(model, seed=1)
    return _save(model, tmp_path_factory.mktemp("mamba2"))


def _logits(folder, ids, mask=None):
    return LoopedLM.from_pretrained(str(folder))(ids, attention_mask=mask).logits


@pytest.mark.parametrize("source", ["llama_src", "mamba2_src"])
def test_n_by_1_conversion_is_exact_and_writes_a_loadable_folder(source, request, tmp_path):
    src = request.getfixturevalue(source)
    out = tmp_path / "out"
    model, diff = convert.from_hf(str(src), out)
    assert diff is not None and diff < 1e-5  # measured ~1e-6 (fp32 reassociation)
    cfg = model.config
    assert cfg.n_loops == 1 and cfg.n_layers == (4 if source == "llama_src" else 2)
    if source == "llama_src":
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.rope_base) == (4, 2, 5000.0)  # GQA and the source's RoPE base kept
    assert cfg.tie_embeddings == (source == "mamba2_src")
    # the folder reads back to the same function, and the tokenizer went along
    ids = torch.randint(0, 100, (2, 12))
    assert torch.equal(_logits(out, ids), model(ids).logits)
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    card = (out / "README.md").read_text()
    assert f"| N⊗R | {cfg.n_layers}⊗1 |" in card and f"| backbone | {cfg.backbone} |" in card


def test_left_padding_is_part_of_the_check(llama_src):
    # the check's third batch is left-padded; a model that ignored the mask would fail it
    batches = convert.random_batches(100)
    assert any(m is not None and not bool(m.all()) for _, m in batches)


def test_retrofit_2x2_equals_transformers_model_with_layers_repeated(llama_src, tmp_path):
    """2⊗2 from a 4-layer source with --sharing cycle = source layers [0, 2] applied as 0,2,0,2:
    compared with an independently built 4-layer transformers model holding those layers' weights."""
    model, diff = convert.from_hf(str(llama_src), tmp_path / "r", loops=2, sharing="cycle")
    assert (model.config.n_layers, model.config.n_loops) == (2, 2)
    assert model.config.extra["block_layers"] == [0, 2]
    src = LlamaForCausalLM.from_pretrained(str(llama_src), dtype=torch.float32).state_dict()
    pattern = [0, 2, 0, 2]
    ref = LlamaForCausalLM(LlamaConfig(**LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    sd = {}
    for k in ref.state_dict():
        if k.startswith("model.layers."):
            i, rest = k[len("model.layers."):].split(".", 1)
            sd[k] = src[f"model.layers.{pattern[int(i)]}.{rest}"]
        else:
            sd[k] = src[k]
    ref.load_state_dict(sd)
    ref.eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = model(ids).logits, ref(input_ids=ids, use_cache=False).logits
    assert float((a - b).abs().max() / b.pow(2).mean().sqrt()) < 1e-5
    assert diff < 1e-5


def test_block_choice_follows_the_sharing_patterns():
    assert convert.choose_block_layers(4, 1, None, None) == [0, 1, 2, 3]
    assert convert.choose_block_layers(4, 2, None, "cycle") == [0, 2]
    assert convert.choose_block_layers(6, 2, None, "middle_cycle") == [1, 3]
    assert convert.choose_block_layers(8, 3, None, "middle_cycle") == [1, 4]
    assert convert.choose_block_layers(4, 3, [3, 1], None) == [3, 1]
    with pytest.raises(convert.ConversionError, match="layers 0..3"):
        convert.choose_block_layers(4, 2, [4], None)
    with pytest.raises(convert.ConversionError, match="not both"):
        convert.choose_block_layers(4, 2, [0], "cycle")
    with pytest.raises(convert.ConversionError, match="cannot fill"):
        convert.choose_block_layers(3, 2, None, "middle_cycle", 1, 1)
    # prelude / coda: the block comes from the layers between them; middle_cycle's own are one each
    assert convert.prelude_coda("middle_cycle", None, None) == (1, 1) and convert.prelude_coda(None, None, 2) == (0, 2)
    assert convert.choose_block_layers(6, 2, None, "middle_cycle", 1, 1) == [1, 3]
    assert convert.choose_block_layers(6, 1, None, None, 2, 1) == [2, 3, 4]
    assert convert.choose_block_layers(6, 2, None, "cycle", 1, 1) == [1, 3]
    with pytest.raises(convert.ConversionError, match="none left"):
        convert.choose_block_layers(4, 1, None, None, 2, 2)
    with pytest.raises(convert.ConversionError, match="negative"):
        convert.prelude_coda(None, -1, 0)


@pytest.mark.parametrize("source", ["llama_src", "mamba2_src"])
def test_prelude_and_coda_from_the_source_s_first_and_last_layers(source, request, tmp_path):
    """--prelude/--coda fill looplab's unshared layers: with the middle layers as a 1-loop block the model is the
    source itself (the built-in check compares with it unchanged); the retrofit P + [block]×R + C equals an
    independently re-stacked transformers model."""
    src = request.getfixturevalue(source)
    n_src = 4 if source == "llama_src" else 2
    model, diff = convert.from_hf(str(src), tmp_path / "pc", prelude=1, coda=1 if n_src > 2 else 0)
    assert (model.config.prelude_layers, model.config.n_loops) == (1, 1) and diff < 1e-5
    assert model.config.n_layers == n_src - 1 - (n_src > 2)
    if source != "llama_src":
        return
    model, _ = convert.from_hf(str(src), tmp_path / "mc", loops=2, sharing="middle_cycle")  # prelude 0, block [1], coda 3
    assert (model.config.prelude_layers, model.config.coda_layers, model.config.extra["block_layers"]) == (1, 1, [1])
    ref = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in (0, 1, 1, 3)])
    ref.config.num_hidden_layers = 4
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = model(ids).logits, ref(input_ids=ids, use_cache=False).logits
    assert float((a - b).abs().max() / b.pow(2).mean().sqrt()) < 1e-5
    folder = tmp_path / "mc"
    assert LoopedLM.from_pretrained(str(folder)).config.coda_layers == 1
    assert "loop_depth.prelude=1" in convert.train_overrides(model.config, folder)


def test_cli_mamba2_retrofit_prints_the_check_and_the_train_command(mamba2_src, tmp_path, capsys):
    out = tmp_path / "m"
    assert convert.main(["from-hf", str(mamba2_src), "--out", str(out), "--loops", "3", "--block-layers", "1"]) == 0
    printed = capsys.readouterr().out
    diff = float(re.search(r"max \|Δlogit\| / RMS\(logits\) = (\S+)", printed).group(1))
    assert diff < 1e-5 and "re-stacked as [1]×3" in printed
    assert "loop_depth.layers=1 loop_depth.loops=3" in printed and f"init_from={out}" in printed
    cfg = LoopedLM.from_pretrained(str(out)).config
    assert (cfg.n_layers, cfg.n_loops, cfg.backbone, cfg.tie_embeddings) == (1, 3, "mamba2", True)


@pytest.mark.parametrize(
    "family, change, field",
    [
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"head_dim": 32}, "head_dim"),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type"),
        ("mamba2", {"use_bias": True}, "use_bias"),
        ("mamba2", {"time_step_limit": (0.0, 0.5)}, "time_step_limit"),
        ("mamba2", {"hidden_act": "relu"}, "hidden_act"),
    ],
)
def test_unrepresentable_settings_are_refused_with_the_field_named(family, change, field):
    cfg = LlamaConfig(**LLAMA, **change) if family == "llama" else Mamba2Config(**MAMBA2, **change)
    with pytest.raises(convert.ConversionError, match=field):
        convert.family_of(cfg).to_config(cfg)


def test_cli_refuses_a_biased_source(tmp_path, capsys):
    biased = tmp_path / "biased"
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 1}, attention_bias=True)).save_pretrained(biased)
    assert convert.main(["from-hf", str(biased), "--out", str(tmp_path / "o")]) == 1
    assert "attention_bias=True" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert convert.main(["from-hf", str(biased), "--out", str(tmp_path / "o"), "--prelude", "5"]) == 1
    assert "attention_bias=True" in capsys.readouterr().err  # refused for the bias before the layer count matters


def test_a_bf16_source_is_stored_in_bf16(tmp_path):
    src = tmp_path / "bf16"
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 1})).to(torch.bfloat16).save_pretrained(src)
    model, diff = convert.from_hf(str(src), tmp_path / "o")
    assert diff < 1e-5  # checked in fp32 on the bf16 values
    from safetensors import safe_open

    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16


def test_failed_check_writes_nothing(llama_src, tmp_path):
    with pytest.raises(convert.ConversionError, match="nothing was written"):
        convert.from_hf(str(llama_src), tmp_path / "x", tolerance=-1.0)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("backbone", ["llama", "mamba2"])
def test_to_transformers_unrolls_the_loops_and_round_trips(backbone, tmp_path):
    """A vanilla N⊗R model exports as an N·R-layer transformers model with the same logits, and
    from-hf with the block's layers and R loops gives the original weights back."""
    from looplab.models import LoopedLMConfig

    torch.manual_seed(0)
    cfg = LoopedLMConfig(vocab_size=100, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, n_loops=2, ffn_hidden=64,
                         backbone=backbone, d_state=8, headdim=16, ngroups=2, chunk_size=8, tie_embeddings=backbone == "mamba2")
    model = LoopedLM(cfg).eval()
    _randomise(model, seed=2)
    diff = convert.to_transformers(model, tmp_path / "tf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tf"), dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 4 and diff < 1e-5
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        a, b = model(ids).logits, hf(input_ids=ids, use_cache=False).logits
    assert float((a - b).abs().max() / b.pow(2).mean().sqrt()) < 1e-5
    back, _ = convert.from_hf(str(tmp_path / "tf"), tmp_path / "back", loops=2, block_layers=[0, 1])
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_to_transformers_refuses_what_transformers_cannot_run():
    from looplab.models import LoopedLMConfig

    for change, field in (({"state_mode": "stateloop"}, "state_mode"), ({"exit_gate": "ouro"}, "exit_gate"),
                          ({"backbone": "hybrid"}, "backbone")):
        cfg = LoopedLMConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1, n_loops=2, d_state=8, headdim=16, **change)
        with pytest.raises(convert.ConversionError, match=field):
            convert.transformers_config(cfg)


@pytest.mark.parametrize("args, says", [
    (["--loops", "0"], "--loops=0 must be >= 1"),
    (["--prelude", "-2"], "--prelude=-2 must be >= 0"),
    (["--coda", "-1"], "--coda=-1 must be >= 0"),
    (["--block-layers", "0,-1"], "--block-layers=0,-1: layer indices are >= 0"),
])
def test_cli_value_errors_are_one_line_before_anything_is_read(tmp_path, capsys, args, says):
    missing = tmp_path / "no-such-model"  # not read: the values are refused first
    assert convert.main(["from-hf", str(tmp_path), "--out", str(tmp_path / "o"), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: {says}" or (err.startswith(f"error: {says}") and "\n" not in err)
    assert convert.main(["from-hf", str(missing), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: {str(missing)!r}: no such folder (a hub id is NAME or ORG/NAME)"
    assert not (tmp_path / "o").exists()
