"""The planner on every family, read through the model spec alone.

The layouts of tests/test_plan.py run on llama-tiny (RMSNorm, rotary positions,
grouped-query attention with 2 key/value heads for 4 query heads, a SwiGLU MLP,
an untied head): memory within 5% of the ledger, collectives exactly. One
block's saved activations equal the formula of planner/activations.py byte for
byte, for several key/value head counts and precisions (fp8's float8 layers too), and a
mixture-of-experts block's too. And the planner weighs
Llama 3 8B and 70B from meta-device builds alone: their weights are their
parameter counts, and ``scaletrain plan`` recommends a layout for each.
"""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.config import Config, ModelConfig
from scaletrain.models import spec_for
from scaletrain.planner import activations
from scaletrain.planner.hardware import DEVICES, Cluster
from scaletrain.planner.inventory import Planned, whole_model
from scaletrain.planner.predict import _flops, predict
from scaletrain.techniques.fp8 import Float8, convert_to_float8
from scaletrain.train.layout import loss_fn
from scaletrain.train.memory import ActivationMeter
from tests.test_plan import CASES, assert_predicted, measure_layouts

LLAMA3_8B_PARAMS = 8_030_261_248  # Meta's count for Llama 3.1 8B: embedding, 32 blocks, norm, untied head
H100_X8 = Cluster(DEVICES["H100"], 8, 8)


# -- against the ledgers of real runs ---------------------------------------------
@pytest.fixture(scope="module")
def measured(corpus, tmp_path_factory) -> tuple[dict, int]:
    return measure_layouts("llama-tiny", corpus, tmp_path_factory.mktemp("plan-families"))


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{name}" for n, name in CASES])
def test_the_planner_predicts_the_ledgers_of_a_real_llama_run(measured, case):
    results, vocab = measured
    cfg, ledgers = results[case]
    assert_predicted(cfg, case[0], vocab, ledgers)


# -- one block, tensor by tensor --------------------------------------------------
def _saved_peak(model_cfg: ModelConfig, precision: str) -> int:
    """Saved-activation peak of one forward and backward on one device (no recompute: the
    end of the forward, where every block's tensors are alive)."""
    spec = spec_for(model_cfg.name)
    torch.manual_seed(0)
    model = spec.build(spec.configure(model_cfg, 96, 32))
    if precision == "fp8":
        convert_to_float8(list(model.blocks), Float8.on(torch.device("cpu")))
    x, y = torch.randint(0, 96, (4, 32)), torch.randint(0, 96, (4, 32))
    with ActivationMeter(model) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            logits = model(x)
        loss_fn(logits, y).backward()
    return meter.peak


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("preset, kv_heads", [("gpt-tiny", None), ("llama-tiny", 1), ("llama-tiny", 2),
                                              ("llama-tiny", 4)])
def test_one_block_saves_what_the_formula_counts(preset, kv_heads, precision):
    """The difference between a 2-block and a 1-block model is one block's saved bytes:
    exactly `activations.block`, whatever the key/value heads (multi-query to none shared),
    and under fp8 with the float8 layers' codes in place of their inputs."""
    one, two = (ModelConfig(name=preset, n_layers=layers, n_kv_heads=kv_heads) for layers in (1, 2))
    model = Planned.of(one, 96, 32)
    x = activations.shape_of(model.shape, model.tensor_plan, 4, 1, False, 1, precision, "fp32")
    assert _saved_peak(two, precision) - _saved_peak(one, precision) == activations.block(x)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_one_mixture_of_experts_block_saves_what_the_formula_counts(preset, precision):
    """A block whose MLP is a mixture of 4 experts, each token routed to 2: the routing, the
    rows, each expert's MLP on its rows and the combine, `activations.block` with experts
    (dropless: the rows are k per position whatever the routing)."""
    one, two = (ModelConfig(name=preset, n_layers=layers, moe_experts=4, moe_top_k=2) for layers in (1, 2))
    model = Planned.of(one, 96, 32)
    x = activations.shape_of(model.shape, model.tensor_plan, 4, 1, False, 1, precision, "fp32")
    assert _saved_peak(two, precision) - _saved_peak(one, precision) == activations.block(x, experts=True)


def test_grouped_query_attention_saves_no_narrower_tensor_but_copies_narrower_weights():
    """k and v are repeated to the query heads before attention saves them: fewer key/value
    heads change the block's activations only through autocast's weight copies."""
    def block(kv_heads: int, precision: str) -> int:
        model = Planned.of(ModelConfig(name="llama-tiny", n_kv_heads=kv_heads), 96, 32)
        return activations.block(activations.shape_of(model.shape, model.tensor_plan, 4, 1, False, 1, precision,
                                                      "fp32"))

    assert block(1, "fp32") == block(4, "fp32")
    assert block(4, "bf16") - block(1, "bf16") == 2 * 2 * 64 * 16 * 3  # k and v: 3 more heads of 16, 2 bytes


# -- FLOPs and traffic ------------------------------------------------------------
def test_flops_count_grouped_query_attention_and_swiglu():
    """6N + 12*L*a*d*s with N the linear weights (k and v n_kv_heads wide, three SwiGLU
    matrices, the untied head; the embedding's lookup is free); a recomputed block reruns
    2N_block + 4*a*d*s."""
    model = Planned.of(ModelConfig(name="llama3-8b"), 1, 1024)
    m = model.shape
    h, d, f = m.d_model, m.head_dim, m.ffn_hidden
    block = 2 * h * m.n_heads * d + 2 * h * m.n_kv_heads * d + 3 * h * f
    attention = 4 * m.n_heads * d * m.seq_len
    per_token = 6 * (m.n_layers * block + m.vocab * h) + 3 * m.n_layers * attention
    flops = _flops(model, "full", tokens=1)
    assert flops["model"] == pytest.approx(per_token, rel=1e-12)
    assert flops["recompute"] == pytest.approx(m.n_layers * (2 * block + attention), rel=1e-12)
    assert _flops(model, "selective", tokens=1)["recompute"] == m.n_layers * attention
    assert whole_model(model).flops_per_token() == pytest.approx(per_token, rel=1e-12)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_traffic_does_not_depend_on_key_value_heads(sp):
    """A region crosses the tp group once each way, whatever width its k and v have."""
    def tp_traffic(kv_heads: int) -> dict:
        cfg = Config().replace(name="llama-tiny", n_kv_heads=kv_heads, seq_len=32, micro_batch=4, tp=2, sp=sp)
        return {op: groups["tp"] for op, groups in predict(cfg, 2, 96, H100_X8).comm[0].items() if "tp" in groups}

    assert tp_traffic(2) == tp_traffic(4)


# -- Llama 3 on a cluster ---------------------------------------------------------
def _llama3_8b(**layout) -> Config:
    return Config().replace(name="llama3-8b", seq_len=1024, micro_batch=1, precision="bf16", **layout)


@pytest.mark.parametrize("param_dtype, nbytes", [("fp32", 4), ("bf16", 2)])
def test_llama3_8b_weights_are_its_parameters(param_dtype, nbytes):
    whole = predict(_llama3_8b(param_dtype=param_dtype), 8, 1, H100_X8)
    assert whole.memory["params"] == nbytes * LLAMA3_8B_PARAMS
    # A pipeline's stages hold every weight once (nothing is tied), whatever their cut.
    stages = predict(_llama3_8b(param_dtype=param_dtype, pp=4, microbatches=4), 8, 1, H100_X8).stages
    assert sum(stage["params"] for stage in stages) == nbytes * LLAMA3_8B_PARAMS
    # Tensor parallelism halves every matrix; the norms stay whole.
    norms = (2 * 32 + 1) * 4096
    halved = predict(_llama3_8b(param_dtype=param_dtype, tp=2), 8, 1, H100_X8).memory["params"]
    assert halved == nbytes * ((LLAMA3_8B_PARAMS - norms) // 2 + norms)


@pytest.mark.parametrize("model, gpus", [("llama3-8b", 8),
                                         pytest.param("llama3-70b", 64, marks=pytest.mark.slow)])  # a 30 s search
def test_plan_recommends_a_layout_for_llama3(capsys, model, gpus):
    """The whole search from meta-device builds: a layout that fits an 80 GB H100 and fills the cluster."""
    assert main(["plan", "--model", model, "--gpus", str(gpus), "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["candidates"][0]
    layout = best["layout"]
    assert best["fits"] and best["memory_bytes"]["total"] <= DEVICES["H100"].memory_bytes
    assert layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] * layout["ep"] == gpus
    assert best["tokens_per_s"] > 0 and data["global_batch"] == 8 * gpus
