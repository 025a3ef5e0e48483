"""LoRA through the library (scaletrain/library_lora.py): a transformers Llama built from a config,
``setup(model, lora_rank=4, ...)`` under ZeRO-3 and tp on two gloo processes against one process
(each step's loss and gradient norm, the adapters' only, and the whole model's weights at fp32's
1e-5), the base bit-identical after training, the optimizer stepping the adapters only, a resume,
the adapters merged out of a checkpoint, and the refusals.

The weights are compared by the whole-model rule (commands/parity.py), not the adapters alone: A's
first gradient comes at step 2 (B starts at zero), small in places, where Adam's division by its own
root mean square turns one element's rounding into a visible step (measured under tp=2: one element
of A 2.9e-5 apart, the adapters' figure 6.6e-6, the whole model's 1.5e-6)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import scaletrain
from scaletrain import UserError
from scaletrain.commands.parity import rel_diff, relative_diffs
from scaletrain.finetune.lora import ADAPTER_PARAMS, LoRALinear, adapters, apply_lora, merged_tensors
from scaletrain.library_checks import engine_config
from scaletrain.library_lora import add_library_adapters
from scaletrain.models.hf_plans import ready_plan
from scaletrain.runtime.spawn import spawn_local
from scaletrain.train import checkpoint as ckpt
from tests.test_library_plans import hf_llama, token_batch

pytest.importorskip("transformers")

LORA = dict(lora_rank=4, lora_alpha=8.0, lr=1e-2, warmup_steps=1, steps=3)
ADAPTED = {f"model.layers.{i}.{kind}" for i in range(2) for kind in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # the ready plan's Column and Row layers


def built() -> nn.Module:
    torch.manual_seed(0)
    return hf_llama()


def _train(options: dict, folder: str, steps: int) -> tuple[list[float], list[float], list[str]]:
    """A user's loop on this rank's rows of each global batch of 8: forward, backward, step; then a
    checkpoint. The step's losses and gradient norms, and the names of what the optimizer steps."""
    engine = scaletrain.setup(built(), **LORA, **options)
    with engine:
        readers = engine.layout.replicas.batch
        losses, norms = [], []
        for step in range(steps):
            inputs, targets = token_batch(step)
            rows = inputs.shape[0] // readers.size
            x, y = (t[readers.rank * rows:][:rows].to(engine.device) for t in (inputs, targets))
            engine.backward(engine.cross_entropy(engine(x), y))
            record = engine.step()
            losses.append(record["loss"])
            norms.append(record["grad_norm"])
        stepped = [name for name, _ in engine.layout.named_step_tensors()]
        engine.save(folder)
    return losses, norms, stepped


def _run(nproc: int, options: dict, folder: Path) -> tuple[list[float], list[float], list[str], dict]:
    losses, norms, stepped = spawn_local(nproc, _train, (options, str(folder), 2))[0]
    return losses, norms, stepped, ckpt.read_model_tensors(ckpt.latest_checkpoint(folder))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[float], list[float], list[str], dict]:
    """One process, the whole global batch: what every layout must reproduce."""
    return _run(1, {}, tmp_path_factory.mktemp("lora-reference"))


# Not in the portable-kernel rerun (marker numerics): adapters under ZeRO-3 and tp are rerun there
# through the command (tests/test_lora_zero3.py, tests/test_lora_layouts.py), the same code.
@pytest.mark.parametrize("nproc, options", [
    (2, dict(zero=3)),
    (2, dict(tp=2)),
    pytest.param(2, dict(tp=2, sp=True), marks=pytest.mark.slow),
    pytest.param(4, dict(tp=2, zero=3), marks=pytest.mark.slow),
], ids=["zero3", "tp2", "tp2-sp", "dp2-tp2-zero3"])
def test_lora_under_a_layout_equals_one_process_and_trains_the_adapters_only(reference, tmp_path, nproc, options):
    ref_losses, ref_norms, _, ref_tensors = reference
    losses, norms, stepped, tensors = _run(nproc, options, tmp_path)
    assert max(map(rel_diff, losses + norms, ref_losses + ref_norms)) <= 1e-5, (losses, ref_losses, norms, ref_norms)
    assert relative_diffs(tensors, ref_tensors)[1] <= 1e-5
    assert ref_losses[1] < ref_losses[0]
    # what the optimizer steps: every adapter, nothing else (ZeRO-3's pieces and tp's slices by their names)
    adapters = {key for key in tensors if key.endswith(ADAPTER_PARAMS)}
    assert {key.rsplit(".", 1)[0] for key in adapters} == ADAPTED
    assert set(stepped) <= adapters and len(set(stepped)) > 0
    # the base, read back whole from the checkpoint, is the model as built, bit for bit; the adapters moved
    initial = built().state_dict()
    base = {key.replace(".base.", "."): value for key, value in tensors.items() if key not in adapters}
    assert base.keys() == initial.keys()
    assert all(torch.equal(base[key], initial[key]) for key in initial)
    assert all(tensors[key].abs().sum() > 0 for key in adapters if key.endswith("lora_B"))  # B starts at zero


def _steps(engine, first: int, last: int) -> list[float]:
    return [engine.train_step([token_batch(step)], engine.cross_entropy)["loss"] for step in range(first, last)]


@pytest.mark.numerics
def test_a_lora_checkpoint_resumes_exactly_and_merges_into_the_plain_model(tmp_path):
    """Three steps at once, or two, a checkpoint, a new engine on a fresh model, one more: the same
    losses. The checkpoint's adapters folded into their bases (finetune/lora.py `merged_tensors`) load
    into the plain transformers model, which then computes the adapted model's logits."""
    ids = token_batch(9)[0]
    with scaletrain.setup(built(), **LORA, zero=3) as engine:
        straight = _steps(engine, 0, 3)
        engine.model.eval()
        with torch.no_grad():
            adapted = engine(ids).logits
    with scaletrain.setup(built(), **LORA, zero=3) as engine:
        first = _steps(engine, 0, 2)
        engine.save(tmp_path)
    with scaletrain.setup(built(), **LORA, zero=3) as engine:
        assert engine.load(tmp_path) == {}
        resumed = _steps(engine, 2, 3)
        engine.save(tmp_path)
    assert first + resumed == pytest.approx(straight, rel=1e-6)
    plain = built().eval()
    plain.load_state_dict(merged_tensors(ckpt.read_model_tensors(ckpt.latest_checkpoint(tmp_path)),
                                         LORA["lora_alpha"] / LORA["lora_rank"]))
    with torch.no_grad():
        merged = plain(ids).logits
    assert rel_diff(merged.norm().item(), adapted.norm().item()) < 1e-5
    assert torch.allclose(merged, adapted, rtol=1e-4, atol=1e-5)


def adapted_twice() -> nn.Module:
    model = built()
    apply_lora(model, ["q_proj"], 4, 8.0, 0.0)
    return model


@pytest.mark.parametrize("make_model, options, words", [
    (built, dict(lora_rank=-1), "lora_rank=-1 must be a rank of at least 1 (or 0: no adapters"),
    (built, dict(lora_alpha=32, lora_targets="q_proj"),
     "lora_alpha, lora_targets set LoRA's adapters, which lora_rank=0 leaves out"),
    (built, dict(lora_rank=4, lora_dropout=1.0), "lora_dropout=1.0 is the probability of zeroing"),
    (built, dict(lora_rank=4, lora_targets="q_proj,qkv"), "lora_targets names 'qkv', which matches no linear "
     "layer of the model by its last names (model.named_modules()); the linear layers' last names are: down_proj, "
     "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj."),
    (built, dict(lora_rank=4, lora_targets=[]), "lora_targets names an empty name"),
    (built, dict(lora_rank=4, lora_targets=7), "setup() option 'lora_targets' must be str"),
    (lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), dict(lora_rank=4),
     "lora_rank=4 puts adapters beside linear layers, and the model has no plan that names its projections"),
    (adapted_twice, dict(lora_rank=4), "the model holds LoRA adapters already"),
], ids=["negative-rank", "options-without-rank", "dropout", "no-match", "empty", "type", "no-default", "twice"])
def test_lora_options_that_cannot_work_are_refused_before_any_work(make_model, options, words):
    with pytest.raises(UserError) as refusal:
        scaletrain.setup(make_model(), **options)
    assert str(refusal.value).startswith(words)


def test_targets_in_a_list_and_the_vocabulary_split_head_under_tp():
    """A list of names is the flag's comma-separated string; only the adapters train, until they are
    taken out again; under tp an adapter on the head, which the plan splits by vocabulary, is one sentence."""
    given = {"lora_targets": ["q_proj", "self_attn.v_proj"]}
    model = built()
    take_out = add_library_adapters(model, engine_config(dict(lora_rank=4, **given)).finetune, given,
                                    ready_plan(model, 2, False), 2)
    names = [f"model.layers.{i}.self_attn.{kind}" for i in range(2) for kind in ("q_proj", "v_proj")]
    assert [name for name, module in model.named_modules() if isinstance(module, LoRALinear)] == names
    assert [name for name, param in model.named_parameters() if param.requires_grad] == \
        [f"{name}.{part}" for name in names for part in ADAPTER_PARAMS]
    take_out()
    assert not adapters(model) and all(param.requires_grad for param in model.parameters())
    assert model.state_dict().keys() == built().state_dict().keys()
    head = {"lora_targets": "lm_head"}
    with pytest.raises(UserError, match=r"^lora_targets adapts 'lm_head', which tp=2 splits by vocabulary"):
        add_library_adapters(model, engine_config(dict(lora_rank=4, **head)).finetune, head,
                             ready_plan(model, 2, False), 2)
    add_library_adapters(model, engine_config(dict(lora_rank=4, **head)).finetune, head, ready_plan(model, 1, False), 1)
    assert [module.base for module in adapters(model)] == [model.lm_head.base]


def test_a_refusal_after_the_adapters_leaves_the_model_as_it_came_and_a_wasted_rank_is_said():
    model = built()
    with pytest.raises(UserError, match=r"^recompute='selective' recomputes the attention"):
        scaletrain.setup(model, lora_rank=4, recompute="selective")
    assert not adapters(model) and all(param.requires_grad for param in model.parameters())
    with pytest.warns(UserWarning, match=r"^lora_rank=40 is above 32, min\(in, out\) of model.layers.0.self_attn"
                                         r".k_proj .* lora_rank=32 or less wastes none."):
        with scaletrain.setup(model, lora_rank=40, lora_targets="k_proj"):
            pass


@pytest.mark.slow
@pytest.mark.numerics
def test_check_parity_takes_the_lora_options_into_both_runs():
    report = scaletrain.check_parity(hf_llama, token_batch, nproc=2, steps=2, lr=1e-2, warmup_steps=1, lora_rank=4,
                                     zero=3)
    assert report.passed, scaletrain.format_parity(report)
    assert all(".lora_" in name or ".base." in name for name in report.param_rel_diffs if "_proj" in name)


DOCS = Path(__file__).resolve().parent.parent / "docs" / "library.md"


@pytest.mark.slow
def test_the_docs_lora_script_runs_on_two_processes(tmp_path):
    """docs/library.md's LoRA script as it stands, under scaletrain run --nproc 2: four records, and a
    merged folder that transformers loads, whose embedding is the seeded model's and whose adapted
    layers are not."""
    import transformers

    script = re.search(r"^```python\n(# lora\.py\n.*?)^```", DOCS.read_text(), re.S | re.M).group(1)
    (tmp_path / "lora.py").write_text(script)
    result = subprocess.run([sys.executable, "-m", "scaletrain", "run", "--nproc", "2", "lora.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line[:12] for line in result.stdout.splitlines() if line.startswith("{'step'")] == \
        [f"{{'step': {step}," for step in (10, 20, 30, 40)]
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "runs" / "lora" / "merged")
    torch.manual_seed(0)
    initial = transformers.LlamaForCausalLM(merged.config)
    assert torch.equal(merged.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    q_proj = merged.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj, initial.model.layers[0].self_attn.q_proj.weight)
