"""Hugging Face's own tensor-parallel plans (``base_model_tp_plan``) as our placements.

transformers ships, with most causal LMs, a plan that maps module paths to
parallel styles: ``{"layers.*.self_attn.q_proj": "colwise", ...,
"layers.*.mlp.down_proj": "rowwise"}`` in the config, and
``{"lm_head": "colwise_gather_output"}`` on the model class. :func:`from_hf`
reads both and gives each style's placement to the weights it names:

======================================  ==============================================
style                                   our placement
======================================  ==============================================
``colwise``, ``colwise_rep``,           weight ``S[0]`` (``(out, in)``: output features
``colwise_gather_output``               split), bias ``S[0]``; propagation gathers the
                                        output where a use needs it whole
``rowwise``, ``rowwise_rep``,           weight ``S[1]`` (input features split), bias
``rowwise_split_input``                 replicated; one all-reduce
``packed_colwise``                      each segment of the fused weight ``S[0]`` on its
                                        own (:class:`tvm_distx.passes.SplitFusedProjections`);
                                        a colwise style on a fused weight does the same
``embedding_colwise``                   the table ``S[1]`` (hidden split)
``embedding_rowwise``                   the table ``S[0]``: a vocabulary-parallel lookup
                                        (:class:`tvm_distx.passes.VocabParallelEmbedding`),
                                        each rank's offset ``S[0]`` beside it
expert styles (``moe_tp_experts``,      the experts by :func:`tvm_distx.plans.moe.choose_expert_plan`
``grouped_gemm``, ...)                  (the cheaper of tensor and expert parallelism)
``replicate``, ``local_params``, ...    replicated (these only hook a module's forward)
======================================  ==============================================

Fused projections are cut per segment first, as
:func:`tvm_distx.plans.presets.tensor_parallel` cuts them, and any style on a fused
weight applies to each segment: Phi-3's ``qkv_proj`` and ``gate_up_proj``,
``colwise_gather_output`` in its plan, become column-parallel q, k, v, gate and
up weights (transformers gathers their outputs and splits the row projection's
input again; here nothing moves until the row projection's all-reduce).

Two splits of transformers' plan are dropped, as
:func:`tvm_distx.plans.presets.tensor_parallel` never makes them, with a warning: a
projection whose output is reshaped into fewer heads than ranks (the key and
value projections of grouped-query attention on many ranks), which would give
a rank part of a head; and an LM head tied to the token embedding (Gemma)
where the table cannot be split on the vocabulary for its lookups too, whose
split would make every lookup gather the table. Where it can, the tied table
is split once for both, as ``tensor_parallel()`` splits it.

transformers shards the token embedding on its vocabulary
(``embed_tokens: embedding_rowwise``) in every base model whose plan is not
empty, without the config naming it; :func:`from_hf` adds that entry too. A
vocabulary that does not divide by the ranks stays whole (a warning says so).

Styles we cannot honour (``sequence_parallel``, ``packed_rowwise``,
``mla_kv_a_proj``) raise a :class:`~tvm_distx.errors.RuleError` naming the style and
the module, when the plan is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
import fnmatch
import logging

import tvm

from tvm_distx.errors import RuleError
from tvm_distx.frontend.pytorch import relax_name
from tvm_distx.layout.rules import ShardingRule, pattern_entries, rules_for
from tvm_distx.passes import (derivations_of, GroupedQueryAttention, VocabParallelEmbedding,
                              AnnotateSharding, SplitFusedProjections)
from tvm_distx.passes.vocab_parallel import embedding_lookups, vocab_lookups
from tvm_distx.plans import moe
from tvm_distx.plans.patterns import Preset
from tvm_distx.plans.tensor_parallel import tied_weights, attention_heads
from tvm_distx.plans.vocab import embedding_roles

__all__ = ["HFPlan", "from_hf"]

logger = logging.getLogger(__name__)

#: style -> (weight axis split, bias axis split or None); None: nothing split
_LINEAR_STYLES = {
    "colwise": (0, 0), "colwise_rep": (0, 0), "colwise_gather_output": (0, 0),
    "rowwise": (1, None), "rowwise_rep": (1, None), "rowwise_split_input": (1, None),
    "embedding_colwise": (1, None), "embedding_rowwise": (0, None),
}
#: Styles that only hook a module's forward: its parameters stay whole.
_FORWARD_ONLY = frozenset({"replicate", "replicated_with_grad_allreduce", "local_params",
                           "all_reduce", "moe_identity_expert", "isolated"})
#: Styles of experts modules and their fused 3-D weights (planned by tvm_distx.plans.moe).
_EXPERT_STYLES = frozenset({"moe_tp_experts", "grouped_gemm", "ep_dispatch_experts",
                            "ep_router"})
#: Styles we cannot honour, with what to do instead.
_UNSUPPORTED = {
    "sequence_parallel": "use presets.megatron(sequence_parallel=True) for sequence "
                         "parallelism",
    "packed_rowwise": "a row-parallel fused projection is not split per segment yet; "
                      "use presets.tensor_parallel()",
    "mla_kv_a_proj": "multi-head latent attention's joint projection is not split yet; "
                     "use presets.tensor_parallel()",
}


@dataclass(frozen=True)
class HFPlan:
    """A transformers tensor-parallel plan, as a preset (``rules``, ``apply``, ``override``).

    Parameters
    ----------
    entries : tuple of (str, str)
        ``(module or parameter path from the model's root, style)``.
    source : str
        Where the plan came from (for messages).
    model_axis, mesh_ndim : int
        The mesh axis of the tensor parallelism, and the number of mesh axes.
    overrides : tuple of (str, str, str or None)
        ``(glob over parameter names, placement, mesh)``, winning over the plan.
    """

    entries: tuple[tuple[str, str], ...]
    source: str = "the plan"
    model_axis: int = 0
    mesh_ndim: int = 1
    overrides: tuple[tuple[str, str, str | None], ...] = ()

    def __post_init__(self) -> None:
        known = set(_LINEAR_STYLES) | _FORWARD_ONLY | _EXPERT_STYLES | {"packed_colwise"}
        for path, style in self.entries:
            if style in _UNSUPPORTED:
                raise RuleError(f"{self.source}: style '{style}' of module '{path}' cannot be "
                                "honoured", hint=_UNSUPPORTED[style])
            if style not in known:
                raise RuleError(f"{self.source}: unknown parallel style '{style}' of module "
                                f"'{path}'", hint="styles: " + ", ".join(sorted(known)))
        if not 0 <= self.model_axis < self.mesh_ndim:
            raise RuleError(f"from_hf(model_axis={self.model_axis}, mesh_ndim="
                            f"{self.mesh_ndim}): no such mesh axis",
                            hint="from_hf(model, model_axis=0) for a 1-D mesh")

    def override(self, patterns: dict[str, str], mesh: str | None = None) -> "HFPlan":
        """This plan with ``patterns`` (glob over parameter names -> placement) winning."""
        return replace(self, overrides=self.overrides + pattern_entries(patterns, mesh))

    def under(self, prefix: str) -> "HFPlan":
        """This plan for a module that holds the model as its attribute ``prefix``.

        :func:`tvm_distx.export_decoder` traces a step module that holds the model
        as ``model``, so every parameter path gains ``model.`` in front; a plan
        made from the model itself is moved under it.
        """
        return replace(self, entries=tuple((f"{prefix}.{path}", style)
                                           for path, style in self.entries))

    @property
    def has_experts(self) -> bool:
        return any(style in _EXPERT_STYLES for _, style in self.entries)

    def _placement(self, axis: int) -> str:
        entries = ["R"] * self.mesh_ndim
        entries[self.model_axis] = f"S[{axis}]"
        return "".join(entries)

    def placements(self, mod: tvm.IRModule, function: str = "main") -> dict[str, str]:
        """The placement of every parameter of ``mod`` the plan splits."""

        params = {p.name: p for p in mod[function].params}
        derived = derivations_of(mod).get(function)
        segments: dict[str, list[str]] = {}
        for d in (derived.params if derived is not None else ()):
            segments.setdefault(d.source, []).append(d.name)
        out: dict[str, str] = {}
        rowwise: set[str] = set()  # tables the plan splits on their vocabulary
        for path, style in self.entries:
            if style in _FORWARD_ONLY or style in _EXPERT_STYLES:
                continue
            for glob, axes in self._globs(path, style):
                for name in params:
                    if not fnmatch.fnmatchcase(name, glob):
                        continue
                    if len(params[name].ty.shape) != (2 if glob.endswith("weight") else 1):
                        continue  # a 3-D expert weight: planned with the experts
                    if axes is not None:
                        out[name] = self._placement(axes)
                        if style == "embedding_rowwise":
                            rowwise.add(name)
                # a fused projection cut per segment (packed_colwise, or a colwise style
                # on a weight whose result the graph cuts apart, Phi-3's qkv_proj): each
                # segment gets the style's placement, so a rank boundary never falls
                # inside a segment (dense weights only)
                for source, segs in segments.items():
                    if axes is None or not fnmatch.fnmatchcase(source, glob):
                        continue
                    for seg in segs:
                        if len(params[seg].ty.shape) == (2 if glob.endswith("weight") else 1):
                            out[seg] = self._placement(axes)
        out = self._untied(mod, function, self._whole_heads(mod, function, out), rowwise)
        return self._vocab_offsets(mod, function, out, rowwise)

    def _vocab_offsets(self, mod: tvm.IRModule, function: str, out: dict[str, str],
                       rowwise: set[str]) -> dict[str, str]:
        """``out`` with each vocabulary-split table's offsets split alike.

        A table of ``rowwise`` that nothing looks up (the embedding of a model
        whose lookups read the tied LM head's weight) and a vocabulary that does
        not divide by the ranks are left whole.
        """

        ranks = self._ranks(mod)
        lookups = embedding_lookups(mod[function])
        done = vocab_lookups(mod, function)
        for table in rowwise - set(lookups) - set(done):
            out.pop(table, None)
        for table in [t for t in lookups if t in rowwise and t in out]:
            vocab = int(lookups[table][0].args[0].ty.shape[0])
            if ranks and vocab % ranks:
                logger.warning("%s: the %d rows of '%s' do not divide by %d ranks: kept "
                               "whole", self.source, vocab, table, ranks)
                out.pop(table)
        for table, offsets in done.items():
            if table in out:
                out[offsets] = out[table]
        return out

    def _ranks(self, mod: tvm.IRModule) -> int | None:
        meshes = mod.global_infos.get("mesh") if mod.global_infos else None
        if not meshes or len(meshes[0].shape) <= self.model_axis:
            return None
        return int(meshes[0].shape[self.model_axis])

    def grouped_attention(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` with attention reading each key-value head once where the heads stay split.

        As :meth:`tvm_distx.plans.presets.TensorParallel.grouped_attention`
        (:class:`tvm_distx.passes.GroupedQueryAttention`); a module without a mesh
        is returned as it is.
        """

        ranks = self._ranks(mod)
        if ranks is None:
            return mod
        return GroupedQueryAttention(function, heads_divisor=ranks)(mod)

    def vocab_parallel(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` with the lookups of the tables the plan splits on the vocabulary rewritten."""

        ranks = self._ranks(mod)
        if ranks is None:
            return mod
        out = self.placements(mod, function)
        split = {t: ranks for t in embedding_lookups(mod[function])
                 if out.get(t) == self._placement(0)}
        return VocabParallelEmbedding(split, function)(mod)

    def _untied(self, mod: tvm.IRModule, function: str, out: dict[str, str],
                rowwise: set[str]) -> dict[str, str]:
        """``out`` without the split of an output projection tied to something it cannot serve.

        transformers' plan splits the LM head (``colwise_gather_output``) even
        when it shares its weight with the embedding (Gemma). Where
        :func:`tvm_distx.plans.presets.tensor_parallel` splits such a table on the
        vocabulary for both its lookups and the head
        (:func:`tvm_distx.plans.vocab.embedding_roles`), the split is kept and
        the lookups become vocabulary parallel (the weight joins ``rowwise``);
        otherwise the lookup would gather the table on every run, and the head
        stays whole.
        """

        ranks = self._ranks(mod)
        tables = embedding_roles(mod, ranks, function) if ranks else {}
        for weight in tied_weights(mod, function):
            role = tables.get(weight)
            if out.get(weight) == self._placement(0) and role is not None and role.lookup:
                rowwise.add(weight)
                continue
            if weight in out:
                logger.warning("%s: '%s' is also the token embedding: kept whole (a split "
                               "would gather it on every run)", self.source, weight)
                out.pop(weight)
        return out

    def _whole_heads(self, mod: tvm.IRModule, function: str,
                     out: dict[str, str]) -> dict[str, str]:
        """``out`` without the splits of projections whose heads do not divide by the ranks.

        transformers' plan splits the key and value projections whatever their
        head count; with fewer key/value heads than ranks a rank would get part
        of a head, and every use would gather it back. As
        :func:`tvm_distx.plans.presets.tensor_parallel` does, such a projection stays
        whole and each rank slices the heads its query heads need.
        """

        meshes = mod.global_infos.get("mesh") if mod.global_infos else None
        if not meshes or len(meshes[0].shape) <= self.model_axis:
            return out
        ranks = int(meshes[0].shape[self.model_axis])
        for weight, (heads, bias) in attention_heads(mod, function).items():
            if weight in out and heads % ranks:
                logger.warning("%s: '%s' has %d heads, which do not divide by %d ranks: kept "
                               "whole (each rank slices the heads it needs)", self.source,
                               weight, heads, ranks)
                out.pop(weight)
                out.pop(bias, None)
        return out

    def _globs(self, path: str, style: str):
        """``(glob over Relax parameter names, axis)`` the entry ``path`` names."""
        if style == "packed_colwise":  # (out, in) segments: output features split
            yield relax_name(path), 0
            yield relax_name(path + ".weight"), 0
            yield relax_name(path + ".bias"), 0
            return
        weight_axis, bias_axis = _LINEAR_STYLES[style]
        yield relax_name(path), weight_axis  # the path names a parameter itself
        yield relax_name(path + ".weight"), weight_axis
        yield relax_name(path + ".bias"), bias_axis

    def rules(self, mod: tvm.IRModule, function: str = "main") -> list[ShardingRule]:
        """Sharding rules for ``mod``'s parameters: the plan's, then the overrides.

        Raises
        ------
        RuleError
            If no parameter of ``mod`` matches the plan (a plan for another model).
        """
        chosen = {name: (placement, None)
                  for name, placement in self.placements(mod, function).items()}
        if not chosen and not self.has_experts:
            raise RuleError(f"{self.source} matches no parameter of '{function}'",
                            function=function,
                            hint="import the model itself with tvm_distx.from_torch(model, "
                            "(input_ids,)), whose parameter names follow its modules")
        names = [p.name for p in mod[function].params]
        chosen.update(Preset(self.overrides).placements(names))
        return rules_for(chosen, function)

    def apply(self, mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
        """``mod`` annotated with the plan (fused projections cut per segment first)."""

        if self.has_experts and moe.expert_weights(mod, function):
            # the experts' fused weights are cut by the tensor plan of choose_expert_plan
            mod = self.grouped_attention(self.vocab_parallel(mod, function), function)
            plan = moe.choose_expert_plan(mod, self, model_axis=self.model_axis,
                                          mesh_ndim=self.mesh_ndim, function=function)
            return plan.apply(mod, function)
        # fused projections are cut as tensor_parallel() cuts them; a segment no style
        # names stays whole, as its fused weight would
        mod = self.vocab_parallel(SplitFusedProjections()(mod), function)
        mod = self.grouped_attention(mod, function)
        return AnnotateSharding(self.rules(mod, function))(mod)


def from_hf(model_or_config, *, model_axis: int = 0, mesh_ndim: int = 1,
            prefix: str | None = None) -> HFPlan:
    """The tensor-parallel plan transformers ships with a model, as our preset.

    Parameters
    ----------
    model_or_config : transformers.PreTrainedModel or PretrainedConfig
        A model (its config's ``base_model_tp_plan`` under its
        ``base_model_prefix``, and its class's ``_tp_plan`` for the LM head), or
        a config alone (its ``base_model_tp_plan`` under ``prefix``).
    model_axis, mesh_ndim : int
        The mesh axis of the tensor parallelism, and the number of mesh axes.
    prefix : str, optional
        The base model's attribute name (``"model"`` for Llama); read from the
        model when one is given.

    Returns
    -------
    HFPlan

    Raises
    ------
    RuleError
        If the config has no ``base_model_tp_plan`` (GPT-2's has none), or the
        plan uses a style we cannot honour (named, with its module).
    """
    config = getattr(model_or_config, "config", model_or_config)
    name = type(model_or_config).__name__
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        raise RuleError(f"{name}'s config has no base_model_tp_plan: transformers ships no "
                        "tensor-parallel plan for it",
                        hint="presets.tensor_parallel() finds the plan from the graph")
    if prefix is None:
        prefix = getattr(model_or_config, "base_model_prefix", None) or "model"
    if "embed_tokens" not in base:  # as transformers adds it to every base model's plan
        base = {"embed_tokens": "embedding_rowwise", **base}
    entries = [(f"{prefix}.{path}" if prefix else path, style) for path, style in base.items()]
    entries += list((getattr(type(model_or_config), "_tp_plan", None) or {}).items())
    return HFPlan(tuple(entries), f"{name}'s base_model_tp_plan", model_axis, mesh_ndim)
