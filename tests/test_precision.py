"""bf16-mixed with the default fused AdamW and gradient clipping trains (training/precision.py).

Lightning's MixedPrecision refuses clipping for an optimizer that unscales gradients itself (fused AdamW), a refusal
that matters only under fp16's GradScaler; every GPU preset (bf16-mixed, optim.fused=auto, gradient_clip_val=1.0)
stopped at its first optimizer step. The CPU has bf16 autocast and a fused AdamW kernel too, so the same run is shown
here: Lightning's own plugin refuses it, looplab's trains it, with the clipping applied.
"""

from __future__ import annotations

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from conftest import compose

TINY = ["logger=none", "trainer.max_steps=2", "trainer.limit_val_batches=0", "test_after_fit=false",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "dataset.task_args.n=12",
        "dataset.task_args.p=2", "dataset.batch_size=4", "backbone.d_model=32", "backbone.n_heads=2",
        "backbone.ffn_hidden=64", "loop_depth=1x2", "hardware=cpu", "trainer.precision=bf16-mixed",
        "trainer.gradient_clip_val=1.0", "optim.fused=auto"]


def _train(tmp_path, extra=()):
    from looplab.train import train

    run = tmp_path / "run"
    cfg = compose([*TINY, *extra, f"hydra.run.dir={run}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run)
    HydraConfig.instance().set_config(cfg)
    return train(cfg)


def test_bf16_mixed_with_a_fused_optimizer_and_clipping_trains(tmp_path):
    res = _train(tmp_path)
    assert res["status"] == "ok" and res["global_step"] == 2


def test_lightnings_own_plugin_refuses_that_run(monkeypatch, tmp_path):
    import looplab.training.precision as precision

    monkeypatch.setattr(precision, "precision_plugin", lambda flag, device: None)  # Lightning picks its own
    with pytest.raises(RuntimeError, match="fused"):
        _train(tmp_path)


def test_the_plugin_clips_fused_optimizers_gradients():
    from looplab.training.precision import BF16MixedPrecision

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], fused=True)
    p.grad = torch.full((4,), 10.0)
    BF16MixedPrecision("bf16-mixed", "cpu").clip_gradients(opt, clip_val=1.0)
    assert torch.linalg.vector_norm(p.grad).item() == pytest.approx(1.0, rel=1e-5)
