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
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from scaletrain.dist.mesh import ParallelDims
from scaletrain.errors import UserError
from scaletrain.parallel.pipeline import schedules


def _opt(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None) -> Any:
    """A dataclass field that carries its flag's help text and choices."""
    meta = {"help": help, "flag": flag, "choices": choices}
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = _opt("gpt-small", "model preset", flag="model",
                     choices=("gpt-tiny", "gpt-small", "gpt2-124m", "mlp"))
    n_layers: int | None = _opt(None, "transformer blocks (default: the preset's)")
    n_heads: int | None = _opt(None, "attention heads (default: the preset's)")
    d_model: int | None = _opt(None, "hidden size (default: the preset's)")
    dropout: float = _opt(0.0, "dropout probability")
    vocab_multiple: int = _opt(1, "pad the embedding and head rows to a multiple of this (64 suits GPU "
                                  "matrix tiles); padded ids are never targets nor sampled")
    mlp_hidden: int = _opt(128, "hidden width of the mlp classifier")
    moe_experts: int = _opt(0, "experts in each mixture-of-experts block (0: dense MLPs only)")
    moe_top_k: int = _opt(2, "experts each token is routed to; every expert is 4 x d_model / top-k wide, "
                             "so a token meets as many weights as in the dense MLP")
    moe_capacity: float | None = _opt(None, "capacity factor: an expert takes at most ceil(C x seq_len x "
                                            "top-k / experts) tokens of a sequence, the others pass through "
                                            "the residual (default: dropless)")
    moe_every: int = _opt(1, "every this-many-th block is a mixture of experts (2: blocks 1, 3, ...)")
    moe_aux_coef: float = _opt(0.01, "weight of the load-balancing loss (Switch Transformer)")
    moe_z_coef: float = _opt(0.0, "weight of the router z-loss (ST-MoE uses 0.001)")
    bias: bool = _opt(False, "biases on each block's linear layers (qkv, proj, fc), as GPT-2 has; tensor "
                             "parallelism refuses them")
    norm_eps: float = _opt(1e-5, "epsilon of the layer norms (GPT-2's layer_norm_epsilon)")
    n_positions: int | None = _opt(None, "rows of the position embedding, the longest sequence the model "
                                         "reads (default: --seq-len; GPT-2's n_positions, 1024)")
    n_vocab: int | None = _opt(None, "the model's vocabulary before --vocab-multiple padding (default: the "
                                     "tokenizer's; a GPT-2 folder's vocab_size, 50257)")


@dataclass
class DataConfig:
    data: str | None = _opt(None, "text file or folder of text files (default: the Python standard "
                                  "library's own source, present on every machine)")
    tokenizer: str = _opt("byte", "byte-level, or a BPE trained locally on the corpus",
                          choices=("byte", "bpe"))
    vocab_size: int = _opt(4096, "vocabulary size of the BPE tokenizer")
    val_fraction: float = _opt(0.02, "share of the corpus held out for validation")
    seq_len: int = _opt(128, "tokens per sequence")
    cache_dir: str | None = _opt(None, "folder for tokenizers and token files (default: .cache beside "
                                       "the run folder)")
    tokenizer_from: str | None = _opt(None, "tokenize with the tokenizer of this run folder or Hugging Face "
                                            "GPT-2 folder instead of --tokenizer (a fine-tune sets its --from)")


@dataclass
class TrainConfig:
    steps: int = _opt(300, "optimizer steps")
    micro_batch: int = _opt(16, "sequences per rank per micro-batch")
    grad_accum: int = _opt(1, "micro-batches accumulated per optimizer step")
    lr: float = _opt(1e-3, "peak learning rate")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a share of --lr (cosine floor)")
    warmup_steps: int = _opt(20, "linear warm-up steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay (matrices only)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: off)")
    seed: int = _opt(1234, "random seed for initialization, data order and dropout")
    eval_every: int = _opt(100, "steps between validation passes (0: only at the end)")
    eval_batches: int = _opt(8, "micro-batches per validation pass")
    precision: str = _opt("fp32", "compute precision: fp32, bf16 autocast, or fp16 autocast with "
                                  "dynamic loss scaling", choices=("fp32", "bf16", "fp16"))
    param_dtype: str = _opt("fp32", "dtype of the working weights; bf16 keeps fp32 master copies for "
                                    "the optimizer (needs --precision bf16)", choices=("fp32", "bf16"))
    optimizer: str = _opt("adamw", "AdamW, or Adafactor with factored second moments",
                          choices=("adamw", "adafactor"))
    offload: str = _opt("none", "'optimizer': fp32 master weights, optimizer state and step in host "
                                "memory", choices=("none", "optimizer"))
    recompute: str = _opt("none", "activation checkpointing: none, full, selective, every:K, sqrt")
    compress_activations: str = _opt("none", "store the activations saved for backward in bf16 or as int8 "
                                             "blocks with absmax scales (ActNN), restored in backward",
                                     choices=("none", "bf16", "int8"))
    fused: str = _opt("none", "Triton kernels: the fused AdamW (one launch updates every parameter) and the "
                              "chunked fused cross-entropy (needs a GPU, or TRITON_INTERPRET=1)",
                      choices=("none", "triton"))
    compile: bool = _opt(False, "compile every transformer block with torch.compile (the first steps "
                                "pay the compile time)")
    peak_tflops: str | None = _opt(None, "peak FLOP/s of one device for MFU, in TFLOP/s, or 'measure' "
                                         "(default: known GPUs from a table, otherwise MFU is n/a)")
    on_nan: str | None = _opt(None, "a step whose loss or gradients are not finite on any rank: skip it on "
                                    "every rank (the update left out, as fp16 loss scaling does), or stop "
                                    "with a report naming the step and the first non-finite parameter "
                                    "(default: skip with --precision fp16, else stop)",
                              choices=("skip", "stop"))


@dataclass
class ParallelConfig:
    nproc: int = _opt(1, "spawn this many local workers (otherwise read torchrun/SLURM/MPI)")
    max_restarts: int = _opt(0, "with --nproc: restart the workers this many times after a failure, each "
                                "time from the newest complete checkpoint (under torchrun: its own "
                                "--max-restarts)")
    dp: int | None = _opt(None, "data-parallel size (default: what the other sizes leave)")
    tp: int = _opt(1, "tensor-parallel size (Megatron: attention heads, MLP features and the "
                      "vocabulary split over this many ranks)")
    sp: bool = _opt(False, "sequence parallelism inside the tp group: norms, dropout and residuals "
                           "split along the sequence (needs --tp > 1)")
    pp: int = _opt(1, "pipeline-parallel size: the model's blocks cut into stages, one (or "
                      "--virtual-stages) per rank, micro-batches flowing through them")
    microbatches: int | None = _opt(None, "micro-batches of --micro-batch sequences per pipeline round "
                                          "(default: 2 x --pp with --pp, else 1); a step runs --grad-accum rounds")
    pp_schedule: str = _opt("1f1b", "pipeline schedule (pipedream-2bw: no flush, two weight versions, each "
                                    "step applying the previous step's gradient; with --pp 1, the same rule "
                                    "on one device)", choices=schedules.ALL_SCHEDULES)
    virtual_stages: int | None = _opt(None, "stages per rank for --pp-schedule interleaved (default: 2 "
                                            "for interleaved, else 1)")
    pp_balance: str = _opt("params", "cut stages for equal parameter counts, or equal measured forward and "
                                     "backward time per block", choices=("params", "time"))
    mesh_order: str = _opt("dp,ep,pp,cp,tp", "placement of ranks on the mesh, outermost dim first: "
                                              "consecutive ranks differ in the last one, so the chattiest "
                                              "group (tp) goes last to stay inside a node")
    cp: int = _opt(1, "context-parallel size: every sequence split over this many ranks, attention "
                      "computed by ring attention")
    ep: int = _opt(1, "expert-parallel size: the experts of each mixture-of-experts block divided over "
                      "this many ranks, tokens sent to them by all-to-all")
    backend: str | None = _opt(None, "the network: nccl (default with a GPU), gloo (default without), or "
                                     "mpi4py, MPI on host buffers for a data-parallel job started by mpirun -n N "
                                     "(pip install 'scaletrain[mpi]')", choices=("nccl", "gloo", "mpi4py"))
    timeout: float = _opt(600.0, "seconds a collective may wait for a rank before the job ends (a rank "
                                 "that died is noticed sooner)")
    bucket_mb: float = _opt(25.0, "MiB of gradients per data-parallel all-reduce bucket (smaller: "
                                  "communication starts earlier in backward, in more calls)")
    allreduce: str = _opt("backend", "gradient all-reduce: the backend's, or the ring written with "
                                     "send/recv in dist/ring.py", choices=("backend", "ring"))
    reduce_dtype: str = _opt("fp32", "dtype in which gradients accumulate and are all-reduced; bf16 "
                                     "halves the bytes of --param-dtype bf16 runs",
                             choices=("fp32", "bf16"))
    compress: str = _opt("none", "gradient compression with error feedback: PowerSGD (low rank) or "
                                 "scaled sign (1 bit per element)", choices=("none", "powersgd", "sign"))
    powersgd_rank: int = _opt(4, "rank of PowerSGD's gradient approximation")
    debug_dist: bool = _opt(False, "distributed debugging: torch's and NCCL's debug logs, a log file per rank "
                                   "in RUN/logs, a check that every rank has the same configuration and "
                                   "parameters, and a report of the rank a failed collective waits for")
    zero: int = _opt(0, "ZeRO stage over the dp group: 1 shards the optimizer state, 2 also the gradients, "
                        "3 also the parameters (0: replicate everything)", choices=(0, 1, 2, 3))
    shard_group: int | None = _opt(None, "hybrid sharding (HSDP, akin to ZeRO++ hpZ): ZeRO shards within "
                                         "groups of this many neighbouring dp ranks (a node) and replicates "
                                         "across the groups, gradients reduce-scattered inside a group and "
                                         "all-reduced across groups (default: one group of all dp ranks; "
                                         "needs --zero)")
    quantize_weights: str = _opt("none", "ZeRO-3's weight all-gathers in int8 with an fp32 absmax scale per "
                                         "256-element block (ZeRO++ qwZ; forward and backward then run on "
                                         "those weights; needs --zero 3)", choices=("none", "int8"))
    sync_every: int = _opt(1, "local SGD: each rank steps on its own gradients (AdamW moments kept per rank) "
                              "and the dp replicas' parameters are averaged every N steps (1: plain data "
                              "parallelism, gradients averaged every step)")

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
    out: str | None = _opt(None, "run folder (default: runs/<model>-<time>)")
    checkpoint_every: int = _opt(0, "save a checkpoint every N steps (0: only at the end)")
    keep_last: int = _opt(0, "keep only the newest K complete checkpoints, older ones deleted once a new "
                             "one is complete (0: keep all)")
    resume: bool = _opt(False, "continue the run in --out from its latest complete checkpoint")
    stop_at: int | None = _opt(None, "stop after this step with a checkpoint, the schedule still "
                                      "planned for --steps (for jobs with a time limit)")
    report_comm: bool = _opt(False, "write and print the communication ledger (comm.json)")
    report_memory: bool = _opt(False, "write and print the memory ledger (memory.json)")
    progress: bool = _opt(True, "show a progress bar")
    log_every: int = _opt(1, "read each step's loss and gradient norm from the device every K steps, in one "
                             "transfer, so the host never waits for the device mid-run (records stay per step)")
    sample_tokens: int = _opt(200, "tokens of text generated at the end (0: none)")


@dataclass
class FinetuneConfig:
    base: str | None = _opt(None, "a checkpoint (run folder or step_NNNNNN) or a Hugging Face GPT-2 folder "
                                  "to start from: its model, tokenizer and weights", flag="from")
    lora_rank: int = _opt(0, "rank r of the LoRA adapters on the --lora-targets layers, the base frozen "
                             "(0: no adapters, every weight trains)")
    lora_alpha: float = _opt(16.0, "LoRA scaling numerator: the update is alpha / r x B A")
    lora_dropout: float = _opt(0.0, "dropout on the adapters' input")
    lora_targets: str = _opt("qkv,proj,fc", "the linear layers that get adapters, by name (proj: both the "
                                            "attention's and the MLP's)")
    quantize: str = _opt("none", "store the frozen base weights as 4-bit NormalFloat with double "
                                 "quantization (QLoRA; needs --lora-rank)", choices=("none", "nf4"))


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

    def replace(self, **changes: Any) -> "Config":
        """A copy with fields changed, by field name (``replace(steps=5, dp=2)``)."""
        copy = Config(**{name: dataclasses.replace(getattr(self, name)) for name in SECTIONS})
        for key, value in changes.items():
            section, fld = _FIELDS_BY_NAME[key]
            setattr(getattr(copy, section), fld.name, value)
        return copy


def _flag_key(fld: dataclasses.Field) -> str:
    return fld.metadata.get("flag") or fld.name


_FIELDS_BY_NAME: dict[str, tuple[str, dataclasses.Field]] = {}
_FIELDS_BY_FLAG: dict[str, tuple[str, dataclasses.Field]] = {}
for _section, _cls in SECTIONS.items():
    for _fld in dataclasses.fields(_cls):
        _FIELDS_BY_NAME[_fld.name] = (_section, _fld)
        _FIELDS_BY_FLAG[_flag_key(_fld)] = (_section, _fld)


def _base_type(fld: dataclasses.Field) -> type:
    """The scalar type behind an annotation such as ``int | None``."""
    text = str(fld.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.split(" |")[0] == name:
            return typ
    raise TypeError(f"unsupported config type {fld.type!r} for {fld.name}")


def _coerce(key: str, fld: dataclasses.Field, value: Any) -> Any:
    """Check a TOML value against the field's type, in the user's words."""
    typ = _base_type(fld)
    if value is None:
        return None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise UserError(f"config key '{key}' must be {typ.__name__}, not {value!r}; fix the TOML file.")
    choices = fld.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(f"config key '{key}' must be one of {', '.join(map(str, choices))}, not {value!r}.")
    return value


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field, grouped by section. Defaults are None so that only
    the flags a user typed override the TOML file."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} options")
        for fld in dataclasses.fields(cls):
            key = _flag_key(fld)
            flag = "--" + key.replace("_", "-")
            default_text = fld.default if fld.default is not None else "see help"
            help_text = f"{fld.metadata['help']} [{default_text}]" if fld.default is not None \
                else fld.metadata["help"]
            typ = _base_type(fld)
            if typ is bool:
                group.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction,
                                   default=None, help=help_text)
            else:
                group.add_argument(flag, dest=key, type=typ, default=None,
                                   choices=fld.metadata.get("choices"), help=help_text,
                                   metavar=typ.__name__.upper() if not fld.metadata.get("choices") else None)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config into {field name: value}, sections or flat keys."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--config {path} does not exist; give the path of a TOML file.")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--config {path} is not valid TOML ({exc}); fix the file.") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                match = _FIELDS_BY_NAME.get(sub_key) or _FIELDS_BY_FLAG.get(sub_key)
                if match is None or match[0] != key:
                    raise UserError(f"unknown key '{sub_key}' in section [{key}] of {path}; "
                                    f"see scaletrain train --help for the fields.")
                values[match[1].name] = _coerce(sub_key, match[1], sub_value)
        else:
            match = _FIELDS_BY_FLAG.get(key) or _FIELDS_BY_NAME.get(key)
            if match is None:
                raise UserError(f"unknown key '{key}' in {path}; see scaletrain train --help for the fields.")
            values[match[1].name] = _coerce(key, match[1], value)
    return values


def resolve(args: argparse.Namespace, base: Config | None = None) -> Config:
    """Defaults (or ``base``), then the TOML file, then the typed flags."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_toml(args.config))
    for key, (_, fld) in _FIELDS_BY_FLAG.items():
        given = getattr(args, key, None)
        if given is not None:
            values[fld.name] = given
    return (base or Config()).replace(**values)


def load_run_config(run_dir: Path) -> Config:
    """The configuration a run folder was started with."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise UserError(f"--resume: {run_dir} holds no scaletrain run (it has no config.toml); "
                        f"check --out.")
    return Config().replace(**load_toml(path))


_POSITIVE = ("steps", "micro_batch", "grad_accum", "seq_len", "eval_batches", "nproc", "tp", "pp",
             "microbatches", "virtual_stages", "vocab_multiple", "cp", "ep", "shard_group", "vocab_size",
             "mlp_hidden", "n_layers", "n_heads", "d_model", "dp", "powersgd_rank", "moe_top_k", "moe_every",
             "log_every", "n_positions", "n_vocab",
             "sync_every")
_NON_NEGATIVE = ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "checkpoint_every",
                 "sample_tokens", "min_lr_ratio", "moe_experts", "moe_aux_coef", "moe_z_coef", "keep_last",
                 "max_restarts")
_ABOVE_ZERO = ("lr", "timeout", "bucket_mb", "norm_eps")


def check_values(cfg: Config) -> None:
    """Range checks that need no model or world: one sentence per mistake."""
    flat = {name: getattr(getattr(cfg, section), name) for name, (section, _) in _FIELDS_BY_NAME.items()}
    for name in _POSITIVE:
        if flat[name] is not None and flat[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {flat[name]}.")
    for name in _NON_NEGATIVE:
        if flat[name] < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, not {flat[name]}.")
    if not 0 < cfg.data.val_fraction < 1:
        raise UserError(f"--val-fraction must be between 0 and 1, not {cfg.data.val_fraction}.")
    if not 0 <= cfg.model.dropout < 1:
        raise UserError(f"--dropout must be in [0, 1), not {cfg.model.dropout}.")
    for name in _ABOVE_ZERO:
        if flat[name] <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, not {flat[name]}.")
    positions = cfg.model.n_positions
    if positions is not None and cfg.data.seq_len > positions:
        raise UserError(f"--seq-len {cfg.data.seq_len} is longer than the model's {positions} positions "
                        f"(--n-positions); choose a --seq-len of at most {positions}.")
    if cfg.run.stop_at is not None and not 1 <= cfg.run.stop_at <= cfg.train.steps:
        raise UserError(f"--stop-at must lie between 1 and --steps ({cfg.train.steps}), not {cfg.run.stop_at}.")
    if cfg.train.param_dtype == "bf16" and cfg.train.precision != "bf16":
        raise UserError(f"--param-dtype bf16 needs --precision bf16 (autocast runs the matmuls in bf16 "
                        f"and keeps norms and the loss in fp32), not --precision {cfg.train.precision}.")
    if cfg.parallel.reduce_dtype == "bf16" and cfg.train.param_dtype != "bf16":
        raise UserError("--reduce-dtype bf16 reduces bf16 gradients, which only --param-dtype bf16 "
                        "produces; add it, or keep --reduce-dtype fp32.")
    if cfg.parallel.zero:
        for flag, used in (("--allreduce ring", cfg.parallel.allreduce != "backend"),
                           ("--compress", cfg.parallel.compress != "none"),
                           ("--optimizer adafactor", cfg.train.optimizer != "adamw")):
            if used:
                raise UserError(f"--zero {cfg.parallel.zero} does not combine with {flag}, which needs whole "
                                f"gradients or weight matrices where ZeRO keeps flat shards; drop one of the two.")
    _check_hybrid(cfg.parallel)
    tp = cfg.parallel.tp
    if cfg.model.bias and tp > 1:
        raise UserError(f"--tp {tp} splits bias-free linear layers only, and this model has biases (--bias, "
                        f"as GPT-2 has); use --tp 1.")
    if cfg.parallel.sp and tp < 2:
        raise UserError(f"--sp splits the sequence over the tp group, which needs --tp 2 or more, "
                        f"not --tp {tp}; add --tp or drop --sp.")
    if tp > 1:
        if cfg.parallel.sp and cfg.data.seq_len % tp:
            raise UserError(f"--sp splits each sequence of --seq-len {cfg.data.seq_len} over --tp {tp} "
                            f"ranks; choose a --seq-len divisible by {tp}.")
        if cfg.train.optimizer != "adamw":
            raise UserError(f"--tp {tp} does not combine with --optimizer adafactor: Adafactor factors the "
                            f"second moment of whole weight matrices; drop one of the two.")
    if cfg.train.on_nan == "stop" and cfg.train.precision == "fp16":
        raise UserError("--on-nan stop contradicts --precision fp16, whose loss scaling finds its scale by "
                        "skipping the steps that overflow; use --on-nan skip or another precision.")
    if cfg.parallel.max_restarts and cfg.parallel.nproc < 2:
        raise UserError("--max-restarts restarts the workers that --nproc spawns; add --nproc, or under "
                        "torchrun give torchrun its own --max-restarts.")
    if cfg.train.fused == "triton" and cfg.train.optimizer != "adamw":
        raise UserError("--fused triton fuses AdamW; drop it, or use --optimizer adamw.")
    _check_pipeline(cfg.parallel)
    _check_local_sgd(cfg)
    _check_mpi(cfg)
    _check_two_bw(cfg)
    _check_context(cfg)
    _check_experts(cfg)
    peak = cfg.train.peak_tflops
    if peak is not None and peak != "measure":
        try:
            if float(peak) <= 0:
                raise ValueError
        except ValueError:
            raise UserError(f"--peak-tflops must be a positive number or 'measure', not {peak!r}.") from None


def _check_hybrid(p: ParallelConfig) -> None:
    """--shard-group and --quantize-weights (parallel/hybrid.py); the divisibility of the
    dp group is checked with the mesh (dist/mesh.py)."""
    if p.shard_group is not None and not p.zero:
        raise UserError(f"--shard-group {p.shard_group} shards ZeRO's state within groups of ranks, which "
                        f"needs --zero 1, 2 or 3; add --zero or drop --shard-group.")
    if p.quantize_weights != "none" and p.zero != 3:
        raise UserError(f"--quantize-weights {p.quantize_weights} compresses ZeRO-3's parameter all-gathers, "
                        f"which only --zero 3 makes; use --zero 3 or drop --quantize-weights.")


def _check_local_sgd(cfg: Config) -> None:
    p, every = cfg.parallel, cfg.parallel.sync_every
    if every == 1:
        return
    if p.zero:
        raise UserError(f"--sync-every {every} keeps a whole model and optimizer on every rank, which --zero "
                        f"{p.zero} shards over the same ranks; drop one of the two.")
    if p.compress != "none":
        raise UserError(f"--compress compresses the gradient all-reduce, which --sync-every {every} replaces "
                        f"with a parameter average every {every} steps; drop one of the two.")
    for flag, used in (("--tp", p.tp > 1), ("--pp", p.pp > 1), ("--cp", p.cp > 1), ("--ep", p.ep > 1)):
        if used:
            raise UserError(f"--sync-every {every} averages whole replicas over plain data parallelism and does "
                            f"not combine with {flag} in this version; drop one of the two.")
    for flag, value in (("--checkpoint-every", cfg.run.checkpoint_every),
                        ("--stop-at", cfg.run.stop_at if cfg.run.stop_at != cfg.train.steps else None)):
        if value and value % every:
            lower = value - value % every
            raise UserError(f"{flag} {value} must be a multiple of --sync-every {every}, so that every "
                            f"checkpoint holds averaged replicas; choose "
                            f"{f'{lower} or ' if lower else ''}{lower + every}.")


def _check_mpi(cfg: Config) -> None:
    p = cfg.parallel
    if p.backend != "mpi4py":
        return
    if p.nproc > 1:
        raise UserError(f"--backend mpi4py takes its processes from mpirun; run mpirun -n {p.nproc} scaletrain "
                        f"train ... without --nproc.")
    # Without a torch process group the main rank writes checkpoints alone, which holds
    # everything only when every rank holds the same whole model and optimizer.
    for flag, used in (("--tp", p.tp > 1), ("--pp", p.pp > 1), ("--cp", p.cp > 1), ("--ep", p.ep > 1),
                       ("--zero", p.zero > 0), ("--sync-every", p.sync_every > 1)):
        if used:
            raise UserError(f"--backend mpi4py runs plain data parallelism, whose ranks all hold the same model "
                            f"and optimizer, and does not combine with {flag} in this version; drop {flag} or "
                            f"use --backend gloo.")
    if p.reduce_dtype == "bf16":
        raise UserError("--backend mpi4py reduces numpy buffers, and numpy has no bfloat16; use --reduce-dtype "
                        "fp32 or --backend gloo.")


def _check_context(cfg: Config) -> None:
    cp = cfg.parallel.cp
    if cp == 1:
        return
    if cfg.data.seq_len % (2 * cp):
        raise UserError(f"--cp {cp} cuts each sequence into {2 * cp} equal chunks (two per rank, for "
                        f"balanced causal work); choose a --seq-len divisible by {2 * cp}.")
    if cfg.parallel.sp and cfg.data.seq_len // cp % cfg.parallel.tp:
        raise UserError(f"--sp splits each rank's {cfg.data.seq_len // cp} positions over --tp "
                        f"{cfg.parallel.tp}; choose a --seq-len divisible by {cp * cfg.parallel.tp}.")
    if cfg.model.dropout > 0:
        raise UserError(f"--cp {cp} computes attention by ring attention, which has no dropout; "
                        f"use --dropout 0.")
    if cfg.train.compile:
        raise UserError(f"--compile cannot capture ring attention's point-to-point hops, which --cp {cp} "
                        f"puts in every block; drop --compile.")


def _check_experts(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if not m.moe_experts:
        if p.ep > 1:
            raise UserError(f"--ep {p.ep} divides the experts of a mixture of experts; add --moe-experts "
                            f"(a multiple of {p.ep}) or use --ep 1.")
        return
    if m.name == "mlp":
        raise UserError("--moe-experts replaces the GPT models' MLP blocks; drop it for the mlp.")
    if m.moe_top_k > m.moe_experts:
        raise UserError(f"--moe-top-k {m.moe_top_k} routes each token to more experts than the "
                        f"{m.moe_experts} there are; choose at most {m.moe_experts}.")
    if m.moe_capacity is not None and m.moe_capacity <= 0:
        raise UserError(f"--moe-capacity must be positive, not {m.moe_capacity}; leave it out for "
                        f"dropless routing.")
    if p.ep > 1 and m.moe_experts % p.ep:
        raise UserError(f"--ep {p.ep} must divide the {m.moe_experts} experts; choose --moe-experts "
                        f"divisible by {p.ep}.")
    # Each sequence is one routing group (its capacity and balance loss): a layout
    # that splits a sequence over ranks would route its pieces apart.
    for flag, used in (("--cp", p.cp > 1), ("--sp", p.sp)):
        if used:
            raise UserError(f"{flag} splits each sequence over ranks, but a mixture of experts routes "
                            f"each sequence as one group; drop {flag} or --moe-experts.")
    for flag, used in (("--pp", p.pp > 1), ("--zero", p.zero > 0 and p.ep > 1),
                       ("--compress", p.compress != "none" and p.ep > 1)):
        if used:
            raise UserError(f"{flag} does not combine with "
                            f"{'--moe-experts' if flag == '--pp' else '--ep'} in this version; drop one "
                            f"of the two.")


def _check_two_bw(cfg: Config) -> None:
    """What PipeDream-2BW's lagging update and never-drained pipeline cannot go with."""
    t, p, r = cfg.train, cfg.parallel, cfg.run
    if p.pp_schedule != schedules.PIPEDREAM_2BW:
        return
    for flag, used, why in (
            ("--grad-accum", t.grad_accum > 1 and p.pp > 1, "a weight version's gradient is that of its "
             "--microbatches micro-batches; give --microbatches M x A instead"),
            ("--zero", p.zero > 0, "ZeRO steps flat shards of the weights, where 2BW keeps two versions of "
             "whole ones; use --zero 0"),
            ("--precision fp16", t.precision == "fp16", "the loss scale could change between the steps over "
             "which a version's gradient accumulates; use bf16 or fp32"),
            ("--checkpoint-every, --resume, --stop-at or --max-restarts",
             bool(r.checkpoint_every or r.resume or r.stop_at or p.max_restarts),
             "between steps the older weight version and its micro-batches are still in flight, so the run "
             "saves only at its end; drop them")):
        if used:
            raise UserError(f"--pp-schedule pipedream-2bw does not combine with {flag}: {why}.")


def _check_pipeline(p: ParallelConfig) -> None:
    if p.pp == 1:
        for flag, used in (("--microbatches", (p.microbatches or 1) > 1),
                           ("--virtual-stages", (p.virtual_stages or 1) > 1)):
            if used:
                raise UserError(f"{flag} shapes a pipeline, which needs --pp 2 or more; add --pp, or use "
                                f"--grad-accum for more micro-batches per step.")
        return
    try:
        schedules.check(p.pp_schedule, p.pp, *p.pipeline_sizes())
    except ValueError as exc:
        raise UserError(f"{exc}.") from None
    if p.zero == 3:
        raise UserError(f"--zero 3 gathers and frees each layer around the whole model's forward and "
                        f"backward, which pipeline stages never run as one; use --zero 1 or 2 with --pp {p.pp}.")
