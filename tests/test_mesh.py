"""ParallelDims arithmetic and validation, without any processes."""

import itertools

import pytest

from scaletrain.errors import UserError
from scaletrain.runtime.mesh import DIM_NAMES, ParallelDims, group_name

LAYOUTS = [
    ParallelDims(),
    ParallelDims(dp=2, tp=2),
    ParallelDims(dp=2, pp=2, tp=2),
    ParallelDims(dp=3, cp=2),
    ParallelDims(dp=2, ep=2, pp=2, cp=2, tp=2),
    ParallelDims(dp=2, pp=3, tp=2, order=("tp", "pp", "dp", "cp", "ep")),
]
ALL_GROUP_DIMS = [(name,) for name in DIM_NAMES] + [("dp", "cp"), ("dp", "ep"), ("dp", "ep", "cp")]


def test_infer_fills_dp_from_the_world():
    assert ParallelDims.infer(8, tp=2) == ParallelDims(dp=4, tp=2)
    assert ParallelDims.infer(8, pp=2, cp=2, tp=2) == ParallelDims(dp=1, pp=2, cp=2, tp=2)
    assert ParallelDims.infer(6, dp=3, tp=2) == ParallelDims(dp=3, tp=2)
    assert ParallelDims.infer(1).world_size == 1


def test_infer_refuses_sizes_that_do_not_divide_the_world():
    with pytest.raises(UserError, match=r"--pp 1 x --cp 1 x --tp 3 x --ep 1 = 3 does not divide the world of 4"):
        ParallelDims.infer(4, tp=3)


def test_product_must_equal_the_world():
    message = (
        "--dp 2 x --pp 1 x --cp 1 x --tp 3 x --ep 1 = 6 ranks, but the world has 4 processes; "
        "choose sizes whose product is 4."
    )
    with pytest.raises(UserError) as caught:
        ParallelDims(dp=2, tp=3).validate(4)
    assert str(caught.value) == message
    with pytest.raises(UserError, match="= 6 ranks, but the world has 4"):
        ParallelDims.infer(4, dp=2, tp=3)
    ParallelDims(dp=2, tp=3).validate(6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_sizes_must_be_whole_and_positive(bad):
    with pytest.raises(UserError, match="--tp must be a whole number of at least 1"):
        ParallelDims(tp=bad)
    with pytest.raises(UserError, match="--tp must be a whole number of at least 1"):
        ParallelDims.infer(4, tp=bad)


@pytest.mark.parametrize("order", [("dp", "tp"), ("dp", "dp", "pp", "cp", "tp"), ("dp", "ep", "pp", "cp", "xx")])
def test_order_must_be_a_permutation(order):
    with pytest.raises(UserError, match="must name each of dp,ep,pp,cp,tp exactly once"):
        ParallelDims(order=order)


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: d.describe())
def test_coords_and_rank_of_round_trip(dims):
    seen = set()
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert list(coords) == list(dims.order)
        assert dims.rank_of(coords) == rank
        seen.add(tuple(coords.values()))
    assert len(seen) == dims.world_size
    with pytest.raises(ValueError):
        dims.coords(dims.world_size)


def test_tp_is_innermost_and_dp_outermost():
    dims = ParallelDims(dp=2, tp=2)
    assert dims.group_ranks("tp", 0) == [0, 1]
    assert dims.group_ranks("tp", 3) == [2, 3]
    assert dims.group_ranks("dp", 1) == [1, 3]
    assert dims.coords(2) == {"dp": 1, "ep": 0, "pp": 0, "cp": 0, "tp": 0}
    big = ParallelDims(dp=2, pp=2, tp=2)
    assert big.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert big.all_groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert big.all_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert big.all_groups(("dp", "pp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_custom_order_puts_the_first_dim_outermost():
    dims = ParallelDims(dp=2, tp=2, order=("tp", "ep", "pp", "cp", "dp"))
    assert dims.all_groups("dp") == [[0, 1], [2, 3]]
    assert dims.all_groups("tp") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: d.describe())
@pytest.mark.parametrize("along", ALL_GROUP_DIMS, ids=group_name)
def test_groups_partition_the_world(dims, along):
    groups = dims.all_groups(along)
    members = sorted(itertools.chain.from_iterable(groups))
    assert members == list(range(dims.world_size))
    expected_size = 1
    for name in along:
        expected_size *= getattr(dims, name)
    for group in groups:
        assert len(group) == expected_size
        for rank in group:
            assert dims.group_ranks(along, rank) == group
            # Members agree on every coordinate outside the group's dims.
            outside = {n: c for n, c in dims.coords(rank).items() if n not in along}
            assert outside == {n: c for n, c in dims.coords(group[0]).items() if n not in along}


def test_describe_and_layout_table():
    assert ParallelDims(dp=2, tp=2).describe() == "dp2 x tp2"
    assert ParallelDims(dp=2, pp=2, tp=2).describe() == "dp2 x pp2 x tp2"
    assert ParallelDims().describe() == "single rank"
    table = ParallelDims(dp=2, tp=2).layout_table().splitlines()
    assert table[0].split() == ["rank", "dp", "ep", "pp", "cp", "tp"]
    assert table[3].split() == ["2", "1", "0", "0", "0", "0"]
    assert len(table) == 5


def test_group_names_follow_dim_order():
    assert group_name(("cp", "dp")) == "dp_cp"
    assert group_name("tp") == "tp"
    with pytest.raises(ValueError):
        group_name("xy")


def test_model_fits():
    ParallelDims(dp=2, tp=4, pp=2, cp=2, ep=2).validate_for_model(n_heads=8, n_layers=4, seq_len=64, n_experts=4)
    ParallelDims(dp=4).validate_for_model(n_heads=None, n_layers=None, seq_len=None)


@pytest.mark.parametrize(
    ("dims", "model", "phrase"),
    [
        (ParallelDims(tp=3), {"n_heads": 8}, "--tp 3 must divide the model's 8 attention heads"),
        (ParallelDims(tp=2), {"n_heads": None}, "--tp 2 splits attention heads, but this model has none"),
        (ParallelDims(pp=5), {"n_layers": 4}, "--pp 5 needs at least 5 layers, but the model has 4"),
        (ParallelDims(pp=2), {"n_layers": None}, "--pp 2 splits a stack of layers, but this model has none"),
        (ParallelDims(cp=3), {"seq_len": 128}, "--cp 3 must divide the sequence length 128"),
        (ParallelDims(cp=2), {"seq_len": None}, "--cp 2 splits the sequence, but this model has none"),
        (ParallelDims(ep=2), {"n_experts": None}, "--ep needs a mixture-of-experts model"),
        (ParallelDims(ep=3), {"n_experts": 8}, "--ep 3 must divide the model's 8 experts"),
    ],
)
def test_model_misfits(dims, model, phrase):
    arguments = {"n_heads": 8, "n_layers": 4, "seq_len": 128, "n_experts": 8} | model
    with pytest.raises(UserError, match=phrase):
        dims.validate_for_model(**arguments)
