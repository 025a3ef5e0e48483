"""``scaletrain eval``: a model scored on EleutherAI's lm-evaluation-harness tasks (job/harness.py,
job/eval_tasks.py).

``--from`` is what ``scaletrain generate`` reads (job/model_source.py): a run folder (its latest
complete checkpoint), a checkpoint folder, or a Hugging Face model folder; a LoRA fine-tune's
adapters merged, a QLoRA fine-tune's NF4 base dequantized first. The tasks are the harness's, by
name from its registry (their data sets where the Hugging Face datasets cache has them) or from
``--include``'s folder of YAML task files, whose ``dataset_kwargs: data_files:`` name local files:
nothing needs a network. Every mistake is one sentence before any model is read: the harness
absent, ``--from`` not a model, ``--include`` not a folder, a task name the harness does not know.

The harness's results table is printed, and its whole results (``simple_evaluate``'s JSON,
with ``--log-samples`` every request's arguments and answers) go to ``--out``, by default
``RUN/eval/step_NNNNNN-TIME.json`` for a run or one of its checkpoints and, for a Hugging Face
folder (often a download, not ours to write into), ``eval/FOLDER_NAME/results-TIME.json`` under
the current folder.

``--nproc N`` starts N local processes (runtime/spawn.py, as ``train --nproc`` does), gloo on
CPUs or NCCL on one GPU each; each holds the whole model and answers its share of the harness's
requests, and the answers are gathered in order (job/harness.py), so the results are one
process's.
``--tp T`` and ``--pp P`` split the model too: the N processes form N / (T x P) groups of T x P,
each group one copy of the model split by tensor parallelism into slices and by pipeline
parallelism into stages, each rank reading only the slices of its stages (job/eval_layout.py),
for a model that does not fit one device; the requests are split over the groups.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.errors import UserError
from scaletrain.paths import writable_file

FLOAT_PRECISIONS = ("fp32", "bf16")


def add_parser(commands) -> None:
    evaluate = commands.add_parser(
        "eval", help="score a model on lm-evaluation-harness tasks",
        description="Score a model on EleutherAI's lm-evaluation-harness tasks (pip install 'scaletrain[eval]'): "
                    "tasks from its registry by name, or local YAML tasks from --include; print the harness's "
                    "results table and write its JSON (into the run folder for a run, see --out). The model is "
                    "a run folder (its latest complete checkpoint), a checkpoint folder, or a Hugging Face model "
                    "folder, with its own tokenizer; a LoRA fine-tune is scored with its adapters merged.")
    evaluate.add_argument("--from", dest="source", metavar="RUN_OR_HF_DIR", required=True,
                          help="a run folder, RUN/checkpoints/step_NNNNNN, or a Hugging Face model folder")
    evaluate.add_argument("--tasks", metavar="T1,T2", required=True,
                          help="the harness's task (or group) names, comma-separated; lm-eval ls tasks lists them")
    evaluate.add_argument("--include", metavar="TASK_DIR",
                          help="a folder of the harness's YAML task files to find tasks in besides its registry")
    evaluate.add_argument("--num-fewshot", type=int, metavar="K",
                          help="examples before each question [each task's own, else 0]")
    evaluate.add_argument("--limit", type=int, metavar="N", help="at most N documents per task [all]")
    evaluate.add_argument("--batch-size", type=int, default=8, metavar="B",
                          help="requests per forward [8]")
    evaluate.add_argument("--nproc", type=int, default=1, metavar="N",
                          help="local processes: N / --tp copies of the model that split the requests [1]")
    evaluate.add_argument("--out", metavar="FILE.json",
                          help="where the results' JSON goes [RUN/eval/step_NNNNNN-TIME.json; for a Hugging "
                               "Face folder eval/FOLDER_NAME/results-TIME.json here]")
    evaluate.add_argument("--log-samples", action="store_true",
                          help="keep every request's arguments and answers in the JSON")
    evaluate.add_argument("--apply-chat-template", action="store_true",
                          help="render each prompt with the model's chat template (its tokenizer's, or the "
                               "built-in one of --sft)")
    evaluate.add_argument("--fewshot-as-multiturn", action="store_true",
                          help="with --apply-chat-template: few-shot examples as turns of the conversation")
    evaluate.add_argument("--precision", choices=FLOAT_PRECISIONS, default="fp32",
                          help="fp32, or bf16 autocast on a GPU [fp32]")
    evaluate.add_argument("--bootstrap-iters", type=int, default=100000, metavar="N",
                          help="resamples for the standard errors that need them (0: no standard errors) [100000]")
    evaluate.add_argument("--seed", type=int, default=1234, metavar="N",
                          help="seed of the few-shot draws and of sampling tasks [1234]")
    evaluate.add_argument("--tp", type=int, default=1, metavar="N",
                          help="processes each copy of the model is split over by tensor parallelism, each "
                               "reading only its slices of the weights; must divide --nproc [1]")
    evaluate.add_argument("--pp", type=int, default=1, metavar="N",
                          help="pipeline stages each copy of the model is cut into, one process each, each "
                               "reading only its stages' weights; --tp x --pp must divide --nproc [1]")
    evaluate.add_argument("--timeout", type=float, metavar="SECONDS",
                          help="with --nproc: how long a rank waits for the others at a gather [600]")
    evaluate.set_defaults(handler=run)


@dataclass(frozen=True)
class EvalJob:
    """What each process needs (picklable: `spawn_local` sends it to the workers)."""

    source: Path
    checkpoint: Path | None  # None: a Hugging Face folder
    tasks: tuple[str, ...]
    include: str | None = None
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 8
    log_samples: bool = False
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    precision: str = "fp32"
    bootstrap_iters: int = 100000
    seed: int = 1234
    tp: int = 1  # tensor-parallel ranks per copy of the model
    pp: int = 1  # pipeline stages per copy of the model, a rank each


def run(args: argparse.Namespace) -> int:
    job, out, tasks = prepare(args)
    # One process evaluates the tasks loaded here; --nproc's workers each load their own.
    results = evaluate(job, args.nproc, args.timeout, tasks)
    from scaletrain.job.eval_tasks import table

    print(table(results))
    write_results(results, out)
    print(f"results: {out}")
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--nproc", args.nproc, 1), ("--tp", args.tp, 1),
                               ("--pp", args.pp, 1),
                               ("--limit", args.limit, 1), ("--num-fewshot", args.num_fewshot, 0),
                               ("--bootstrap-iters", args.bootstrap_iters, 0)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, not {value}.")
    if args.timeout is not None and not args.timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, not {args.timeout}.")
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise UserError("--fewshot-as-multiturn puts the examples into a chat template's turns; add "
                        "--apply-chat-template or drop it.")
    if args.precision != "fp32" and not torch.cuda.is_available():
        raise UserError(f"--precision {args.precision} is autocast on a GPU, and none is visible; use fp32.")


def prepare(args: argparse.Namespace) -> tuple[EvalJob, Path, dict]:
    """Every check of the command line, cheapest first, before any weight is read: the job, where
    its results go, and its tasks loaded (their data read)."""
    from scaletrain.job import eval_tasks
    from scaletrain.job.model_source import find_model

    _check_numbers(args)
    names = eval_tasks.task_names(args.tasks)
    eval_tasks.require_lm_eval()
    source = Path(args.source)
    checkpoint = find_model(source)
    if args.tp > 1 or args.pp > 1:
        from scaletrain.job.eval_layout import check_split

        check_split(source, checkpoint, args.tp, args.pp, args.nproc)
    out = results_path(args.out, source, checkpoint)
    tasks = eval_tasks.load_tasks(eval_tasks.find_tasks(names, args.include), names)
    job = EvalJob(source, checkpoint, tuple(names), args.include, args.num_fewshot, args.limit, args.batch_size,
                  args.log_samples, args.apply_chat_template, args.fewshot_as_multiturn, args.precision,
                  args.bootstrap_iters, args.seed, args.tp, args.pp)
    return job, out, tasks


def results_path(out: str | None, source: Path, checkpoint: Path | None) -> Path:
    """``--out``, or the default place of the results (module docstring), checked writable."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    if out is not None:
        path = Path(out)
    elif checkpoint is not None:
        path = checkpoint.parent.parent / "eval" / f"{checkpoint.name}-{stamp}.json"
    else:
        path = Path("eval") / source.resolve().name / f"results-{stamp}.json"
    return writable_file("--out", path)


def evaluate(job: EvalJob, nproc: int = 1, timeout_s: float | None = None, tasks: dict | None = None) -> dict:
    """The harness's results of ``job``, in this process (``tasks``: its tasks already loaded) or
    split over ``nproc`` local ones."""
    if nproc == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return _evaluate(job, device, tasks=tasks)
    from scaletrain.runtime.launch import CLUSTER_TIMEOUT_S
    from scaletrain.runtime.spawn import spawn_local

    return spawn_local(nproc, _worker, (job, timeout_s or CLUSTER_TIMEOUT_S))[0]


def _evaluate(job: EvalJob, device: torch.device, comm=None, mesh=None, tasks: dict | None = None) -> dict | None:
    """The harness's results on the main rank (None elsewhere): this process alone, or a rank of
    ``mesh``, whose dp groups split the requests and whose tp and pp groups split the model."""
    from scaletrain.job import eval_tasks
    from scaletrain.job.harness import ScaletrainLM
    from scaletrain.job.model_source import load_found

    names = list(job.tasks)
    tasks = tasks or eval_tasks.load_tasks(eval_tasks.find_tasks(names, job.include), names)
    group = mesh.group("dp") if mesh is not None else None
    if job.tp > 1 or job.pp > 1:
        from scaletrain.job.eval_layout import load_split

        split = load_split(job.source, job.checkpoint, mesh, comm, device)
        lm = ScaletrainLM(split.model, split.tokenizer, batch_size=job.batch_size, device=device,
                          precision=job.precision, comm=comm, group=group, tensor_parallel=split.tensor,
                          pipeline=split.pipeline, head_rows=split.head_rows, name=str(job.source), seed=job.seed)
    else:
        model, tokenizer = load_found(job.source, job.checkpoint)
        lm = ScaletrainLM(model, tokenizer, batch_size=job.batch_size, device=device, precision=job.precision,
                          comm=comm, group=group, name=str(job.source), seed=job.seed)
    results = eval_tasks.evaluate(lm, tasks, num_fewshot=job.num_fewshot, limit=job.limit,
                               log_samples=job.log_samples, apply_chat_template=job.apply_chat_template,
                               fewshot_as_multiturn=job.fewshot_as_multiturn, bootstrap_iters=job.bootstrap_iters,
                               seed=job.seed)
    if results is None:  # a rank other than 0
        return None
    results["config"]["checkpoint"] = str(job.checkpoint) if job.checkpoint is not None else None
    return plain(results)


def _worker(job: EvalJob, timeout_s: float) -> dict | None:
    """One of ``--nproc`` processes: its slices of its stages of the model, the requests of its dp
    group's share of the documents; rank 0's results."""
    from scaletrain.runtime.launch import connect, detect_environment, init_distributed, shutdown
    from scaletrain.runtime.mesh import ParallelDims

    env = detect_environment()
    runtime = init_distributed(env, timeout_s)
    try:
        mesh, comm = connect(runtime, ParallelDims(dp=env.world_size // (job.tp * job.pp), tp=job.tp,
                                                        pp=job.pp))
        return _evaluate(job, runtime.device, comm, mesh)
    finally:
        shutdown(runtime)


def plain(results: dict) -> dict:
    """The results as JSON values (the harness's hold numpy numbers and task configurations with
    functions), as written to the file and sent between processes."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(results, default=handle_non_serializable))


def write_results(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.tmp")
    partial.write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    partial.replace(out)
