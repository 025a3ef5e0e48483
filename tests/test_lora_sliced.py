"""LoRA from a Hugging Face folder read slice by slice (finetune/sliced.py): the model built on the meta
device with its adapters, split, then each rank's frozen base read from the files and its adapters made.

Each ZeRO-3 rank reads about half of the base and holds exactly the elements of every weight (base and
adapters) that the whole load gives; under tp each rank's slices are the whole load's; the adapters'
``A`` is the same whole or sliced, on one rank or two, and depends on the seed and the layer only.
Parity with one device under other layouts, and a resume across layouts: ``pytest -m slow
tests/test_lora_sliced.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scaletrain.commands.parity import run_parity
from scaletrain.config import Config, FinetuneConfig
from scaletrain.finetune.adapters import add_adapters
from scaletrain.finetune.hf import read_hf_model
from scaletrain.finetune.sliced import FolderSource, materialize
from scaletrain.job.base_model import as_finetune, start_from_base
from scaletrain.job.data_setup import prepare_data
from scaletrain.parallel.tensor import parallelize_tensor
from scaletrain.runtime.mesh import Group
from tests.distributed import run_distributed
from tests.test_llama_hf import SEQ
from tests.test_lora_zero3 import _config as zero3_config
from tests.test_lora_zero3 import llama_and_prose
from tests.trainers import assert_resumes_both_ways, build_trainer

SEED = 7


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    return llama_and_prose(tmp_path_factory.mktemp("lora-sliced"))


def _config(base: tuple[Path, Path], root: Path, **changes) -> Config:
    return zero3_config(base, root, seed=SEED, **changes)


def _whole(folder: Path, seed: int, quantize: str = "none") -> dict[str, torch.Tensor]:
    """The adapted model as the whole load makes it: built with values, the base loaded (and coded in 4
    bits with nf4), the adapters added; its weights and a 4-bit base's code buffers."""
    hf_model = read_hf_model(folder)
    family_cfg = hf_model.family_cfg(Config().replace(**hf_model.values).model, SEQ)
    model = hf_model.spec.build(family_cfg)
    start_from_base(model, FinetuneConfig(base=str(folder), lora_rank=4, quantize=quantize), hf_model.spec, seed)
    return {name: tensor.detach() for name, tensor in (*model.named_parameters(), *model.named_buffers())}


def _tp_slices(folder: Path, tp: int, seed: int) -> list[tuple[dict[str, torch.Tensor], dict]]:
    """Each tp rank's weights read slice by slice, as the layout reads them (no process needed: the
    split and the reads communicate nothing), and the split of each split weight, by name."""
    hf_model = read_hf_model(folder)
    spec, family_cfg = hf_model.spec, hf_model.family_cfg(Config().replace(**hf_model.values).model, SEQ)
    ranks = []
    for rank in range(tp):
        with torch.device("meta"):
            model = spec.build(family_cfg)
        add_adapters(model, FinetuneConfig(lora_rank=4), spec, seed)
        source = FolderSource(hf_model, family_cfg)
        source.adapt(model, seed, {})
        splits = parallelize_tensor(model, spec.tensor_plan(family_cfg), None, Group("tp", tuple(range(tp)), rank),
                                    sequence_parallel=False, dropout=0.0).splits if tp > 1 else {}
        materialize(model, source, torch.device("cpu"), splits, rank)
        ranks.append(({name: p.detach() for name, p in model.named_parameters()},
                      {name: splits[p] for name, p in model.named_parameters() if p in splits}))
    return ranks


def test_the_adapters_start_alike_whole_or_sliced_on_one_rank_or_split(base):
    """Every weight, base and adapters, of one rank read slice by slice equals the whole load's, and each
    of two tp ranks holds exactly its slices of them (a column layer's B and a row layer's A split)."""
    folder, _ = base
    whole = _whole(folder, SEED)
    for tp in (1, 2):
        for rank, (held, splits) in enumerate(_tp_slices(folder, tp, SEED)):
            assert held.keys() == whole.keys()
            for name, tensor in held.items():
                expected = splits[name].local(whole[name], rank) if name in splits else whole[name]
                assert torch.equal(tensor, expected), (tp, rank, name)
            if tp == 2:
                assert {name.rsplit(".", 1)[1] for name in splits if "lora" in name} == {"lora_A", "lora_B"}
    a_names = sorted(name for name in whole if name.endswith("lora_A"))
    first, second = whole[a_names[0]], whole[a_names[1]]
    bound = 1 / math.sqrt(first.shape[1])  # Kaiming-uniform with a = sqrt(5)
    assert 0.8 * bound < first.abs().max() <= bound
    assert not torch.equal(first.flatten()[:16], second.flatten()[:16])  # each layer its own draw
    assert not torch.equal(_whole(folder, SEED + 1)[a_names[0]], first)  # and each seed
    assert all(not tensor.any() for name, tensor in whole.items() if name.endswith("lora_B"))


def _zero3_shards(rank: int, n: int, cfg: Config, spec) -> tuple[dict, int]:
    """This rank's elements of every weight under ZeRO-3, by name ([start, stop) of its flattening and
    the values), and the bytes it read from the folder."""
    layout = build_trainer(rank, n, cfg, spec).layout
    zero = layout.zero
    names = {id(t): name for name, t in (*layout.model.named_parameters(), *layout.model.named_buffers())}
    held = {name: ((0, t.numel()), t) for name, t in layout.model.named_buffers()}  # those ZeRO left whole
    for unit in [*zero.units, *zero.frozen_units]:
        for i, param in enumerate(unit.params):
            held[names[id(param)]] = (unit.span(i, zero.group.rank),
                                      unit.in_shard(unit.shard, i, zero.group.rank).clone())
    return held, layout.folder.reader.bytes_read


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_each_zero3_rank_reads_its_shards_of_the_base_and_makes_its_adapters(base, tmp_path, quantize):
    """dp2 ZeRO-3: each rank reads about half of the float base (never all of it) and every matrix a
    4-bit base codes whole, one at a time; its shard of every weight, and of every 4-bit code and
    scale, is the whole load's elements, the adapters' A included (about 6 s each)."""
    cfg = as_finetune(_config(base, tmp_path, nproc=2, dp=2, zero=3, micro_batch=2, quantize=quantize))
    spec = prepare_data(cfg, Path(cfg.data.cache_dir))
    whole = _whole(base[0], SEED, quantize)
    float_base = _whole(base[0], SEED)
    coded = [name.removesuffix(".base.weight_shape") for name in whole if name.endswith("weight_shape")]
    read_whole = sum(float_base[f"{name}.base.weight"].numel() * 4 for name in coded)  # the folder holds fp32
    halved = sum(t.numel() * 4 for name, t in float_base.items() if "lora" not in name) - read_whole
    ranks = run_distributed(_zero3_shards, 2, cfg, spec, timeout_s=120)
    for held, bytes_read in ranks:
        assert held.keys() == whole.keys()
        assert read_whole + 0.4 * halved < bytes_read < read_whole + 0.6 * halved
        for name, ((start, stop), values) in held.items():
            assert torch.equal(values.flatten(), whole[name].flatten()[start:stop]), name
    for name, tensor in whole.items():  # the two shards cover every element
        spans = sorted(span for span, _ in (held[name] for held, _ in ranks))
        assert spans[0][0] == 0 and spans[0][1] in (spans[1][0], tensor.numel()), name
        assert spans[-1][1] == tensor.numel(), name
    assert len(coded) == (7 * 2 if quantize == "nf4" else 0)  # every adapted layer of both blocks, coded


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("changes", [
    dict(nproc=2, tp=2, sp=True),
    dict(nproc=2, pp=2, zero=3, micro_batch=2),
    dict(nproc=2, dp=2, zero=3, micro_batch=2, lora_modules_to_save="embed,head"),
], ids=["tp2-sp", "pp2-zero3", "zero3-modules-to-save"])
def test_a_sliced_lora_layout_reproduces_one_device(base, tmp_path, changes):
    """scaletrain parity at fp32's 1e-5: tp's slices of base and adapters, a pipeline's stages under
    ZeRO-3 (which shards the adapters and leaves each stage's frozen base whole, read after it), and
    the embedding and head trained whole beside the adapters, read as shards (about 10 s each)."""
    report = run_parity(_config(base, tmp_path, **changes), tolerance=1e-5)
    assert report.passed, report.to_json()
    assert report.reference_losses[-1] < report.reference_losses[0]


@pytest.mark.slow
@pytest.mark.numerics
def test_a_sliced_lora_zero3_checkpoint_resumes_on_one_device_and_back(base, tmp_path):
    """Saved under dp2 ZeRO-3 after step 2, resumed on one process, and the other way: steps 3 and 4 as
    the uninterrupted run's (fp32, 1e-5; about 25 s)."""
    cfg = as_finetune(_config(base, tmp_path / "zero3", steps=4, nproc=2, dp=2, zero=3, micro_batch=2))
    one = as_finetune(_config(base, tmp_path / "one", steps=4))
    assert_resumes_both_ways(cfg, one, prepare_data(cfg, Path(cfg.data.cache_dir)), 2)
