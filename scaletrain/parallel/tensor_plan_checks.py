"""Tensor-parallel plans that would train with wrong gradients, refused before any work.

Where parallel/tensor.py puts f and g decides what a plan may say:

    Region          f on the module's first input: identity forward, its gradient
                    all-reduced backward (sp: all-gathered, reduce-scattered back);
                    the region's own dropout stream begins (RegionRNG)
    Column          a whole input, a slice of the output features: the input's
                    gradient on each rank is a partial sum, whole only after an f
    Row             a slice of the input features, partial outputs summed: g; the
                    region's dropout stream ends
    VocabEmbedding  a g of its own (ids in, no gradient to sum)
    VocabHead       an f of its own: a region by itself, its logits left split
    PositionEmbedding  no collective (under sp each rank looks up its positions)

So each module gets one style (the transform applies the first entry that
matches a module and would ignore the rest); a Column or a Row lies inside a
Region, the module whose input the f makes whole and sums the gradient of; a
Region holds a Row, the g that leaves it (without one its outputs stay partial
or split, and the gradient of a replicated input is summed t times over); and
no f lies inside another region (the gradient all-reduced twice, t times too
large). The embeddings and the head need no Region. The rules read module
names only, so they are cheap enough for every setup and every transform.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.spec import Column, Region, Row, TensorPlan, VocabHead


def _ancestors(name: str) -> list[str]:
    """The names of the modules that hold ``name``, nearest first, the model itself ('') last."""
    parents = []
    while name:
        name = name.rpartition(".")[0]
        parents.append(name)
    return parents


def _inside(name: str, holder: str) -> bool:
    return name != holder and (holder == "" or name.startswith(holder + "."))


def check_tensor_plan(model: nn.Module, plan: TensorPlan) -> None:
    """UserError, one sentence, for a plan that would give ``model`` wrong gradients (module docstring)."""
    styles: dict[str, object] = {}
    for name, _ in model.named_modules():
        matching = [(pattern, style) for pattern, style in plan if fnmatch.fnmatchcase(name, pattern)]
        if len(matching) > 1:
            (first, style), (second, other) = matching[:2]
            raise UserError(f"the plan's tensor entries {first!r} ({type(style).__name__}) and {second!r} "
                            f"({type(other).__name__}) both match the module {name!r}, overlapping or contradictory "
                            f"styles on one module of which only the first would apply; give each module one entry.")
        if matching:
            styles[name] = matching[0][1]
    for name, style in styles.items():
        region = next((parent for parent in _ancestors(name) if isinstance(styles.get(parent), Region)), None)
        kind = type(style).__name__
        if isinstance(style, Column) and region is None:
            raise UserError(f"the plan's Column {name!r} is inside no Region, so its input's gradient, a partial sum "
                            f"on each rank, would never be all-reduced; give the module that holds it and its Row "
                            f"(its attention or MLP) a Region entry.")
        if isinstance(style, Row) and region is None:
            raise UserError(f"the plan's Row {name!r} is inside no Region, so it sums outputs of a region that was "
                            f"never entered; give the module that holds it and its Column (its attention or MLP) a "
                            f"Region entry.")
        if isinstance(style, (Region, VocabHead)) and region is not None:
            raise UserError(f"the plan's {kind} {name!r} enters a region inside the Region {region!r}, so its "
                            f"input's gradient would be all-reduced twice; put the Regions on modules that do not "
                            f"hold one another (each attention and each MLP), and the VocabHead outside them.")
        if isinstance(style, Region) and not any(isinstance(inner, Row) for inner_name, inner in styles.items()
                                                 if _inside(inner_name, name)):
            raise UserError(f"the plan's Region {name!r} holds no Row, so the region is never left: its outputs "
                            f"would stay partial or split over the ranks; make the layer that ends it (its output "
                            f"projection) a Row.")
