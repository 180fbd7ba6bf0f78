"""Pipeline stages for a decoder: consecutive layers per stage, a plan inside each stage.

``stages=S`` cuts the ``R`` ranks into ``S`` meshes of ``R / S`` consecutive ranks
(stage ``s`` takes the ``s``-th block, so with a hostfile a stage can be one
host) and the decoder's layers into ``S`` runs of consecutive layers;
``stages=[10, 14]`` gives the layers of each stage. Inside a stage the base plan
(tensor parallelism by default) shards the stage's layers over its ranks, as it
would on one mesh of ``R / S`` ranks. Propagation then moves the activations
from one stage to the next (a send/recv between the meshes, also of a prompt of
run-time length), so each rank holds only its stage's weights and its layers'
key-value cache.

The layers are found from the weights' names, with no knowledge of model
families: a decoder's ``L`` layers are the weights named ``<prefix><i>_...`` for
``i`` in ``0..L-1``, the prefix shared by most weights (``p_model_model_layers_``
for Llama, ``p_model_transformer_h_`` for GPT-2). A weight outside the layers
goes with the first stage if the program reads it before the first layer (the
embedding), else with the last (the final norm, the LM head). Inputs go with the
first stage; the caches follow the layers that write them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
import logging
import re
from typing import Any, Sequence

import tvm
from tvm import relax
from tvm.relax.distributed import DeviceMesh as TVMDeviceMesh

from tvm_distx.compiler.pipeline import legalize_operators
from tvm_distx.errors import ArgumentError
from tvm_distx.ir import helpers as _ir
from tvm_distx.layout.mesh import set_device_meshes
from tvm_distx.layout.rules import ShardingRule
from tvm_distx.layout.sharding import TensorSharding
from tvm_distx.passes import AnnotateSharding, PropagateSharding

__all__ = ["PipelineStages", "pipeline_stages_of", "layer_prefix"]

logger = logging.getLogger(__name__)

_INDEX = re.compile(r"_(\d+)_")


def layer_prefix(names: Sequence[str]) -> tuple[str, int] | None:
    """The prefix of the layer weights among ``names`` and the layer count, or None.

    A candidate prefix is what precedes ``_<i>_`` in a name; the layers' prefix is
    the one whose indices are exactly ``0..L-1`` (``L >= 1``) and that names the
    most weights (an experts' prefix, inside a layer, names fewer).
    """
    indices: dict[str, set[int]] = defaultdict(set)
    counts: Counter = Counter()
    for name in names:
        for match in _INDEX.finditer(name):
            prefix = name[:match.start() + 1]
            indices[prefix].add(int(match.group(1)))
            counts[prefix] += 1
    found = [(counts[p], p) for p, seen in indices.items() if seen == set(range(len(seen)))]
    if not found:
        return None
    _, prefix = max(found)
    return prefix, len(indices[prefix])


@dataclass(frozen=True)
class PipelineStages:
    """Consecutive decoder layers per stage, each stage a mesh with ``base`` inside.

    Parameters
    ----------
    base : preset
        The plan inside a stage (any preset with ``.apply(mod, function)``).
    layers : tuple of int
        The number of layers of each stage, in order.
    ranks_per_stage : int
        The ranks of each stage's mesh.
    """

    base: Any
    layers: tuple[int, ...]
    ranks_per_stage: int

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return len(self.layers)

    def meshes(self) -> list[tuple[int, ...]]:
        """The stages' mesh shapes, on consecutive ranks."""
        return [(self.ranks_per_stage,)] * self.num_stages

    def stage_of_layer(self, layer: int) -> int:
        """The stage that runs decoder layer ``layer``."""
        end = 0
        for stage, count in enumerate(self.layers):
            end += count
            if layer < end:
                return stage
        raise ArgumentError(f"layer {layer} is beyond the {sum(self.layers)} layers of the "
                            "stages", hint="give every layer to a stage")

    def on_meshes(self, mod: tvm.IRModule) -> tvm.IRModule:
        """``mod`` with one mesh per stage."""
        return set_device_meshes(mod, self.meshes())

    def shard(self, mod: tvm.IRModule, functions: Sequence[str]) -> tvm.IRModule:
        """``functions`` of ``mod`` sharded by stages, on the stages' meshes.

        The base plan shards each function as on one mesh of a stage's ranks
        (the first stage's mesh); its annotations then move to the mesh of the
        stage they belong to, and every weight and token input it left alone is
        placed, replicated, on its stage.
        """
        one = set_device_meshes(mod, [(self.ranks_per_stage,)])
        for function in functions:
            one = self.base.apply(one, function)
        caches = self._cache_placements(one, functions)
        staged = self.on_meshes(one)
        for function in functions:
            staged = self._restage(staged, function, caches.get(function, {}))
        return staged

    def _cache_placements(self, one: tvm.IRModule, functions: Sequence[str]) -> dict:
        """Each function's cache parameters' placements within a stage, by name.

        On one rank per stage a cache is whole. On more, it is split as the plan
        splits the heads that write it: the placement propagation gives it on one
        stage's mesh.
        """
        if self.ranks_per_stage == 1:
            return {}
        propagated = PropagateSharding(require_legalized=True)(legalize_operators(one))
        out: dict = {}
        for function in functions:
            for param in propagated[function].params:
                sharding = TensorSharding.from_type(param.ty)
                if sharding is not None and _cache_layer(param.name) is not None:
                    out.setdefault(function, {})[param.name] = str(sharding.placement)
        return out

    def _restage(self, mod: tvm.IRModule, function: str, caches: dict) -> tvm.IRModule:
        meshes = list(mod.global_infos["mesh"])
        func = mod[function]
        stages = self._stages(func)
        inputs = {p for p in func.params if _is_placed(p) and not _is_weight(p)}
        moved = _MoveAnnotations(mod, meshes, stages, inputs).visit_expr(func)
        out = mod.clone()
        out[out.get_global_var(function)] = moved
        done = {b.value.args[0] for b in _bindings(moved)
                if _ir.is_call_to(b.value, "relax.dist.annotate_sharding")
                and isinstance(b.value.args[0], relax.Var)}
        rules = [ShardingRule(param=p.name, result="R", function=function,
                              meshes=f"mesh[{stages.get(p, 0)}]")
                 for p in moved.params if p not in done and _is_placed(p)]
        for param in moved.params:  # each layer's cache on its stage, split as its heads
            layer = _cache_layer(param.name) if param not in done and not _is_placed(param) \
                else None
            if layer is not None:
                rules.append(ShardingRule(param=param.name, result=caches.get(param.name, "R"),
                                          function=function,
                                          meshes=f"mesh[{self.stage_of_layer(layer)}]"))
        logger.info("%s: %d stages of %d ranks, layers %s", function, self.num_stages,
                    self.ranks_per_stage, list(self.layers))
        return AnnotateSharding(rules)(out) if rules else out

    def _stages(self, func: relax.Function) -> dict:
        """The stage of each weight parameter and of each binding's position (``"at"``)."""
        names = [p.name for p in func.params]
        found = layer_prefix(names)
        if found is None or found[1] != sum(self.layers):
            raise ArgumentError(
                f"pipeline stages of {sum(self.layers)} layers: the weights of "
                f"'{func.attrs['global_symbol'] if func.attrs else 'the function'}' show "
                f"{found[1] if found else 'no'} numbered layers",
                hint="stages cut a decoder's layers (CausalLM, export_decoder)")
        prefix, _ = found
        out: dict = {}
        for param in func.params:
            if param.name.startswith(prefix):
                out[param] = self.stage_of_layer(int(param.name[len(prefix):].split("_")[0]))
        for param in func.params:
            layer = _cache_layer(param.name)
            if layer is not None:
                out[param] = self.stage_of_layer(layer)
        # each binding's stage: the latest stage of what it reads (weights and caches
        # carry theirs; a value computed from token inputs only has none, -1)
        label: dict = dict(out)
        bindings = _bindings(func)
        first_layer_use, first_use, position = None, {}, []
        users: dict = defaultdict(list)
        for index, binding in enumerate(bindings):
            operands = _ir.operand_vars(binding.value)
            stage = max((label.get(v, -1) for v in operands), default=-1)
            for var in operands:
                first_use.setdefault(var, index)
                users[var].append(index)
                if var in out and first_layer_use is None and _is_weight(var):
                    first_layer_use = index
            label[binding.var] = stage
            position.append(stage)
        # a value of the token inputs alone that one later stage alone reads is made on
        # that stage (the positions of a cache write): it reads the stage's copy of them
        for index in reversed(range(len(bindings))):
            if position[index] < 0:
                read = {position[j] for j in users[bindings[index].var]}
                if len(read) == 1 and min(read) > 0:
                    position[index] = read.pop()
        last = self.num_stages - 1
        for param in func.params:
            if param not in out and _is_weight(param):
                before = first_layer_use is not None and first_use.get(param, 1 << 60) < \
                    first_layer_use
                out[param] = 0 if before else last
        out["at"] = position
        return out


@relax.expr_functor.mutator
class _MoveAnnotations(relax.PyExprMutator):
    """Every ``annotate_sharding`` on its stage's mesh (a weight's, or the position's); the
    token inputs read by a later stage read its own copy of them.

    A stage's kernel that reads a token input (a cache write reads the positions)
    and an annotated value of its stage would have operands on two meshes, which
    propagation does not resolve between annotated values: the stage reads a copy
    annotated on its mesh, which propagation moves there once.
    """

    def __init__(self, mod: tvm.IRModule, meshes: list[TVMDeviceMesh], stages: dict,
                 inputs: set) -> None:
        super().__init__(mod)
        self.meshes, self.stages, self.inputs = meshes, stages, inputs
        self.index = 0
        self.copies: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        stage = self.stages["at"][self.index]
        if _ir.is_call_to(value, "relax.dist.annotate_sharding"):
            target = value.args[0]
            new = relax.op.distributed.annotate_sharding(
                self.visit_expr(target), self.meshes[self.stages.get(target, max(stage, 0))],
                value.attrs.placement)
            self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                           self.builder_.normalize(new)))
        elif stage > 0 and isinstance(value, relax.Call) and \
                any(v in self.inputs for v in _ir.operand_vars(value)):
            args = [self._on_stage(a, stage) for a in value.args]
            new = relax.Call(value.op, args, value.attrs, value.ty_args, value.span)
            self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                           self.builder_.normalize(new)))
        else:
            super().visit_var_binding_(binding)
        self.index += 1

    def _on_stage(self, arg, stage: int):
        """``arg`` with each token input replaced by its copy on ``stage``'s mesh."""
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([self._on_stage(f, stage) for f in arg.fields])
        if not (isinstance(arg, relax.Var) and arg in self.inputs):
            return self.visit_expr(arg)
        key = (arg, stage)
        if key not in self.copies:
            replicated = "R" * len(self.meshes[stage].shape)
            self.copies[key] = self.builder_.emit(
                relax.op.distributed.annotate_sharding(
                    arg, self.meshes[stage],
                    tvm.relax.distributed.Placement.from_text(replicated)),
                name_hint=f"{arg.name}_stage{stage}")
        return self.copies[key]


def _bindings(func: relax.Function) -> list:
    return [b for block in func.body.blocks for b in block.bindings]


_CACHE = re.compile(r"^(?:key|value)_(\d+)$")


def _cache_layer(name: str) -> int | None:
    """The layer of a key-value cache parameter (``key_3``: 3), or None."""
    match = _CACHE.match(name)
    return int(match.group(1)) if match else None


def _is_weight(param: relax.Var) -> bool:
    return param.name.startswith("p_")


def _is_placed(param: relax.Var) -> bool:
    """Whether a parameter the base plan left alone is placed here: the weights and the
    token inputs (the caches follow the layers that write them, by propagation)."""
    if _is_weight(param):
        return True
    return param.name in ("input_ids", "cache_position", "position_ids", "attention_mask")


def pipeline_stages_of(stages, *, num_ranks: int, num_layers: int, base,
                       where: str = "CausalLM") -> PipelineStages | None:
    """The :class:`PipelineStages` of a user's ``stages=``, checked; None for one stage.

    Parameters
    ----------
    stages : int or sequence of int or None
        ``S`` stages of ``num_ranks / S`` ranks and about ``num_layers / S``
        layers each (the first stages take one more where it does not divide),
        or the layers of each stage.
    num_ranks, num_layers : int
    base : preset
        The plan inside a stage.
    where : str
        The API that was called, for messages.
    """
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple, type(None))):
        raise ArgumentError(f"{where}(stages={stages!r}): not a stage count or a list of "
                            "layers per stage", hint=f"{where}(..., stages=2) or "
                            "stages=[10, 14]", cli_hint="--stages 2 or --stages 10,14")
    if stages is None or stages == 1:
        return None
    if isinstance(stages, int):
        if not 1 <= stages <= num_layers:
            raise ArgumentError(f"{where}(stages={stages}): the model has {num_layers} layers",
                                hint=f"between 1 and {num_layers} stages",
                                cli_hint=f"--stages between 1 and {num_layers}")
        base_count, extra = divmod(num_layers, stages)
        layers = tuple(base_count + (1 if s < extra else 0) for s in range(stages))
    else:
        layers = tuple(int(n) for n in stages)
        if sum(layers) != num_layers or min(layers) < 1:
            raise ArgumentError(
                f"{where}(stages={list(stages)}): the stages hold {sum(layers)} layers, the "
                f"model has {num_layers}, each stage at least one",
                hint=f"layers per stage that add up to {num_layers}",
                cli_hint=f"--stages with counts that add up to {num_layers}")
    if num_ranks % len(layers):
        raise ArgumentError(
            f"{where}(num_ranks={num_ranks}, stages={stages}): {len(layers)} stages cannot "
            f"share {num_ranks} ranks evenly",
            hint=f"a rank count that is a multiple of {len(layers)}, or fewer stages",
            cli_hint=f"-n with a multiple of {len(layers)}, or fewer --stages")
    return PipelineStages(base, layers, num_ranks // len(layers))
