"""`python -m looplab.train` with its job wrapped in looplab.training.hydra_ddp.per_job_ddp (used by
tests/test_distributed.py to check Hydra multirun + DDP until train.py wraps its job the same way)."""

from pathlib import Path

import hydra

from looplab.train import train
from looplab.training.hydra_ddp import per_job_ddp
from looplab.training.run_utils import task_wrapper


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parents[1] / "conf"), config_name="train")
def main(cfg):
    with per_job_ddp():
        task_wrapper(train)(cfg)


if __name__ == "__main__":
    main()
