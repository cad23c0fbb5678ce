"""Bad input at the command line (looplab/cli_errors.py): one clean line on stderr naming the value, a non-zero exit,
the traceback in the run's log; bugs keep their traceback; a sweep's failed job still does not stop the sweep
(tests/test_train.py::test_cli_multirun_with_a_failing_job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import InstantiationException

from looplab import cli_errors
from looplab.cli_errors import clean_errors, input_error, one_line
from looplab.models import ConfigError, LoopedLMConfig

TINY = ["logger=none", "trainer.max_steps=2", "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "dataset.batch_size=8", "dataset.val_size=8", "dataset.test_size=8", "backbone.d_model=32", "backbone.n_heads=2"]


def cli(module: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in cli_errors.FULL_ERROR_ENV}
    full.update({"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "TMPDIR": str(cwd), **env})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=1800)


def clean_line(proc: subprocess.CompletedProcess, prog: str) -> str:
    """The one error line on stderr (Lightning's own warnings aside); its traceback's log file checked by the caller."""
    assert proc.returncode == cli_errors.EXIT_CODE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def log_of(line: str, cwd: Path) -> str:
    where = Path(line.rsplit("(traceback: ", 1)[1].rstrip(")"))
    return (where if where.is_absolute() else cwd / where).read_text()


# ----------------------------------------------------------------------------- what counts as bad input
def _raise_value_error_outside_looplab():
    exec(compile("raise ValueError('deep inside a library')", "somelib.py", "exec"), {"__name__": "somelib"})


def test_input_errors_are_told_from_bugs():
    with pytest.raises(ConfigError) as cfg_err:
        LoopedLMConfig(vocab_size=16, d_model=65, n_heads=4)
    assert input_error(cfg_err.value) is cfg_err.value
    assert input_error(FileNotFoundError("data file 'x' does not exist")) is not None
    with pytest.raises(ValueError) as lib_err:
        _raise_value_error_outside_looplab()
    assert input_error(lib_err.value) is None  # a ValueError raised inside another library is a bug
    assert input_error(RuntimeError("shape mismatch")) is None and input_error(KeyError("k")) is None
    try:  # Hydra's instantiate wraps the data module's own check: the check is the input error
        try:
            LoopedLMConfig(vocab_size=16, n_loops=0)
        except ConfigError as e:
            raise InstantiationException("Error in call to target 'x.Y':\nConfigError(...)") from e
    except InstantiationException as wrapped:
        assert isinstance(input_error(wrapped), ConfigError)
    assert one_line(ValueError("a\n   b\n\nc")) == "a; b; c"


def test_clean_errors_prints_one_line_and_logs_the_traceback(tmp_path, capsys, monkeypatch):
    for k in cli_errors.FULL_ERROR_ENV:
        monkeypatch.delenv(k, raising=False)
    log = tmp_path / "x.log"
    with pytest.raises(SystemExit) as info, clean_errors("prog", log):
        LoopedLMConfig(vocab_size=16, d_model=65, n_heads=4)
    assert info.value.code == cli_errors.EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prog: error: d_model=65 is not divisible by n_heads=4")
    assert f"(traceback: {log})" in err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "ConfigError: d_model=65" in text
    # bugs, sweep jobs and LOOPLAB_FULL_ERROR=1 keep the exception
    with pytest.raises(RuntimeError), clean_errors("prog", log):
        raise RuntimeError("a bug")
    with pytest.raises(ConfigError), clean_errors("prog", log, multirun=True):
        LoopedLMConfig(vocab_size=16, d_model=65, n_heads=4)
    monkeypatch.setenv("LOOPLAB_FULL_ERROR", "1")
    with pytest.raises(ConfigError), clean_errors("prog", log):
        LoopedLMConfig(vocab_size=16, d_model=65, n_heads=4)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- the commands
@pytest.mark.slow
def test_train_config_error_is_one_line_with_the_traceback_in_the_run_log(tmp_path):
    run = tmp_path / "bad"
    proc = cli("looplab.train", [*TINY, "backbone.d_model=65", "backbone.n_heads=4", f"hydra.run.dir={run}"], tmp_path)
    line = clean_line(proc, "python -m looplab.train")
    assert "d_model=65 is not divisible by n_heads=4" in line and line.endswith("(traceback: bad/train.log)")
    log = (run / "train.log").read_text()
    assert "Traceback (most recent call last)" in log and "ConfigError: d_model=65 is not divisible" in log
    assert json.loads((run / "results.json").read_text())["status"] == "failed"
    assert not (run / "checkpoints").exists()


@pytest.mark.slow
def test_train_data_error_is_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    for name, expected in (("missing.jsonl", "does not exist"), ("empty.jsonl", "is empty")):
        run = tmp_path / name.split(".")[0]
        proc = cli("looplab.train", ["logger=none", "backbone.d_model=32", "backbone.n_heads=2", "dataset=hf",
                                     "dataset.source=json", f"dataset.data_files={tmp_path / name}", "dataset.seq_len=16",
                                     f"hydra.run.dir={run}"], tmp_path)
        line = clean_line(proc, "python -m looplab.train")
        assert f"data file '{tmp_path / name}' {expected}" in line
        assert "Traceback (most recent call last)" in log_of(line, tmp_path)


BOOM = '''
import lightning as L

class Boom(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        raise ValueError("boom: a bug in a callback")
'''


@pytest.mark.slow
def test_train_bug_keeps_its_traceback(tmp_path):
    """A ValueError raised outside looplab's own checks (here a user callback's) is not bad input: full traceback."""
    (tmp_path / "boom_cb.py").write_text(BOOM)
    proc = cli("looplab.train", [*TINY, "+callbacks.boom._target_=boom_cb.Boom", f"hydra.run.dir={tmp_path / 'r'}"],
               tmp_path, PYTHONPATH=str(tmp_path))
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr and "ValueError: boom: a bug in a callback" in proc.stderr
    assert "python -m looplab.train: error:" not in proc.stderr


@pytest.mark.parametrize("module, args, expected", [
    ("looplab.eval", ["missing.ckpt"], "checkpoint 'missing.ckpt' does not exist"),
    ("looplab.generate", ["ckpt=missing.ckpt"], "checkpoint 'missing.ckpt' does not exist"),
    ("looplab.tables", ["report", "99"], "table 99 does not exist"),
])
def test_other_commands_give_one_line_with_the_traceback_in_a_temp_log(module, args, expected, tmp_path):
    proc = cli(module, args, tmp_path)  # TMPDIR=tmp_path: the log lands in tmp_path/looplab-logs/
    line = clean_line(proc, f"python -m {module}")
    assert expected in line
    logs = list((tmp_path / "looplab-logs").glob(f"{module.replace('.', '-')}-*.log"))
    assert len(logs) == 1 and f"(traceback: {logs[0].relative_to(tmp_path)})" in line
    assert "Traceback (most recent call last)" in logs[0].read_text()
