"""The harness's tasks and its evaluation around `ScaletrainLM` (job/harness.py): ``scaletrain
eval`` (commands/evaluate.py) and ``--eval-tasks`` during training (job/trainer.py).

Tasks come from EleutherAI's lm-evaluation-harness registry by name, or from a folder of its
YAML files (``--include``; their data local files, so nothing needs a network). Every name is
checked before any work (`find_tasks`) and every task's data read before any weight is
(`load_tasks`): each failure one sentence. `evaluate` is what ``lm_eval.simple_evaluate`` does
around the harness's ``evaluate`` that matters to the numbers (the seeds, ``num_fewshot``), its
results the harness's own, which `table` prints and `metrics` flattens into
``eval/<task>/<metric>`` for metrics.jsonl and the trackers.

lm_eval is imported inside the functions that use it: a training run that names no task, and
``scaletrain --help``, never load it.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from scaletrain.errors import UserError
from scaletrain.paths import readable_dir

INSTALL = "pip install 'scaletrain[eval]'"
LM_EVAL_LEAST = (0, 4, 13)  # TaskManager.load and its task index, as used here


def require_lm_eval() -> None:
    """One sentence where the harness is not installed, or older than the task API used here
    (TaskManager.load, 0.4.13)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import lm_eval  # noqa: F401

        found = version("lm_eval")
    except (ImportError, PackageNotFoundError):
        raise UserError(f"evaluation runs EleutherAI's lm-evaluation-harness (the lm_eval package), which is not "
                        f"installed; {INSTALL}.") from None
    numbers = tuple(int(part) for part in re.findall(r"\d+", found)[:3])
    if numbers < LM_EVAL_LEAST:
        least = ".".join(map(str, LM_EVAL_LEAST))
        raise UserError(f"evaluation needs lm_eval {least} or newer, and {found} is installed; pip install -U "
                        f"'lm_eval>={least}'.")


def task_names(text: str | None, flag: str = "--tasks") -> list[str]:
    """The comma-separated task names of ``text``, each once, in order."""
    names = list(dict.fromkeys(name.strip() for name in (text or "").split(",") if name.strip()))
    if not names:
        raise UserError(f"{flag} names no task; give the harness's task names, comma-separated (lm-eval ls tasks "
                        f"lists them).")
    return names


def check_settings(train) -> None:
    """The ``--eval-tasks`` options of a training run (its TrainConfig), without lm_eval: one
    sentence for an option that has nothing to apply to, or a value out of range. Call it with
    the other checks of a configuration (config_checks.check_values)."""
    if not train.eval_tasks:
        for flag, value in (("--eval-tasks-every", train.eval_tasks_every),
                            ("--eval-tasks-limit", train.eval_tasks_limit),
                            ("--eval-tasks-include", train.eval_tasks_include)):
            if value:
                raise UserError(f"{flag} applies to the tasks --eval-tasks names; add --eval-tasks T1,T2 or drop "
                                f"{flag}.")
        return
    task_names(train.eval_tasks, "--eval-tasks")
    if train.eval_tasks_every < 0:
        raise UserError(f"--eval-tasks-every must not be negative, not {train.eval_tasks_every} (0: at the end only).")
    if train.eval_tasks_limit is not None and train.eval_tasks_limit < 1:
        raise UserError(f"--eval-tasks-limit must be at least 1, not {train.eval_tasks_limit}.")


def training_tasks(train) -> dict | None:
    """A training run's ``--eval-tasks`` (its TrainConfig), checked and loaded: `check_settings`,
    the names against the harness (`find_tasks`), their data read (`load_tasks`); None without
    ``--eval-tasks``. Costs nothing for a run that names none of the four options."""
    if not (train.eval_tasks or train.eval_tasks_every or train.eval_tasks_limit or train.eval_tasks_include):
        return None
    check_settings(train)
    names = task_names(train.eval_tasks, "--eval-tasks")
    return load_tasks(find_tasks(names, train.eval_tasks_include, "--eval-tasks", "--eval-tasks-include"), names)


def find_tasks(names: list[str], include: str | Path | None, flag: str = "--tasks",
               include_flag: str = "--include"):
    """The harness's TaskManager (its registry, and ``include``'s YAML tasks), every name in
    ``names`` checked against it: one sentence for a name it does not know. No data is read."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include is not None:
        readable_dir(include_flag, Path(include), "a folder of the harness's YAML task files")
        with _quiet_harness():
            local = TaskManager(include_path=str(include), include_defaults=False)
        if all(_plain_task(local, name) for name in names):
            # Tasks of the folder alone (no group or tag that may name the registry's): the registry's
            # index, seconds of reading thousands of YAML files, is not needed.
            return local
    with _quiet_harness():
        manager = TaskManager(include_path=str(include) if include is not None else None)
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known and not manager.match_tasks([name])
               and not Path(name).is_file()]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        where = f"its registry or {include_flag} {include}" if include is not None else \
            f"its registry (add {include_flag} DIR for a folder of your own YAML tasks)"
        raise UserError(f"{flag} names {', '.join(unknown)}, which the harness does not find in {where}{hint}; "
                        f"lm-eval ls tasks lists the registry's tasks.")
    return manager


def _plain_task(manager, name: str) -> bool:
    """A task of its own (a YAML or Python task), not a group or tag that may name others."""
    return name in manager.all_subtasks


def load_tasks(manager, names: list[str]) -> dict:
    """The tasks (and groups) ``names`` name, their documents read, as the harness's evaluator takes
    them (``{"tasks": ..., "groups": ..., "group_map": ...}``): one sentence where a task's data
    cannot be read (a registry task's data set out of reach without a network, a local task's file
    missing)."""
    loaded: dict = {"tasks": {}, "groups": {}, "group_map": {}}
    known = set(manager.all_tasks)
    # A pattern (mmlu_*) stands for the names it matches, as the harness's command line reads it.
    expanded = [match for given in names for match in
                ([given] if given in known or Path(given).is_file() else manager.match_tasks([given]))]
    for name in expanded:
        try:
            with _quiet_harness():
                one = manager.load(name)
        except Exception as exc:  # noqa: BLE001 - the harness and datasets raise anything from anywhere
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"task {name} cannot be loaded ({reason}); its data must be on this machine (a local "
                            f"task's data_files, or the data set in the Hugging Face datasets cache).") from None
        for key in loaded:
            loaded[key].update(one.get(key) or {})
    return loaded


@contextlib.contextmanager
def _quiet_harness() -> Iterator[None]:
    """The harness's and datasets' INFO and WARNING lines held back: our output is the table."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval", "datasets")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def evaluate(lm, tasks: dict, *, num_fewshot: int | None = None,
             limit: int | None = None, log_samples: bool = False, apply_chat_template: bool = False,
             fewshot_as_multiturn: bool = False, bootstrap_iters: int = 100000, seed: int = 1234,
             quiet: bool = False) -> dict | None:
    """The harness's evaluation of ``tasks`` (`load_tasks`) on ``lm``: its results on ``lm``'s
    main rank (``lm.is_main``), None on the other ranks, which all call it (and skip the standard
    errors' resampling).

    What ``lm_eval.simple_evaluate`` does around the harness's ``evaluate`` is done here: the
    seeds (``seed`` for the few-shot draws, the harness's default 1234), ``num_fewshot`` over each
    task's own (0 where a task names none, and never over a task that fixes 0); not its git,
    environment and tokenizer records, which cost seconds and print git's complaints outside a
    repository. The global random states it seeds are put back after (training reseeds its own
    each step, train/stepper.py; a user's loop may not). ``quiet``: the harness's progress bars
    held back (training's output stays readable; the other ranks' always are)."""
    from lm_eval.evaluator import evaluate as harness_evaluate

    for task in tasks["tasks"].values():
        fixed = task.get_config("num_fewshot")
        if num_fewshot is not None and fixed != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif fixed is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    main = lm.is_main
    with _random_states_kept(lm.device), _quiet_harness(), \
            contextlib.redirect_stderr(io.StringIO()) if quiet or not main else contextlib.nullcontext():
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        results = harness_evaluate(lm=lm, task_dict=tasks, limit=limit,
                                   bootstrap_iters=bootstrap_iters if main else 0, log_samples=log_samples,
                                   apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn)
    if not main:
        return None
    if results is not None:
        results["config"] = {"model": "scaletrain", "model_args": lm.name, **lm.get_model_info(),
                             "batch_size": lm.batch_size, "limit": limit, "bootstrap_iters": bootstrap_iters,
                             "num_fewshot": num_fewshot, "fewshot_seed": seed, "random_seed": seed,
                             "processes": lm.processes, "tensor_parallel": lm.tp_size,
                             "pipeline_parallel": lm.pp_size}
        results["date"] = time.time()
    return results


@contextlib.contextmanager
def _random_states_kept(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's random states (the device's too) as they were before."""
    python, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def metrics(results: dict) -> dict[str, float]:
    """The results' numbers as ``eval/<task>/<metric>`` (a filter other than the default ``none``
    appended, ``eval/<task>/<metric>/<filter>``), for metrics.jsonl and the trackers; standard
    errors left out."""
    flat = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, filtered = key.partition(",")
            if not filtered or metric.endswith("_stderr") or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            flat[f"eval/{task}/{metric}" + ("" if filtered == "none" else f"/{filtered}")] = float(value)
    return flat


def table(results: dict) -> str:
    """The harness's own tables: the tasks', then the groups' where there are any."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text
