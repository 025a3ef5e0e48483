"""FP8 training (techniques/fp8.py): the casts and their power-of-two scales, the product and its
gradients against the formulas, training against bf16, and fp8 layouts against one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from scaletrain.commands.cli import main
from scaletrain.commands.parity import run_parity
from scaletrain.config import Config
from scaletrain.job.data_setup import prepare_data
from scaletrain.planner.hardware import DEVICES, Cluster
from scaletrain.planner.predict import predict
from scaletrain.techniques.fp8 import (
    E4M3,
    E5M2,
    Float8,
    Float8Linear,
    convert_to_float8,
    power_of_two_scale,
    scaled_matmul,
    to_float8,
)
from tests.trainers import build_trainer, losses_of_run

LLAMA = dict(name="llama-tiny", steps=3, precision="fp8")


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_scale_is_the_largest_power_of_two_that_fits(dtype):
    largest = torch.finfo(dtype).max
    for amax in (1e-30, 3e-5, 0.7, 1.0, 448.0, 6e4, 3e30):
        scale = power_of_two_scale(torch.tensor(amax), dtype).item()
        assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
        assert amax * scale <= largest < amax * scale * 2
    assert power_of_two_scale(torch.tensor(0.0), dtype).item() == 1.0


def test_a_cast_rounds_as_the_format_and_saturates_nothing_in_range():
    torch.manual_seed(0)
    x = torch.randn(1000) * 3
    encoded, inverse = to_float8(x, E4M3)
    assert encoded.dtype == E4M3 and inverse.item() == 1 / power_of_two_scale(x.abs().amax(), E4M3).item()
    scale = 1 / inverse
    assert torch.equal(encoded.float(), (x * scale).to(E4M3).float())  # no value needed saturating
    assert encoded.float().abs().max() <= 448


def test_the_rounding_does_not_depend_on_the_power_of_two():
    """The parity argument (module docstring): a rank that sees part of a tensor picks another scale,
    yet decodes every element to the same value, but those in the format's subnormal range."""
    torch.manual_seed(0)
    x = torch.randn(4096)
    x[100] = 10.0  # outside the part: the whole tensor's scale is 2^5, the part's at least 2^6
    whole, whole_inverse = to_float8(x, E4M3)
    part, part_inverse = to_float8(x[:64], E4M3)  # a smaller amax, a larger scale
    assert part_inverse.item() < whole_inverse.item()
    normal = x[:64].abs() >= 2.0**-6 * whole_inverse  # above the smallest normal under both scales
    decoded_whole = whole[:64].float() * whole_inverse
    decoded_part = part.float() * part_inverse
    assert normal.sum() > 60
    assert torch.equal(decoded_whole[normal], decoded_part[normal])
    step = 2.0**-9 * whole_inverse  # the whole tensor's subnormal step bounds the others
    assert (decoded_whole - decoded_part).abs().max() <= step


def test_the_emulated_product_is_the_tensor_cores_own():
    """Off a GPU the product is emulated; torch's own scaled product, where the CPU has one, agrees
    to the last bit: the emulation is the GPU path's contract, checked here."""
    torch.manual_seed(0)
    a, a_inverse = to_float8(torch.randn(32, 64), E4M3)
    b, b_inverse = to_float8(torch.randn(48, 64), E4M3)
    emulated = scaled_matmul(a, a_inverse, b.t(), b_inverse, torch.bfloat16)
    try:
        native = torch._scaled_mm(a, b.t(), scale_a=a_inverse, scale_b=b_inverse, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as missing:
        pytest.skip(f"this CPU build has no scaled product: {missing}")
    assert torch.equal(emulated, native)


def test_the_layer_and_its_gradients_follow_the_formulas():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    plain = nn.Linear(64, 32)
    plain.load_state_dict(layer.state_dict())
    assert convert_to_float8([nn.Sequential(layer)], Float8(tensor_cores=False)) == 1
    assert isinstance(layer, Float8Linear) and layer.float8 == Float8(tensor_cores=False)
    x = torch.randn(2, 8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)

    rows = x.detach().reshape(-1, 64)
    x8, x_inv = to_float8(rows, E4M3)
    w8, w_inv = to_float8(layer.weight.detach(), E4M3)
    g8, g_inv = to_float8(grad.reshape(-1, 32), E5M2)
    expected_y = ((x8.float() @ w8.float().t()) * (x_inv * w_inv)).bfloat16() + layer.bias.detach().bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y.reshape(-1, 32), expected_y)
    assert torch.equal(x.grad.reshape(-1, 64), (g8.float() @ w8.float()) * (g_inv * w_inv))
    assert torch.equal(layer.weight.grad, (g8.float().t() @ x8.float()) * (g_inv * x_inv))
    # fp8 is not bf16: the product moved, by about e4m3's rounding (2^-4 of each input)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = plain(x.detach())
    difference = ((y.float() - reference.float()).norm() / reference.float().norm()).item()
    assert 1e-3 < difference < 0.1


def test_fp8_trains_as_bf16_does(tiny_cfg, tmp_path):
    """llama-tiny for 12 steps: the blocks' products in float8 follow bf16's losses within fp8's
    rounding, and the run really converted its layers."""
    cfg = tiny_cfg.replace(name="llama-tiny", steps=12, lr=3e-3)
    fp8 = losses_of_run(cfg, tmp_path / "fp8", precision="fp8")
    bf16 = losses_of_run(cfg, tmp_path / "bf16", precision="bf16")
    assert fp8[-1] < fp8[0] - 0.5
    assert fp8 != bf16
    assert fp8 == pytest.approx(bf16, rel=2e-2)
    prepared = prepare_data(cfg, Path(cfg.data.cache_dir))
    model = build_trainer(0, 1, cfg.replace(precision="fp8", out=str(tmp_path / "built")), prepared).layout.model
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert converted and set(linears) - set(converted) == {"head"}  # every block's linear, not the head


# The portable-kernel rerun (marker numerics) takes dp2 and tp2-sp; cp2's ring runs fp8's same products.
@pytest.mark.parametrize("changes", [
    pytest.param(dict(nproc=2, dp=2), marks=pytest.mark.numerics),
    dict(nproc=2, cp=2),
    pytest.param(dict(nproc=2, tp=2), marks=pytest.mark.slow),  # within tp2-sp
    pytest.param(dict(nproc=2, tp=2, sp=True), marks=pytest.mark.numerics),
    pytest.param(dict(nproc=2, pp=2, zero=1, microbatches=2), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, dp=2, zero=3, param_dtype="bf16"), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, dp=2, recompute="full", grad_accum=2), marks=pytest.mark.slow),
    pytest.param(dict(nproc=2, ep=2, moe_experts=4, moe_top_k=2), marks=pytest.mark.slow),
], ids=["dp2", "cp2", "tp2", "tp2-sp", "pp2-zero1", "zero3-bf16-weights", "dp2-recompute-accum", "ep2"])
def test_an_fp8_layout_follows_the_fp8_reference(tiny_cfg, changes):
    """Every layout against one device running fp8 (docs/parity.md): the same casts to the last
    bit above the subnormals, so bf16's tolerance, which its output rounding sets, holds."""
    report = run_parity(tiny_cfg.replace(**{**LLAMA, **changes}), tolerance=1e-2)
    assert report.passed, report.to_json()


@pytest.mark.parametrize("flags, named", [
    (["--nproc", "2", "--pp", "2", "--pp-schedule", "zb-h1", "--microbatches", "2"], "zb-h1"),
    (["--param-dtype", "bf16", "--precision", "fp16"], "--precision bf16 or fp8"),
])
def test_what_fp8_does_not_combine_with_is_one_sentence(tiny_cfg, capsys, flags, named):
    precision = [] if "--precision" in flags else ["--precision", "fp8"]
    code = main(["train", "--model", "llama-tiny", *precision, *flags, "--out", tiny_cfg.run.out])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and named in err
    assert not Path(tiny_cfg.run.out).exists()


def test_the_planner_runs_the_blocks_products_at_the_fp8_rate():
    """An 8B-shaped step on one H100: faster in fp8 (the blocks' products at twice the rate,
    attention's at bf16's), by less than the products' own factor of two; the same weights and
    state, fewer activations (the blocks' layers keep one-byte codes of their inputs and weights
    where bf16 keeps autocast's two-byte copies)."""
    cfg = Config().replace(name="llama3-8b", seq_len=2048, micro_batch=1, dp=1)
    cluster = Cluster(DEVICES["H100"], 1, 8)
    bf16, fp8 = (predict(cfg.replace(precision=p), 1, 128256, cluster) for p in ("bf16", "fp8"))
    assert bf16.step_s / 2 < fp8.step_s < bf16.step_s / 1.2
    assert all(fp8.memory[name] == bf16.memory[name] for name in ("params", "grads", "optimizer"))
    assert fp8.memory["activations"] < bf16.memory["activations"]


@pytest.mark.slow
def test_fp8_compiles(tiny_cfg, tmp_path):
    """Compiled blocks with float8 layers follow the eager fp8 run within bf16's rounding."""
    cfg = tiny_cfg.replace(name="llama-tiny", steps=3, precision="fp8")
    compiled = losses_of_run(cfg, tmp_path / "compiled", compile=True)
    eager = losses_of_run(cfg, tmp_path / "eager")
    assert compiled == pytest.approx(eager, rel=1e-2)


def test_tensor_parallel_slices_take_the_float8_product():
    """A column-parallel slice inside a block switches to float8 as a plain linear layer does."""
    from types import SimpleNamespace

    from scaletrain.parallel.tensor import ColumnParallelLinear

    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(16, 32))
    sliced = ColumnParallelLinear(weight, SimpleNamespace(sequence_parallel=False))
    assert convert_to_float8([nn.Sequential(sliced)], Float8(tensor_cores=False)) == 1
    assert sliced.float8 == Float8(tensor_cores=False)
    x = torch.randn(8, 32)
    x8, x_inv = to_float8(x, E4M3)
    w8, w_inv = to_float8(weight.detach(), E4M3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sliced(x)
    assert torch.equal(y, ((x8.float() @ w8.float().t()) * (x_inv * w_inv)).bfloat16())


def test_an_fp8_gather_holds_what_the_products_cast():
    """--quantize-weights fp8 (parallel/hybrid.py): a weight rebuilt from its blocks' e4m3 codes
    is what a float8 layer's per-tensor cast decodes it to, but below the smallest normal; the
    gather moves a byte an element and a scale a block."""
    from scaletrain.parallel.hybrid import BLOCK, dequantize, quantize_fp8, quantized_shard_bytes

    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.logspace(-3, 0, 96)  # blocks of very different sizes
    codes, inverse = quantize_fp8(weight)
    assert codes.dtype == E4M3 and codes.numel() == weight.numel() and inverse.numel() == weight.numel() // BLOCK
    rebuilt = dequantize(codes, inverse).view_as(weight)
    cast, cast_inverse = to_float8(weight, E4M3)
    normal = weight.abs() >= 2.0**-6 * cast_inverse
    assert normal.float().mean() > 0.9
    assert torch.equal(rebuilt[normal], cast.float()[normal] * cast_inverse)
    recast, recast_inverse = to_float8(rebuilt, E4M3)  # what the layer's product casts: nothing moves
    assert torch.equal((recast.float() * recast_inverse)[normal], (cast.float() * cast_inverse)[normal])
    assert quantized_shard_bytes(BLOCK * 8) == BLOCK * 8 + 4 * 8


@pytest.mark.numerics
def test_fp8_gathers_under_zero3_follow_the_fp8_reference(tiny_cfg):
    """ZeRO-3 gathering its weights in fp8 against one device running fp8, which gathers nothing."""
    report = run_parity(tiny_cfg.replace(**LLAMA, nproc=2, dp=2, zero=3, param_dtype="bf16",
                                         quantize_weights="fp8"), tolerance=1e-2)
    assert report.passed, report.to_json()
