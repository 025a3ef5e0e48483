"""Typed configuration: dataclasses, TOML files and command-line flags.

Every field of every section is one flag (``--micro-batch`` for
``train.micro_batch``) and one TOML key, either in its section
(``[train] micro_batch = 4``) or flat (``micro_batch = 4``). Precedence, lowest
first: the dataclass default, the model preset, the TOML file, the flags. The
resolved configuration is printed at start and saved as ``config.toml`` in the
run folder, so a run can always be reproduced from its folder alone.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from scaletrain.config_sections import AUTO, DataConfig, FinetuneConfig, ModelConfig, count_or_auto, option
from scaletrain.errors import UserError
from scaletrain.models import preset_experts
from scaletrain.optim.schedule import SCHEDULES
from scaletrain.parallel.pipeline import schedules
from scaletrain.paths import readable_file
from scaletrain.runtime.mesh import ParallelDims
from scaletrain.runtime.ray_launch import RayPlacement


# Lightning's name for pure bf16: one word for the four settings it stands for.
BF16_TRUE = "bf16-true"
BF16_TRUE_SETTINGS = {"precision": "bf16", "param_dtype": "bf16", "masters": "none", "reduce_dtype": "bf16"}


def expand_precision(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (fields by name) with ``precision="bf16-true"`` replaced by the four settings it
    means; one of those given otherwise in the same ``values`` is a contradiction, refused."""
    if values.get("precision") != BF16_TRUE:
        return values
    for name, value in BF16_TRUE_SETTINGS.items():
        if name != "precision" and values.get(name, value) != value:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"--precision bf16-true means --precision bf16 --param-dtype bf16 --masters none "
                            f"--reduce-dtype bf16, which {flag} {values[name]} contradicts; drop {flag}, or give "
                            f"the four settings yourself.")
    return {**values, **BF16_TRUE_SETTINGS}


@dataclass
class TrainConfig:
    steps: int = option(300, "optimizer steps (with --epochs: derived from the training rows, and recorded)")
    epochs: float | None = option(None, "passes over the training rows (packed rows with --sft or --pack, windows of "
                                        "text; 0.5 allowed): steps = ceil(N x rows / global batch), said when the run "
                                        "starts; instead of --steps")
    micro_batch: int | str = option(16, "sequences per rank per micro-batch, or 'auto': the largest power of two "
                                        "the planner predicts to fit this device's memory (planner/fit.py)", auto=True)
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step")
    lr: float = option(1e-3, "peak learning rate")
    lr_schedule: str = option("cosine", "after the warm-up: cosine or linear decay to --min-lr-ratio x --lr at the "
                                        "last step, or constant at --lr", choices=SCHEDULES)
    min_lr_ratio: float = option(0.1, "final learning rate as a share of --lr (the cosine or linear floor)")
    warmup_steps: int = option(20, "linear warm-up steps")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)")
    seed: int = option(1234, "random seed for initialization, data order and dropout")
    eval_every: int = option(100, "steps between validation passes (0: only at the end)")
    eval_batches: int = option(8, "micro-batches per validation pass")
    eval_tasks: str | None = option(None, "lm-evaluation-harness tasks, comma-separated, run on the model during "
                                          "training (docs/evaluation.md; needs the [eval] extra)")
    eval_tasks_every: int = option(0, "with --eval-tasks: steps between harness runs (0: only at the end)")
    eval_tasks_include: str | None = option(None, "with --eval-tasks: a folder of the harness's YAML task files "
                                                  "to find tasks in besides its registry")
    eval_tasks_limit: int | None = option(None, "with --eval-tasks: at most this many documents per task")
    precision: str = option("fp32", "compute precision: fp32, bf16 autocast, fp16 autocast with dynamic loss "
                                    "scaling, fp8: bf16 autocast with the blocks' linear products in float8, or "
                                    "bf16-true: pure bf16, short for --precision bf16 --param-dtype bf16 --masters "
                                    "none --reduce-dtype bf16 (weights, gradients and optimizer state in bf16, no "
                                    "fp32 copy; any layout, ZeRO included; docs/techniques.md)",
                            choices=("fp32", "bf16", "fp16", "fp8", BF16_TRUE))
    param_dtype: str = option("fp32", "dtype of the working weights; bf16 keeps fp32 master copies for "
                                      "the optimizer (needs --precision bf16 or fp8)", choices=("fp32", "bf16"))
    masters: str = option("fp32", "'none' with --param-dtype bf16: pure bf16, the optimizer steps the bf16 weights "
                                  "themselves, its state in bf16, no fp32 master copy", choices=("fp32", "none"))
    stochastic_rounding: bool = option(False, "with --masters none: round each updated bf16 weight up or down at "
                                              "random, in proportion, so small updates survive in expectation")
    optimizer: str = option("adamw", "AdamW, Adafactor with factored second moments, SGD (with --momentum: "
                                     "one buffer per weight; without: no state at all), or AdamW with block-wise "
                                     "8-bit moments (2 bytes per weight against 8)",
                            choices=("adamw", "adafactor", "sgd", "adamw8bit"))
    momentum: float = option(0.9, "SGD's momentum (0: plain SGD)")
    offload: str = option("none", "'optimizer': fp32 master weights, optimizer state and step in host "
                                  "memory; 'base': a fine-tune's frozen base, ZeRO-3's shards of it, in host "
                                  "memory, copied to the device for each gather",
                          choices=("none", "optimizer", "base"))
    recompute: str = option("none", "activation checkpointing: none, full, selective, every:K, sqrt")
    compress_activations: str = option("none", "store the activations saved for backward in bf16 or as int8 "
                                               "blocks with absmax scales (ActNN), restored in backward",
                                       choices=("none", "bf16", "int8"))
    fused: str = option("none", "Triton kernels: the fused AdamW (one launch updates every parameter) and the "
                                "chunked fused cross-entropy (needs a GPU, or TRITON_INTERPRET=1)",
                        choices=("none", "triton"))
    head_loss: str | None = option(None, "the language model's head and cross-entropy: 'chunked' a chunk of rows at "
                                         "a time, the logits never whole (a Triton kernel: a GPU, or "
                                         "TRITON_INTERPRET=1), or 'logits' made whole (default: chunked on a GPU "
                                         "where the head's weight is whole on each rank, else logits)",
                                   choices=("logits", "chunked"))
    compile: bool = option(False, "compile every transformer block with torch.compile (the first steps "
                                  "pay the compile time)")
    compile_mode: str = option("default", "how --compile compiles: Inductor's kernels, or with reduce-overhead "
                                          "also each block's forward and backward replayed as CUDA graphs "
                                          "(one launch for a block's kernels: for small, launch-bound models; "
                                          "static shapes only)",
                               choices=("default", "reduce-overhead"))
    peak_tflops: str | None = option(None, "peak FLOP/s of one device for MFU, in TFLOP/s, or 'measure' "
                                           "(default: known GPUs from a table, otherwise MFU is n/a)")
    on_nan: str | None = option(None, "a step whose loss or gradients are not finite on any rank: skip it on "
                                      "every rank (the update left out, as fp16 loss scaling does), or stop "
                                      "with a report naming the step and the first non-finite parameter "
                                      "(default: skip with --precision fp16, else stop)",
                                choices=("skip", "stop"))


@dataclass
class ParallelConfig:
    nproc: int = option(1, "spawn this many local workers (otherwise read torchrun/SLURM/MPI)")
    max_restarts: int = option(0, "with --nproc: restart the workers this many times after a failure, each "
                                  "time from the newest complete checkpoint (under torchrun: its own "
                                  "--max-restarts; under Ray: its FailureConfig)")
    launcher: str = option("local", "who starts the --nproc workers: this machine (torch's elastic agent, as "
                                    "torchrun), or Ray Train on a Ray cluster (pip install 'scaletrain[ray]')",
                           choices=("local", "ray"))
    ray_address: str | None = option(None, "with --launcher ray: the cluster ('auto': the one ray start began on "
                                           "this machine, HOST:6379, ray://HOST:10001; default: the cluster of a "
                                           "ray job submit, else a new one on this machine)")
    cpus_per_worker: float = option(1.0, "with --launcher ray: CPUs reserved for each worker (its torch threads)")
    gpus_per_worker: float = option(0.0, "with --launcher ray: GPUs reserved for each worker (0: gloo on CPUs; "
                                         "1 or more: nccl; a fraction shares a GPU, for one-worker runs)")
    layout: str | None = option(None, "'auto': the planner's fastest layout predicted to fit this machine, "
                                      "searched over the sizes and options not given (dp, tp, sp, pp and its "
                                      "schedule, cp, ep, ZeRO, recompute, micro-batch, accumulation) at the run's "
                                      "global batch; predicted against measured in plan.json (planner/auto.py)",
                                choices=(AUTO,))
    dp: int | None = option(None, "data-parallel size (default: what the other sizes leave)")
    tp: int = option(1, "tensor-parallel size (Megatron: attention heads, MLP features and the "
                        "vocabulary split over this many ranks)")
    sp: bool = option(False, "sequence parallelism inside the tp group: norms, dropout and residuals "
                             "split along the sequence (needs --tp > 1)")
    pp: int = option(1, "pipeline-parallel size: the model's blocks cut into stages, one (or "
                        "--virtual-stages) per rank, micro-batches flowing through them")
    microbatches: int | None = option(None, "micro-batches of --micro-batch sequences per pipeline round "
                                            "(default: 2 x --pp with --pp, else 1); a step runs --grad-accum rounds")
    pp_schedule: str = option("1f1b", "pipeline schedule (pipedream-2bw: no flush, two weight versions, each "
                                      "step applying the previous step's gradient; with --pp 1, the same rule "
                                      "on one device)", choices=schedules.ALL_SCHEDULES)
    virtual_stages: int | None = option(None, "stages per rank for --pp-schedule interleaved (default: 2 "
                                              "for interleaved, else 1)")
    pp_balance: str = option("params", "cut stages for equal parameter counts, or equal measured forward and "
                                       "backward time per block", choices=("params", "time"))
    mesh_order: str = option("dp,ep,pp,cp,tp", "placement of ranks on the mesh, outermost dim first: "
                                                "consecutive ranks differ in the last one, so the chattiest "
                                                "group (tp) goes last to stay inside a node")
    cp: int = option(1, "context-parallel size: every sequence split over this many ranks, attention "
                        "computed by ring attention")
    ep: int = option(1, "expert-parallel size: the experts of each mixture-of-experts block divided over "
                        "this many ranks, tokens sent to them by all-to-all")
    backend: str | None = option(None, "the network: nccl (default with a GPU), gloo (default without), or "
                                       "mpi4py, MPI on host buffers for a data-parallel job started by mpirun -n N "
                                       "(pip install 'scaletrain[mpi]')", choices=("nccl", "gloo", "mpi4py"))
    timeout: float | None = option(None, "seconds a collective may wait for a rank before the job ends, naming "
                                         "the rank it waits for (a rank that died is noticed sooner; default: 60 "
                                         "on one machine's CPUs, 600 on GPUs or several nodes)")
    bucket_mb: float = option(25.0, "MiB of gradients per data-parallel all-reduce bucket (smaller: "
                                    "communication starts earlier in backward, in more calls)")
    allreduce: str = option("backend", "gradient all-reduce: the backend's, or the ring written with "
                                       "send/recv in runtime/ring.py", choices=("backend", "ring"))
    reduce_dtype: str = option("fp32", "dtype in which gradients accumulate and are all-reduced; bf16 "
                                       "halves the bytes of --param-dtype bf16 runs",
                               choices=("fp32", "bf16"))
    compress: str = option("none", "gradient compression with error feedback: PowerSGD (low rank) or "
                                   "scaled sign (1 bit per element)", choices=("none", "powersgd", "sign"))
    powersgd_rank: int = option(4, "rank of PowerSGD's gradient approximation")
    debug_dist: bool = option(False, "distributed debugging: torch's and NCCL's debug logs, a log file per rank "
                                     "in RUN/logs, a check that every rank has the same configuration and "
                                     "parameters, and a report of the rank a failed collective waits for")
    zero: int = option(0, "ZeRO stage over the dp group: 1 shards the optimizer state, 2 also the gradients, "
                          "3 also the parameters (0: replicate everything)", choices=(0, 1, 2, 3))
    shard_group: int | None = option(None, "hybrid sharding (HSDP, akin to ZeRO++ hpZ): ZeRO shards within "
                                           "groups of this many neighbouring dp ranks (a node) and replicates "
                                           "across the groups, gradients reduce-scattered inside a group and "
                                           "all-reduced across groups (default: one group of all dp ranks; "
                                           "needs --zero)")
    quantize_weights: str = option("none", "ZeRO-3's weight all-gathers in int8 with an fp32 absmax scale per "
                                           "256-element block (ZeRO++ qwZ; forward and backward then run on "
                                           "those weights), or fp8: e4m3 with a power-of-two scale per block "
                                           "(lossless for --precision fp8's products but subnormals); needs --zero 3",
                                   choices=("none", "int8", "fp8"))
    zero3_gather: str = option("round", "with --zero 3 and --pp: gather each block's weights once per pipeline "
                                        "round, held across its micro-batches (one all-gather per block per round), "
                                        "or for every micro-batch's forward and again for its backward (2 x "
                                        "--microbatches all-gathers, the least memory; docs/zero.md)",
                               choices=("round", "micro-batch"))
    sync_every: int = option(1, "local SGD: each rank steps on its own gradients (AdamW moments kept per rank) "
                                "and the dp replicas' parameters are averaged every N steps (1: plain data "
                                "parallelism, gradients averaged every step)")

    def ray_placement(self) -> RayPlacement:
        """Where --launcher ray puts the workers (runtime/ray_launch.py)."""
        return RayPlacement(self.ray_address, self.cpus_per_worker, self.gpus_per_worker)

    def mesh_dims(self, world_size: int) -> ParallelDims:
        """The mesh these sizes make of ``world_size`` ranks (dp filled in), in ``mesh_order``."""
        return ParallelDims.infer(world_size, dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep,
                                  order=tuple(name.strip() for name in self.mesh_order.split(",")),
                                  shard_group=self.shard_group or 0)

    def pipeline_sizes(self) -> tuple[int, int]:
        """(micro-batches per pipeline round, stages per rank), defaults filled in."""
        micro = self.microbatches or (2 * self.pp if self.pp > 1 else 1)
        return micro, self.virtual_stages or (2 if self.pp_schedule == "interleaved" else 1)


@dataclass
class RunConfig:
    out: str | None = option(None, "run folder (default: runs/<model>-<time>)")
    checkpoint_every: int = option(0, "save a checkpoint every N steps (0: only at the end)")
    keep_last: int = option(0, "keep only the newest K complete checkpoints, older ones deleted once a new "
                               "one is complete (0: keep all)")
    resume: bool = option(False, "continue the run in --out from its latest complete checkpoint; on another number "
                                 "of processes dp derived anew, the global batch kept (docs/checkpoints.md)")
    stop_at: int | None = option(None, "stop after this step with a checkpoint, the schedule still "
                                        "planned for --steps (for jobs with a time limit)")
    report_comm: bool = option(False, "write and print the communication ledger (comm.json)")
    report_memory: bool = option(False, "write and print the memory ledger (memory.json)")
    tracker: str = option("tensorboard", "where records go besides metrics.jsonl, comma-separated: tensorboard, "
                                         "mlflow (MLFLOW_TRACKING_URI, else ./mlruns), wandb")
    experiment: str = option("scaletrain", "the MLflow experiment, or the W&B project, of the run")
    register: str | None = option(None, "with --tracker mlflow: register the final model under this name (a new "
                                        "version each run)")
    progress: bool = option(True, "show a progress bar")
    log_every: int | None = option(None, "read each step's loss and gradient norm from the device every K steps, in "
                                         "one transfer, so the host never waits for the device mid-run (records stay "
                                         "per step), and print a line 'step N loss X lr Y tok/s Z' every K steps "
                                         "where no progress bar is drawn (--no-progress, or output not a terminal; "
                                         "default: 10 on a GPU, 1 on a CPU)")
    sample_tokens: int = option(200, "tokens of text generated at the end (0: none)")
    force: bool = option(False, "start even where the planner predicts the run does not fit this machine's "
                                "memory (planner/gate.py)")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
            "parallel": ParallelConfig, "run": RunConfig, "finetune": FinetuneConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: {k: v for k, v in dataclasses.asdict(getattr(self, name)).items() if v is not None}
                for name in SECTIONS}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def flat(self) -> dict[str, Any]:
        """Every field by its own name, whatever its section (``flat()["micro_batch"]``)."""
        return {name: getattr(getattr(self, section), name) for name, (section, _) in _FIELDS_BY_NAME.items()}

    def replace(self, **changes: Any) -> "Config":
        """A copy with fields changed, by field name (``replace(steps=5, dp=2)``); ``precision="bf16-true"``
        sets the four fields it stands for (`expand_precision`)."""
        copy = Config(**{name: dataclasses.replace(getattr(self, name)) for name in SECTIONS})
        for key, value in expand_precision(changes).items():
            section, fld = _FIELDS_BY_NAME[key]
            setattr(getattr(copy, section), fld.name, value)
        return copy


def field_of(name: str) -> dataclasses.Field | None:
    """The configuration field of this name (``lr``, ``micro_batch``), None if there is none."""
    found = _FIELDS_BY_NAME.get(name)
    return found[1] if found else None


def _flag_key(fld: dataclasses.Field) -> str:
    return fld.metadata.get("flag") or fld.name


_FIELDS_BY_NAME: dict[str, tuple[str, dataclasses.Field]] = {}
_FIELDS_BY_FLAG: dict[str, tuple[str, dataclasses.Field]] = {}
for _section, _cls in SECTIONS.items():
    for _fld in dataclasses.fields(_cls):
        _FIELDS_BY_NAME[_fld.name] = (_section, _fld)
        _FIELDS_BY_FLAG[_flag_key(_fld)] = (_section, _fld)


def base_type(fld: dataclasses.Field) -> type:
    """The scalar type behind an annotation such as ``int | None``."""
    text = str(fld.type)
    if "list[str]" in text:
        return list
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.split(" |")[0] == name:
            return typ
    raise TypeError(f"unsupported config type {fld.type!r} for {fld.name}")


def coerce(key: str, fld: dataclasses.Field, value: Any, named: str = "config key",
           fix: str = "fix the TOML file") -> Any:
    """Check a value against the field's type and choices, in the user's words: ``named`` says what
    gave it (a TOML key, a library option), ``fix`` where to change it."""
    typ = base_type(fld)
    if value is None or (fld.metadata.get("auto") and value == AUTO):
        return value
    if typ is list:  # a repeatable flag: one string, or a list of them
        if not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise UserError(f"{named} '{key}' must be a string or a list of strings, not {value!r}; {fix}.")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise UserError(f"{named} '{key}' must be {typ.__name__}, not {value!r}; {fix}.")
    choices = fld.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(f"{named} '{key}' must be one of {', '.join(map(str, choices))}, not {value!r}.")
    return value


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, then one flag per field, grouped by section. Defaults are None so
    that only the flags a user typed override the TOML file."""
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the fields below "
                                                          "(flags override it)")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} options")
        for fld in dataclasses.fields(cls):
            add_field_flag(group, fld, None)


def add_field_flag(group, fld: dataclasses.Field, default: Any) -> None:
    """The flag of one configuration field, its help text and choices, parsed to ``default`` when not given."""
    key = _flag_key(fld)
    flag = "--" + key.replace("_", "-")
    default_text = fld.default if fld.default is not None else "see help"
    help_text = f"{fld.metadata['help']} [{default_text}]" if fld.default is not None else fld.metadata["help"]
    typ = base_type(fld)
    if typ is bool:
        group.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=default, help=help_text)
    elif typ is list:
        group.add_argument(flag, dest=key, action="append", default=default, help=help_text, metavar="PATH")
    elif fld.metadata.get("auto"):
        group.add_argument(flag, dest=key, type=count_or_auto, default=default, help=help_text, metavar="N|auto")
    else:
        group.add_argument(flag, dest=key, type=typ, default=default, choices=fld.metadata.get("choices"),
                           help=help_text, metavar=typ.__name__.upper() if not fld.metadata.get("choices") else None)


def load_toml(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """Read a TOML config into {field name: value}, sections or flat keys; ``flag`` is the
    option that named the file, for the sentence that refuses it."""
    path = readable_file(flag, path, "the path of a TOML file")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{flag} {path} is not valid TOML ({exc}); fix the file.") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                match = _FIELDS_BY_NAME.get(sub_key) or _FIELDS_BY_FLAG.get(sub_key)
                if match is None or match[0] != key:
                    raise UserError(f"unknown key '{sub_key}' in section [{key}] of {path}; "
                                    f"see scaletrain train --help for the fields.")
                values[match[1].name] = coerce(sub_key, match[1], sub_value)
        else:
            match = _FIELDS_BY_FLAG.get(key) or _FIELDS_BY_NAME.get(key)
            if match is None:
                raise UserError(f"unknown key '{key}' in {path}; see scaletrain train --help for the fields.")
            values[match[1].name] = coerce(key, match[1], value)
    return values


def given_values(args: argparse.Namespace) -> dict[str, Any]:
    """The fields this command line sets (the TOML file's, then the typed flags'), by field name."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_toml(args.config))
    for key, (_, fld) in _FIELDS_BY_FLAG.items():
        given = getattr(args, key, None)
        if isinstance(given, list) and len(given) == 1:  # a repeatable flag given once: its one value
            given = given[0]
        if given is not None:
            values[fld.name] = given
    return values


def resolve(args: argparse.Namespace, base: Config | None = None) -> Config:
    """Defaults (or ``base``), then the TOML file, then the typed flags."""
    return with_preset_experts((base or Config()).replace(**given_values(args)))


def with_preset_experts(cfg: Config) -> Config:
    """``cfg`` with its preset's experts (a mixture-of-experts preset) where
    ``--moe-experts`` gave none, so every check and the planner see them."""
    experts = preset_experts(cfg.model.name)
    return cfg.replace(moe_experts=experts) if experts and not cfg.model.moe_experts else cfg


def load_run_config(run_dir: Path) -> Config:
    """The configuration a run folder was started with."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise UserError(f"--resume: {run_dir} holds no scaletrain run (it has no config.toml); "
                        f"check --out.")
    return Config().replace(**load_toml(path, flag="--out"))
