"""scaletrain as a library: your model, your data, your loop, on the engine the command runs.

    import scaletrain

    engine = scaletrain.setup(model, zero=3, precision="bf16", lr=3e-4, steps=1000, grad_accum=2)
    loader = DataLoader(dataset, batch_size=8, sampler=engine.sampler(len(dataset), batch_size=8))
    engine.load("run")                              # resume, if "run" holds a checkpoint
    for x, y in loader:                             # to step 1000: the sampler ends there
        loss = F.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)                       # grad_accum times per step
        if engine.ready:
            print(engine.step())                    # {'step': 1, 'loss': ..., 'grad_norm': ..., 'lr': ...}
    engine.save("run")
    engine.close()

`setup` joins the job (whatever launched it: ``scaletrain run --nproc N``,
torchrun, SLURM, mpirun, or plain ``python``), builds the mesh the options
ask for, starts every rank from rank 0's weights, and hands the model to the
same `Stepper` (train/stepper.py) that ``scaletrain train`` runs on: every
option is a field of that command (``zero=3`` is ``--zero 3``), so every
technique the command has, the library has, by one code path. A model needs
nothing for dp, ZeRO-1/2/3 (its repeated blocks are ZeRO-3's units), hybrid
sharding, local SGD, mixed precision, recompute, compile, offload and
accumulation; tp/sp, pp and cp need a `ModelPlan` (models/spec.py), the type
the built-in families' specs produce, and ready for tp/sp on the transformers
models of models/hf_plans.py; ep needs scaletrain's `MoE` layer.

From DeepSpeed's ``initialize`` and engine: one object that owns the wrapped
model and the optimizer, with ``backward`` and ``step`` that know the
accumulation and the mesh. From Fabric and Accelerate: the user's forward
and loss stay the user's (``engine(x)``), the launcher is separate from the
script (``scaletrain run``). Changed: the options are the command's own
flags, not a JSON schema or a strategy class; the optimizer is the engine's
(AdamW or Adafactor, as the command's, so ZeRO shards and offloads its state);
``step`` returns the step's numbers read once, and the sampler makes rank r's
batch a pure function of the step, read where the engine stands when the loop
begins, so resuming needs no sampler state and no order of calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.config import AUTO
from scaletrain.config_checks import setting_warnings
from scaletrain.data.batches import IGNORE_INDEX
from scaletrain.data.sampler import ShardedSampler
from scaletrain.errors import UserError
from scaletrain.finetune.lora import rank_above_width
from scaletrain.library_checks import (
    check_combinations,
    check_plan,
    engine_config,
    layout_for_world,
)
from scaletrain.library_lora import add_library_adapters
from scaletrain.models.hf_plans import ready_plan
from scaletrain.models.spec import ModelPlan
from scaletrain.parallel.data import replicate
from scaletrain.planner.auto import agreed, module_layout
from scaletrain.planner.gate import Machine, check_module
from scaletrain.runtime.launch import (
    DistRuntime,
    check_backend,
    connect,
    detect_environment,
    init_distributed,
    shutdown,
)
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.layout import Layout
from scaletrain.train.sampling import generate
from scaletrain.train.step_window import PendingStep, StepWindow
from scaletrain.train.stepper import Stepper


def setup(model: nn.Module, *, plan: ModelPlan | None = None, seq_len: int | None = None,
          sample: torch.Tensor | None = None, sync_batchnorm: bool = False, force: bool = False,
          **options: Any) -> Engine:
    """Join the job and put ``model`` under the layout ``options`` describe (module docstring).

    ``options`` are fields of ``scaletrain train`` by name: the layout (``dp``, ``tp``, ``sp``,
    ``pp``, ``cp``, ``ep``, ``zero``, ``shard_group``, ``sync_every``, ...), the optimizer and its
    schedule (``lr``, ``steps``, ``warmup_steps``, ``weight_decay``, ``grad_clip``, ``optimizer``,
    ...), ``precision``, ``param_dtype``, ``grad_accum``, ``recompute``, ``compile``, ``offload``,
    ``seed``. ``plan`` says how tp, pp and cp may split the model; ``seq_len`` is every sequence's
    length (cp); ``sample``, one micro-batch of inputs, is what ``pp_balance="time"`` times.
    ``sync_batchnorm=True`` makes every BatchNorm normalize by the statistics of the whole
    data-parallel batch, not each rank's own (parallel/batchnorm.py). ``lora_rank`` (with
    ``lora_alpha``, ``lora_dropout``, ``lora_targets``: the fields of ``scaletrain finetune``) freezes
    the model and trains LoRA's adapters beside its target layers only (library_lora.py).

    Before anything is allocated the planner prices the module on this rank: its weights,
    gradients and optimizer state under the layout, ZeRO's shards included, from its parameters
    (planner/gate.py). Its activations, which only its forward knows, are not priced, so only a
    module whose known part already exceeds the device's memory (a GPU's, or this machine's shared
    by its processes) is refused, in one sentence naming a setting that fits; ``force=True`` skips it.
    ``layout="auto"`` chooses ZeRO's stage (unless ``zero`` is given) by the same price: the lowest
    predicted to fit (planner/auto.py `module_layout`), said once by rank 0."""
    cfg = engine_config(options)
    env = detect_environment()
    dims = layout_for_world(cfg, env.world_size)
    plan = plan if plan is not None else ready_plan(model, dims.tp, cfg.parallel.sp)  # models/hf_plans.py
    # the base frozen and the adapters in before anything is checked or priced, as the command's
    take_out_adapters = add_library_adapters(model, cfg.finetune, options, plan, dims.tp, cfg.train.seed)
    try:
        check_plan(model, plan, dims, cfg, seq_len, sample)
        checked = check_combinations(cfg, model, seq_len, sync_batchnorm)
        machine = Machine.here(check_backend(cfg.parallel.backend, env) == "nccl", env.local_world_size,
                               env.local_rank)
        if not force and cfg.parallel.layout != AUTO:  # auto's choice is its own gate (planner/auto.py)
            check_module(model, checked, dims, machine)
    except UserError:  # a refusal leaves the user's model as it came
        take_out_adapters()
        raise
    if env.rank == 0:  # settings that do nothing, said once for the job
        for sentence in [*setting_warnings(cfg, options), rank_above_width(model, "lora_rank={}")]:
            if sentence:
                warnings.warn(sentence, stacklevel=2)
    runtime = init_distributed(env, timeout_s=cfg.parallel.timeout, backend=cfg.parallel.backend)
    try:
        if cfg.parallel.layout == AUTO:  # rank 0 chooses ZeRO's stage, every rank takes it
            zero, sentence = agreed(lambda: module_layout(model, checked, dims, machine, options, force), runtime)
            cfg = cfg.replace(zero=zero)
            if runtime.is_main:
                print(sentence)
        mesh, comm = connect(runtime, dims)
        # Every rank starts from rank 0's weights, whatever seed each built its model with.
        model.to(runtime.device)
        replicate([*model.parameters(), *model.buffers()], comm, mesh.group("world"))
        return Engine(runtime, Stepper(model, cfg.train, cfg.parallel, mesh, comm, runtime.device, plan=plan,
                                       seq_len=seq_len, sample=sample, sync_batchnorm=sync_batchnorm))
    except BaseException:
        shutdown(runtime, barrier=False)
        raise


class Engine:
    """The library's face of the engine: a user's model on a `Stepper` (train/stepper.py), with
    the protocol of a training loop: ``engine(*inputs)`` runs the forward, ``backward(loss)``
    each micro-batch's backward, ``step()`` the update once ``grad_accum`` backward calls are
    in; ``train_step`` runs a whole step (the way pipelines run); ``evaluate`` and ``generate``
    under any layout, on every rank; ``save``, ``load``, ``sampler``, ``close``. Made by `setup`;
    it keeps only where the user's loop stands, the stepper everything else."""

    def __init__(self, runtime: DistRuntime, stepper: Stepper):
        self.runtime, self.stepper = runtime, stepper
        self.steps_done = 0  # optimizer steps taken, the checkpoint's step
        self._backwards = 0  # backward calls in the step under way
        self._loss_sum = torch.zeros((), device=self.device)
        self._step_open = False  # a forward of the manual loop began the step
        self._samplers: list[ShardedSampler] = []  # the engine's samplers, which load checks are not reading
        self._said_past_end = False  # step() past ``steps`` is said once

    @property
    def model(self) -> nn.Module:
        """This rank's part of the model (split, cut, wrapped as the layout says)."""
        return self.stepper.model

    @property
    def layout(self) -> Layout:
        """Where each part of the model lives over the mesh, and what steps it (train/layout.py)."""
        return self.stepper.layout

    @property
    def device(self) -> torch.device:
        """This rank's device: where inputs go."""
        return self.stepper.device

    # -- where this process stands -------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        return self.stepper.mesh.rank

    @property
    def world_size(self) -> int:
        """How many processes the job has."""
        return self.stepper.mesh.dims.world_size

    @property
    def is_main(self) -> bool:
        """Whether this is the job's rank 0, the one that prints and writes."""
        return self.stepper.mesh.rank == 0

    @property
    def data_ranks(self) -> int:
        """How many ranks read different samples (dp x ep): each reads its share of a global batch."""
        return self.layout.replicas.batch.size

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches per optimizer step on each rank: ``grad_accum``, times the pipeline's per round."""
        return self.stepper.train.grad_accum * self.layout.micro_batches

    @property
    def ready(self) -> bool:
        """Whether the step's ``grad_accum`` backward calls are in, so ``step()`` may run."""
        return self._backwards == self.stepper.train.grad_accum

    @property
    def micro_batches_read(self) -> int:
        """Micro-batches this rank has trained on: where the engine's sampler reads on from."""
        return self.steps_done * self.micro_batches_per_step + self._backwards

    def sampler(self, size: int, batch_size: int | None = None, *, epochs: int | None = None, shuffle: bool = True,
                seed: int | None = None) -> ShardedSampler:
        """This rank's indices of a map-style dataset of ``size`` items, ``batch_size`` (default
        ``micro_batch``) per micro-batch: the ranks that read different samples (dp x ep) read
        disjoint slices of each global batch, the others (tp, pp, cp) the same (data/sampler.py).
        It reads from where the engine stands when the loop begins, so a resumed run reads on
        whether the sampler was built before ``load`` or after, to the run's end: ``steps``
        steps, or the whole steps of ``epochs`` passes over the dataset if those end first."""
        batch_size = batch_size or self.stepper.train.micro_batch
        readers = self.layout.replicas.batch
        per_step = self.micro_batches_per_step
        stop = self.stepper.train.steps * per_step
        if epochs is not None:
            per_epoch = size // (max(batch_size, 1) * readers.size)
            if epochs < 1 or epochs * per_epoch < per_step:
                raise UserError(f"sampler(epochs={epochs}) over {size} items, {batch_size} per micro-batch on "
                                f"{readers.size} rank(s), holds {max(epochs, 0) * per_epoch} micro-batch(es), fewer "
                                f"than one step's {per_step}; give more epochs or a smaller batch_size.")
            stop = min(stop, epochs * per_epoch // per_step * per_step)
        sampler = ShardedSampler(size, batch_size, rank=readers.rank, replicas=readers.size,
                                 seed=self.stepper.train.seed if seed is None else seed, shuffle=shuffle,
                                 start=lambda: self.micro_batches_read, stop=stop)
        self._samplers.append(sampler)
        return sampler

    def local(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inputs and targets [b, s, ...] on this rank's device; with cp, this rank's positions."""
        return self.layout.local(*batch)

    # -- a step, micro-batch by micro-batch ------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward under the engine's precision and the step's dropout seed: each rank
        draws its own rows' masks, so a layout's masks are not one process's (docs/library.md)."""
        if self.layout.pipeline:
            raise UserError("with pp the engine runs the forward stage by stage; call engine.train_step(micro_batches, "
                            "loss_fn) instead of engine(inputs).")
        if self.layout.model.training and not self._step_open:
            self._open_step()
        with self.stepper.forward_context():
            return self.layout.model(*args, **kwargs)

    def cross_entropy(self, logits: Any, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over targets other than -100, also of logits a tp plan's
        ``VocabHead`` left split over the vocabulary; ``logits`` may be a model's output that holds
        them as ``.logits`` (a transformers model's)."""
        logits = getattr(logits, "logits", logits)
        trained = (targets != IGNORE_INDEX).sum().clamp(min=1)
        with self.stepper.compression:
            return self.layout.loss_fn(logits, targets) * targets.numel() / trained

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss; the ``grad_accum``-th starts the gradients'
        average over the ranks."""
        if self._backwards == self.stepper.train.grad_accum:
            accum = self.stepper.train.grad_accum
            raise UserError(f"backward() was called {accum + 1} times with grad_accum={accum}; call engine.step() "
                            f"after every {accum}.")
        self._backwards += 1
        divided = loss / self.stepper.train.grad_accum
        self.stepper.backward_micro_batch(divided, final=self.ready)
        self._loss_sum += divided.detach()

    def step(self) -> dict[str, float]:
        """The optimizer step on the accumulated gradients; its loss (the global batch's mean),
        gradient norm, learning rate and skipped steps."""
        if self._backwards < self.stepper.train.grad_accum:
            raise UserError(f"step() was called after {self._backwards} of the step's {self.stepper.train.grad_accum} "
                            f"backward() calls (grad_accum); call engine.backward(loss) first.")
        return self._finish(self._loss_sum)

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """A whole step: the forward and backward of every (inputs, targets) micro-batch
        (``grad_accum`` of them; with pp, ``grad_accum x microbatches``), ``loss_fn(outputs,
        targets)`` the mean loss of one, then the update; the step's numbers."""
        wanted = self.micro_batches_per_step
        if len(micro_batches) != wanted or self._backwards:
            raise UserError(f"train_step() takes the step's {wanted} micro-batches (grad_accum x microbatches), with "
                            f"no backward() before it, not {len(micro_batches)}; give exactly {wanted}.")
        batches = [self.local(*batch) for batch in micro_batches]
        return self._read(self.stepper.step(self.steps_done, batches, loss_fn, float(len(batches))))

    def _open_step(self) -> None:
        self.stepper.start_step(self.steps_done)
        self._step_open = True

    def _finish(self, loss_sum: torch.Tensor) -> dict[str, float]:
        return self._read(self.stepper.update(self.steps_done, loss_sum))

    def _read(self, pending: PendingStep) -> dict[str, float]:
        """The step's numbers, read at once: a step of the library is over when it returns."""
        window = StepWindow(1, 0)
        window.add(pending)
        (read,) = window.read()
        self.steps_done += 1
        if self.steps_done > self.stepper.train.steps and not self._said_past_end and self.is_main:
            self._said_past_end = True
            warnings.warn(f"step {self.steps_done} is past steps={self.stepper.train.steps}, where the learning-rate "
                          f"schedule ends (it stays at its floor, min_lr_ratio x lr); give setup(steps=...) the "
                          f"run's length.", stacklevel=3)
        self._backwards, self._step_open = 0, False
        self._loss_sum = torch.zeros((), device=self.device)
        return {key: value for key, value in read.record.items() if key != "tokens_per_s"}

    # -- evaluation and generation, on every rank ----------------------------------------
    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> float:
        """The mean of ``loss_fn(outputs, targets)`` over every rank's (inputs, targets)
        micro-batches, the model in eval mode, under any layout (with pp, stage by stage; with cp,
        each rank's positions). Call it on every rank, each with its share (as `sampler` gives
        it): a rank holding a part of the model that stayed out would leave the others waiting;
        every rank gets the same number."""
        model, layout = self.layout.model, self.layout
        training = model.training
        model.eval()
        batches = [self.local(*batch) for batch in micro_batches]
        try:
            if layout.pipeline:  # the mean over the micro-batches, from the last stage to every stage
                mean = layout.pipeline.evaluate(batches, loss_fn, self.stepper.forward_context)
            else:  # summed on the device: one read, after the all-reduce
                mean = torch.zeros((), dtype=torch.float64, device=self.device)
                for x, y in batches:
                    with self.stepper.forward_context():
                        outputs = model(x)
                    mean += loss_fn(outputs, y).double() / len(batches)
        finally:
            model.train(training)
        total = torch.stack([torch.as_tensor(mean, dtype=torch.float64, device=self.device),
                             torch.ones((), dtype=torch.float64, device=self.device)])
        self.stepper.comm.all_reduce(total, layout.replicas.dense)  # the ranks reading other samples or positions
        return (total[0] / total[1]).item()

    def generate(self, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
                 top_k: int | None = 50, seed: int | None = None, context: int | None = None) -> torch.Tensor:
        """``prompt`` ids [batch, seq] and ``new_tokens`` more, sampled by a model that maps ids to
        logits [batch, seq, vocab] (top-k, then temperature; 0: the most likely id), the last
        ``context`` ids as input (default: ``seq_len`` of `setup`, else the whole sequence).
        Under any layout, on every rank: each holds a part of the model that every token's
        forward needs, and all draw the same ids, the ones one process draws (train/sampling.py)."""
        context = context or self.stepper.seq_len or prompt.shape[1] + new_tokens
        return generate(self.layout, prompt, new_tokens, context=context, vocab=None,
                        precision=self.stepper.train.precision, seed=self.stepper.train.seed if seed is None else seed,
                        temperature=temperature, top_k=top_k)

    # -- checkpoints -------------------------------------------------------------------
    def save(self, folder: str | Path, **state: Any) -> Path:
        """A checkpoint of the model and optimizer as they stand in ``folder/checkpoints/step_N``
        (every rank writes its part; any layout can load it), with ``state`` (JSON values)."""
        self.stepper.run_dir = Path(folder)
        return self.stepper.save_checkpoint(self.steps_done, {"user": state})

    def load(self, folder: str | Path) -> dict[str, Any] | None:
        """Resume from the newest complete checkpoint in ``folder``, whatever layout saved it: the
        model, the optimizer and the step; the ``state`` saved with it (None: nothing to resume)."""
        self.stepper.run_dir = Path(folder)
        latest = ckpt.latest_checkpoint(self.stepper.run_dir)
        if latest is None:
            return None
        reading = [s.reading_from for s in self._samplers if s.reading_from is not None]
        if reading:
            raise UserError(f"engine.load() came while a loader over engine.sampler() was reading from micro-batch "
                            f"{reading[0]}, so it would read on from there, not from the resumed step; call "
                            f"engine.load() before the loop over the loader begins.")
        saved = self.stepper.load_checkpoint(latest)
        self.steps_done = saved["step"]
        return saved.get("user", {})

    def close(self) -> None:
        """Leave the job: every rank waits for the others, then the process group ends."""
        shutdown(self.runtime)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """``close()``; after an exception without waiting for ranks that may never come."""
        shutdown(self.runtime, barrier=kind is None)
