"""What a :class:`~tvm_distx.llm.causal_lm.CausalLM` is compiled from: its :class:`Recipe`.

``CausalLM.from_hf``, ``from_pretrained`` and ``from_gguf`` each write down how their
model becomes a sharded program: how to trace it (:func:`tvm_distx.export_decoder`, on
the model given or on placeholders of a checkpoint's configuration, with the weights
that go with it), the plan, the rank count and how the weights are stored. A cold start
follows the recipe at once and compiles what it gives. A start from the compile cache
needs none of it, but keeps the recipe, unfollowed: :meth:`CausalLM.export
<tvm_distx.llm.causal_lm.CausalLM.export>` follows it when asked for what the cached
bundle does not hold (another target, or a bundle with its own copy of linked weights).

The recipe traces and shards; it never compiles (the caller chooses the target).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import tvm

from tvm_distx.frontend.decoder import BATCH_SUFFIX, FUNCTIONS, STEP_ATTRIBUTE, DecoderProgram
from tvm_distx.passes.quantize import quantize
from tvm_distx.plans import presets
from tvm_distx.plans.hf import HFPlan
from tvm_distx.plans.stages import PipelineStages, layer_prefix, pipeline_stages_of

__all__ = ["AS_STORED", "Recipe", "Traced", "functions_of", "only"]

#: A :attr:`Recipe.storage` format: each weight in the format it is stored in (GGUF
#: tensors, whose ``format`` names it), whatever it is.
AS_STORED = "as stored"


@dataclass(frozen=True)
class Traced:
    """What tracing a model gives: the program, its weights, and the model if there is one.

    Attributes
    ----------
    program : DecoderProgram
        ``prefill`` and ``decode`` (and the batched pair when exported).
    weights : dict
        The program's weights by parameter name, as float32 arrays, checkpoint
        tensors read on demand, or GGUF tensors in their stored format.
    model : transformers.PreTrainedModel or None
        The model the user gave (``from_hf``; its ``generation_config`` has the
        end and pad tokens); None when it was built from placeholders.
    """

    program: DecoderProgram
    weights: dict
    model: Any = None


@dataclass(frozen=True)
class Recipe:
    """How a model becomes the sharded program a compile takes.

    Parameters
    ----------
    trace : callable
        ``trace()`` exports the model (:func:`tvm_distx.export_decoder`) and
        returns a :class:`Traced`; it is called once per :meth:`follow`.
    num_ranks : int
        The ranks of the one tensor-parallel mesh.
    plan : preset, optional
        Any preset with ``.apply(mod, function)``; ``presets.tensor_parallel()``
        when None.
    storage : tuple, optional
        The ``(format, dtype)`` of :func:`tvm_distx.quantize`, the format
        :data:`AS_STORED` for each weight's own; None keeps float weights as they are.
    stages : int or tuple of int, optional
        Pipeline stages (:func:`tvm_distx.plans.stages.pipeline_stages_of`): the
        plan then shards each stage's layers over its ranks.
    """

    trace: Callable[[], Traced]
    num_ranks: int
    plan: Any = None
    storage: tuple | None = None
    stages: int | tuple[int, ...] | None = None

    def preset(self):
        """The plan, applied to each function of the decoder's step module."""
        preset = self.plan if self.plan is not None else presets.tensor_parallel()
        if isinstance(preset, HFPlan):  # made from the model, applied to its step module
            preset = preset.under(STEP_ATTRIBUTE)
        return preset

    def on_mesh(self, program: DecoderProgram) -> tvm.IRModule:
        """The program's module on one mesh of :attr:`num_ranks` devices, unsharded."""
        return presets.set_device_meshes(program.mod, [(self.num_ranks,)])

    def pipeline(self, num_layers: int) -> PipelineStages | None:
        """The pipeline stages of :attr:`stages` for a decoder of ``num_layers`` layers."""
        return pipeline_stages_of(self.stages, num_ranks=self.num_ranks, num_layers=num_layers,
                                  base=self.preset())

    def shard(self, mod: tvm.IRModule, functions: Iterable[str]) -> tvm.IRModule:
        """``mod`` (with its mesh) with each of ``functions`` sharded by the plan, in order.

        With :attr:`stages`, the functions are sharded by stages instead, each
        stage's layers by the plan over the stage's ranks.

        Raises
        ------
        DistxError
            From the plan, for a function it cannot shard.
        """
        functions = tuple(functions)
        if self.stages not in (None, 1):
            names = [p.name for f in functions[:1] for p in mod[f].params]
            found = layer_prefix(names)
            pipeline = self.pipeline(found[1] if found else 0)
            if pipeline is not None:
                return pipeline.shard(mod, functions)
        preset = self.preset()
        for function in functions:
            mod = preset.apply(mod, function)
        return mod

    def store(self, annotated: tvm.IRModule, weights: dict) -> tuple[tvm.IRModule, dict]:
        """The program and the weights with the weights in :attr:`storage`'s format."""
        if self.storage is None:
            return annotated, weights
        fmt, dtype = self.storage
        if fmt == AS_STORED:
            fmt = {name: tensor.format.name for name, tensor in weights.items()}
        return quantize(annotated, weights, fmt, dtype=dtype)

    def follow(self, functions: tuple[str, ...]) -> tuple[tvm.IRModule, dict]:
        """Trace, shard ``functions`` (the others are dropped) and store: a compile's input.

        ``functions`` are those a compiled bundle of this recipe holds
        (:func:`functions_of` its batch cache), so that the program compiled
        again is the one that was compiled and cached first.
        """
        traced = self.trace()
        annotated = only(self.shard(self.on_mesh(traced.program), functions), functions)
        return self.store(annotated, traced.weights)


def functions_of(batch_cache) -> tuple[str, ...]:
    """The public functions of a generation program: the batched ones when exported."""
    return FUNCTIONS + (tuple(f + BATCH_SUFFIX for f in FUNCTIONS) if batch_cache else ())


def only(mod: tvm.IRModule, functions: Iterable[str]) -> tvm.IRModule:
    """``mod`` without the public functions not in ``functions``."""
    functions = set(functions)
    return tvm.IRModule({gv: func for gv, func in mod.functions.items()
                         if func.attrs is None or "global_symbol" not in func.attrs
                         or gv.name_hint in functions},
                        attrs=mod.attrs, global_infos=mod.global_infos)  # meshes, formats
