"""The pipeline runtime: one rank executes its list of actions (schedules.py).

For every step of the list, in order:

    a batch of transfers   post its sends (one ``batch_isend_irecv``) and its
                           receives (another), then wait for the receives only:
                           sends complete in the background and are waited for
                           at the end of the round, their tensors kept alive
                           until then (two calls, because a backend may return
                           one handle for a whole batch, and waiting for a send
                           would stall the rank until its neighbour asks for it)
    F  (micro m, stage s)  input: the micro-batch (first stage) or the received
                           activation, made a leaf that requires grad; output
                           kept for backward; on the last stage the output is
                           the loss, ``loss_fn(logits, targets) / divisor``;
                           then what the stage adds to the loss itself
                           (``stage_loss``: a mixture of experts' auxiliary
                           losses), taken at once, as the stage's next forward
                           overwrites what its layers left
    BW / B                 backward from the stage's output with the received
                           gradient (the last stage: from the scaled loss) and
                           from the stage's own loss term, scaled alike; the
                           input's ``.grad`` is what the next transfer sends
                           upstream. B holds the weight gradients back
                           (weight_grad.py) ...
    W                      ... and W computes them

Shapes are known ahead: every activation and gradient crossing a stage
boundary has the shape the caller gives for its micro-batch (``[micro_batch,
seq, d_model]`` for a decoder), so a receive allocates its buffer and no size is
ever exchanged.

The loss is averaged over micro-batches exactly as on one device: each
micro-batch's mean loss is divided by the number of micro-batches in the step
before its backward, so the gradients add up to the gradient of the mean.

PipeDream-2BW (two_bw.py): every F and BW runs on its micro-batch's weight
version, and a round ends with micro-batches in flight (their stage inputs,
outputs and one received gradient), which the next round's backwards finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from scaletrain.parallel.pipeline.partition import Stage
from scaletrain.parallel.pipeline.schedules import Action, Schedule, Span
from scaletrain.parallel.pipeline.two_bw import WeightVersions
from scaletrain.parallel.pipeline.weight_grad import WeightGradStore
from scaletrain.runtime.comm import Comm, Pending
from scaletrain.runtime.mesh import Group


class PipelineRuntime:
    """Runs a `Schedule`'s actions for this rank's stages over the pp ``group``."""

    def __init__(self, stages: list[Stage], comm: Comm, group: Group, store: WeightGradStore | None = None):
        self.stages = {stage.index: stage for stage in stages}
        self.comm, self.group, self.store = comm, group, store
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._own_losses: dict[tuple[int, int], torch.Tensor] = {}  # a stage's loss term, by (micro, stage)
        self._received: dict[tuple[str, int, int], torch.Tensor] = {}
        self._sending: list[tuple[Pending, list[torch.Tensor]]] = []

    def run(self, schedule: Schedule, *, boundary: Callable[[int], tuple[tuple[int, ...], torch.dtype, torch.device]],
            inputs: Callable[[int], torch.Tensor], loss: Callable[[int, torch.Tensor], torch.Tensor] | None,
            documents: Callable[[int], torch.Tensor | None] = lambda m: None,
            backward_scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
            forward_context: Callable[[], AbstractContextManager] = nullcontext,
            clock: Callable[[], float] | None = None,
            versions: WeightVersions | None = None,
            stage_loss: Callable[[Stage], torch.Tensor | None] | None = None
            ) -> tuple[dict[int, torch.Tensor], list[Span]]:
        """Execute this rank's list of ``schedule``. ``inputs(m)`` is micro-batch
        m's input to the first stage, ``documents(m)`` its packed rows' documents (None: not
        packed) for every stage, ``loss(m, output)`` its loss on the last
        (None: forward only, the outputs are returned), ``boundary(m)`` the
        (shape, dtype, device) of its activations between stages; ``versions``:
        PipeDream-2BW's weights; ``stage_loss(stage)``, called in training right after each
        forward of ``stage``, what that forward adds to the loss (None: nothing), which the
        micro-batch's backward on the stage takes with its output. Returns the last stage's
        per-micro-batch losses (or outputs), detached, and with ``clock`` the
        computations' spans in its time."""
        training = loss is not None and torch.is_grad_enabled()
        results: dict[int, torch.Tensor] = {}
        spans: list[Span] = []
        for step in schedule.steps(self.group.rank):
            if isinstance(step, tuple):
                self._transfer(step, boundary, training)
                continue
            start = clock() if clock else 0.0
            with versions.computing(step) if versions else nullcontext():
                if step.kind == "F":
                    result = self._forward(step, inputs, documents, loss, forward_context, training, stage_loss)
                    if result is not None:
                        results[step.micro] = result
                elif step.kind in ("BW", "B"):
                    self._backward(step, backward_scale, deferred=step.kind == "B")
                else:
                    self.store.flush((step.micro, step.stage))
            if clock:
                spans.append(Span(step, start, clock()))
        for pending, _ in self._sending:
            pending.wait()
        self._sending.clear()
        if versions is None and (self._inputs or self._outputs or self._received or self._own_losses):
            raise RuntimeError(f"schedule {schedule.name} left tensors behind on rank {self.group.rank}")
        return results, spans

    # -- computations ----------------------------------------------------------
    def _forward(self, a: Action, inputs, documents, loss, forward_context, training: bool,
                 stage_loss) -> torch.Tensor | None:
        stage = self.stages[a.stage]
        if stage.is_first:
            x = inputs(a.micro)
        else:
            x = self._received.pop(("act", a.micro, a.stage - 1))
            if training:
                x.requires_grad_(True)
                self._inputs[a.micro, a.stage] = x
        with forward_context():
            y = stage(x, documents(a.micro))
        own = stage_loss(stage) if training and stage_loss else None
        if own is not None:
            self._own_losses[a.micro, a.stage] = own
        if not stage.is_last:
            self._outputs[a.micro, a.stage] = y
            return None
        if loss is None:
            return y.detach()
        y = loss(a.micro, y)
        if training:
            self._outputs[a.micro, a.stage] = y
        return y.detach()

    def _backward(self, a: Action, scale, deferred: bool) -> None:
        y = self._outputs.pop((a.micro, a.stage))
        own = self._own_losses.pop((a.micro, a.stage), None)
        if self.stages[a.stage].is_last:  # y is the divided loss: the stage's own term joins it
            outputs, grads = [scale(y if own is None else y + own)], [None]
        else:  # the received gradient is of the scaled loss already, so the own term is scaled to match
            outputs, grads = [y], [self._received.pop(("grad", a.micro, a.stage + 1))]
            if own is not None:
                outputs.append(scale(own))
                grads.append(None)
        with self.store.deferring((a.micro, a.stage)) if deferred else nullcontext():
            torch.autograd.backward(outputs, grad_tensors=grads)

    # -- transfers ---------------------------------------------------------------
    def _transfer(self, batch: tuple[Action, ...], boundary, training: bool) -> None:
        sends, recvs = [], []
        for a in batch:
            if a.kind == "send_act":
                out = self._outputs[a.micro, a.stage] if training else self._outputs.pop((a.micro, a.stage))
                sends.append(("send", out.detach().contiguous(), a.peer))
            elif a.kind == "send_grad":
                sends.append(("send", self._inputs.pop((a.micro, a.stage)).grad, a.peer))
            else:
                shape, dtype, device = boundary(a.micro)
                buffer = torch.empty(shape, dtype=dtype, device=device)
                self._received[a.kind[5:], a.micro, a.stage] = buffer
                recvs.append(("recv", buffer, a.peer))
        if sends:
            self._sending.append((self.comm.batch_isend_irecv(sends, self.group), [t for _, t, _ in sends]))
        if recvs:
            self.comm.batch_isend_irecv(recvs, self.group).wait()


def timer() -> Callable[[], float]:
    """Seconds since now, for recording spans."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
