"""A key typo in any config group is one line naming the key, the closest keys and the valid ones,
not Hydra's "use +group.KEY", which only moves the refusal to the model's config or adds an ignored key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from looplab.models.registry import ConfigError
from looplab.training.variants import refuse_unknown_keys


@pytest.mark.parametrize("override, closest", [
    ("loop_depth.loopz=3", "loop_depth.loops"),
    ("backbone.d_modle=64", "backbone.d_model"),
    ("trainer.max_stepz=3", "trainer.max_steps"),
    ("exit_gate.thresh=0.5", None),
])
def test_a_key_typo_names_the_key_the_closest_and_the_valid_ones(override, closest):
    key = override.partition("=")[0]
    group = key.split(".")[0]
    with pytest.raises(ConfigError) as info:
        refuse_unknown_keys([override, "logger=csv"])
    msg = str(info.value)
    assert msg.startswith(f"{key} is not a key of {group}") and "\n" not in msg
    assert (f"did you mean {closest}" in msg) if closest else "did you mean" not in msg
    assert "its keys: " in msg and f"+{key}=" in msg


def test_keys_an_experiment_or_arm_adds_are_valid_and_sweeps_are_left_to_hydra():
    refuse_unknown_keys(["+experiment=stateloop_depth_tiny", "+arm=stateloop", "state_mode.d_s=16", "loop_depth.loops=2"])
    with pytest.raises(ConfigError, match=r"^state_mode\.forget_bais is not a key of state_mode; its keys: A_init, d_s"):
        refuse_unknown_keys(["+experiment=stateloop_depth_tiny", "+arm=stateloop", "state_mode.forget_bais=1"])
    refuse_unknown_keys(["-m", "loop_depth.loopz=2,3"])  # a sweep: Hydra reports per job
    refuse_unknown_keys(["+loop_depth.loopz=3"])  # added on purpose
    refuse_unknown_keys(["tags=[a,b]", "loop_depth.loops=2"])  # a list is not a sweep


def test_train_prints_it_as_one_line_before_any_run_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-m", "looplab.train", "loop_depth.loopz=3", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m looplab.train: error: loop_depth.loopz is not a key")
    assert not (tmp_path / "run").exists()
