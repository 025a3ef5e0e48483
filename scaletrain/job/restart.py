"""A restarted job goes on with the run its first attempt began.

torchrun's agent, or ``--max-restarts``, starts a failed job's workers again with
the same command line (attempt 1, 2, ...: runtime/launch.py ``restart_attempt``).
Such an attempt continues the run in --out from its newest complete checkpoint
instead of refusing the folder its first attempt filled.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.config import Config, load_run_config
from scaletrain.runtime.launch import restart_attempt


def continue_after_restart(cfg: Config) -> Config:
    """A job that torchrun or --max-restarts restarted (attempt 1, 2, ...) continues
    the run its first attempt began in --out, from the newest complete
    checkpoint (from the start when none was complete yet): whenever that
    folder holds a run of this very configuration. Any other folder gets the
    first attempt's checks and refusals."""
    out = Path(cfg.run.out)
    if restart_attempt() == 0 or cfg.run.resume or not (out / "config.toml").is_file():
        return cfg
    begun = load_run_config(out).replace(resume=False)
    # --epochs: the steps the first attempt derived, so that the job ends where it was to end
    same = cfg.replace(steps=begun.train.steps) if cfg.train.steps is None else cfg
    return same.replace(resume=True) if begun.to_dict() == same.to_dict() else cfg
