"""--optimizer adamw8bit (optim/adamw8bit.py): the dynamic tree maps, block-wise quantization's
error bound, AdamW's trajectory followed, the bytes the planner predicts, an exact resume."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import Config
from scaletrain.optim import build_optimizer
from scaletrain.optim.adamw8bit import (
    BLOCK,
    AdamW8bit,
    dequantize,
    dynamic_map,
    quantize,
)
from scaletrain.planner.memory import optimizer_bytes
from scaletrain.train.memory import optimizer_state, tensor_bytes
from tests.trainers import losses_of_run


def test_maps_hold_zero_one_and_small_decades():
    signed, unsigned = dynamic_map(signed=True), dynamic_map(signed=False)
    assert len(signed) == 255 and len(unsigned) == 256  # 8-bit codes
    assert torch.equal(signed, -signed.flip(0))  # symmetric
    assert {0.0, 1.0, -1.0} <= set(signed.tolist()) and unsigned.min() == 0 and unsigned.max() == 1
    # dynamic: values down to 1e-6 (signed) and 1e-7 (unsigned), each decade finer than a linear map
    assert 0 < signed[signed > 0].min() < 2e-6 and 0 < unsigned[unsigned > 0].min() < 2e-7
    assert (signed.diff() > 0).all() and (unsigned.diff() > 0).all()


def test_block_wise_error_is_bounded_by_each_blocks_own_maximum():
    qmap = dynamic_map(signed=True)
    x = torch.randn(3 * BLOCK + 100, generator=torch.Generator().manual_seed(0))
    x[5] = 1000.0  # an outlier in the first block
    codes, absmax = quantize(x, qmap)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and absmax.shape == (4,)
    y = dequantize(codes, absmax, qmap, x.shape)
    widest_gap = qmap.diff().max()
    for block in range(4):
        part = slice(block * BLOCK, (block + 1) * BLOCK)
        assert (y[part] - x[part]).abs().max() <= absmax[block] * widest_gap / 2 + 1e-6
        assert y[part].abs().max() == x[part].abs().max()  # the block's maximum is exact
    # the outlier costs only its own block: the others keep their relative precision
    later = slice(BLOCK, 3 * BLOCK)
    assert ((y[later] - x[later]).abs() / x[later].abs()).median() < 0.02


def _regression(optimizer_class, steps: int = 150) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    optimizer = optimizer_class(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    inputs = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    targets = inputs[:, :3].sum(1, keepdim=True)
    losses = []
    for _ in range(steps):
        loss = (model(inputs) - targets).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def test_follows_adamw():
    exact, _ = _regression(torch.optim.AdamW)
    eight_bit, model = _regression(AdamW8bit)
    assert eight_bit[-1] < 1e-3 * eight_bit[0]  # it trains
    for step in (10, 50):  # and along AdamW's path, within the quantization's own error
        assert abs(eight_bit[step] - exact[step]) < 0.1 * exact[step]


@pytest.mark.parametrize("name", ["adamw8bit", "adamw"])
def test_state_bytes_equal_the_planners(name):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    cfg = Config().replace(optimizer=name)
    optimizer = build_optimizer([{"params": list(model.parameters()), "weight_decay": 0.0}], cfg.train)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    assert tensor_bytes(optimizer_state(optimizer)) == optimizer_bytes(params, name)
    big = params[0]  # the 128 x 64 matrix: 8-bit codes plus two scales per block
    if name == "adamw8bit":
        assert optimizer_bytes([big], name) == 2 * big.numel() + 8 * 4 + 4


def test_checkpoints_hold_fp32_moments_and_pack_back_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    optimizer = AdamW8bit(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(8, 128)).square().mean().backward()
        optimizer.step()
    weight = optimizer.state[model.weight]
    packed = {key: value.clone() for key, value in weight.items()}
    with optimizer.unpacked():  # AdamW's format: fp32 tensors shaped like the weight
        assert set(weight) == {"step", "exp_avg", "exp_avg_sq"}
        assert weight["exp_avg"].shape == model.weight.shape and weight["exp_avg"].dtype == torch.float32
    assert weight.keys() == packed.keys()
    assert all(torch.equal(weight[key], packed[key]) for key in packed)  # codes and scales unchanged


def _final_weights(cfg, out, **changes) -> dict[str, torch.Tensor]:
    from scaletrain.commands.train import launch
    from scaletrain.train import checkpoint as ckpt

    return ckpt.read_model_tensors(launch(cfg.replace(out=str(out), **changes)).checkpoint)


def test_zero_shards_the_8bit_state_and_matches_one_process_within_its_quantization_error(tiny_cfg, tmp_path):
    """ZeRO-2 over two ranks quantizes each rank's flat shard in blocks of its own, which cut
    the weights elsewhere than one process does: the runs differ, but by less than the
    quantization's own error (8-bit against fp32 moments, in one process)."""
    from scaletrain.commands.parity import relative_diffs

    cfg = tiny_cfg.replace(lr=3e-3, steps=6)
    one = _final_weights(cfg, tmp_path / "one", optimizer="adamw8bit")
    exact = _final_weights(cfg, tmp_path / "exact", optimizer="adamw")
    sharded = _final_weights(cfg, tmp_path / "zero", optimizer="adamw8bit", nproc=2, zero=2, micro_batch=2)
    quantization_error = relative_diffs(one, exact)[1]
    assert quantization_error > 1e-6  # the 8-bit state is in use
    assert relative_diffs(sharded, one)[1] < quantization_error
@pytest.mark.numerics
def test_a_resumed_run_continues_exactly(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(optimizer="adamw8bit", lr=3e-3)

    straight = losses_of_run(cfg, tmp_path / "straight")
    losses_of_run(cfg, tmp_path / "cut", stop_at=2)
    assert losses_of_run(cfg, tmp_path / "cut", resume=True) == straight


@pytest.mark.slow  # 15 s; 8-bit state sharded by ZeRO runs by default (test_zero_shards_the_8bit_state_...)
def test_a_run_under_zero_resumes_exactly(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(optimizer="adamw8bit", lr=3e-3, nproc=2, zero=1, micro_batch=2)
    straight = losses_of_run(cfg, tmp_path / "straight")
    losses_of_run(cfg, tmp_path / "cut", stop_at=2)
    assert losses_of_run(cfg, tmp_path / "cut", resume=True) == straight
