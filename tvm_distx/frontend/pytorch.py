"""Importing PyTorch models: ``from_torch`` wraps ``torch.export`` and TVM's frontend.

The module's parameters stay named inputs of ``main`` (so that presets can
shard them by name) and come back as a dict of numpy arrays. TVM's frontend
names a parameter ``p_`` followed by its dotted PyTorch name with dots turned
into underscores: ``layers.0.mlp.fc1.weight`` becomes
``p_layers_0_mlp_fc1_weight``.

For token generation, :func:`export_decoder` (in :mod:`tvm_distx.frontend.decoder`)
imports a causal LM as ``prefill`` and ``decode`` functions with the key-value
cache as explicit inputs and outputs.

A Hugging Face causal language model (a transformers ``PreTrainedModel``)
imports as it is, with no wrapper: its forward is traced from ``input_ids``
with ``use_cache=False``, so the program returns the logits alone (no key-value
cache object), and its parameter names are the model's own. Operators TVM's
frontend lacks are translated by :mod:`tvm_distx.frontend.torch_ops`.

``dynamic_shapes`` is torch.export's own argument: a dimension marked
``torch.export.Dim`` becomes a symbolic dimension of the Relax program, so one
import (and one :func:`tvm_distx.compile`) serves every size.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator, NamedTuple
import warnings

import numpy as np
from tvm import relax
import tvm
from tvm.relax.frontend.torch import from_exported_program

from tvm_distx.errors import ArgumentError, UnsupportedProgramError
from tvm_distx.frontend.torch_moe import static_experts
from tvm_distx.frontend.torch_ops import converters

__all__ = ["from_torch", "is_hf_causal_lm", "relax_name"]

logger = logging.getLogger(__name__)


def relax_name(torch_name: str) -> str:
    """The name of a PyTorch parameter in the imported module (``a.b.weight`` -> ``p_a_b_weight``)."""
    return "p_" + torch_name.replace(".", "_")


def _failing_node(err: BaseException):
    """The torch.fx node TVM's frontend was translating when it raised ``err``, or None.

    The frontend's converters take the node as their argument ``node``; the
    innermost frame that holds one names the operator.
    """
    import torch

    found, tb = None, err.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("node")
        if isinstance(node, torch.fx.Node):
            found = node
        tb = tb.tb_next
    return found


def is_hf_causal_lm(module) -> bool:
    """Whether ``module`` is a transformers model (checked without importing transformers)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
               for cls in type(module).__mro__)


def _export_arguments(module, example_inputs: tuple, dynamic_shapes):
    """``(args, kwargs, dynamic_shapes)`` for ``torch.export.export`` of ``module``.

    A transformers model is called as ``model(input_ids=..., use_cache=False)``,
    so that its output holds the logits only; ``dynamic_shapes`` given for the
    positional ``example_inputs`` is keyed by name to match.
    """
    if not is_hf_causal_lm(module):
        return example_inputs, {}, dynamic_shapes
    if len(example_inputs) != 1:
        raise ArgumentError(
            f"a Hugging Face {type(module).__name__} is imported from input_ids alone, "
            f"not {len(example_inputs)} example inputs",
            hint="from_torch(model, (input_ids,)) with input_ids of shape (batch, sequence)")
    if dynamic_shapes is not None and isinstance(dynamic_shapes, (tuple, list)):
        dynamic_shapes = {"input_ids": dynamic_shapes[0]}
    return (), {"input_ids": example_inputs[0]}, dynamic_shapes


@contextlib.contextmanager
def _without_cache(module) -> Iterator[None]:
    """A transformers model's config set not to build a key-value cache, for the export.

    Passing ``use_cache=False`` as an argument would make it an input of the
    exported program; the config's default is read at trace time instead.
    """
    config = getattr(module, "config", None) if is_hf_causal_lm(module) else None
    if config is None or not hasattr(config, "use_cache"):
        yield
        return
    saved = config.use_cache
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = saved


def _writes_into_views(exported) -> bool:
    """Whether an exported graph has an in-place operator whose target is a view.

    Writing into a fresh value (``x.div_(s)``) is handled by our converters;
    writing through a view (``slice``, ``select``, ...) is not.
    """
    views = set()
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            continue
        if any(a.alias_info is not None and not a.alias_info.is_write for a in schema.returns):
            views.add(node)
        if schema.is_mutable and node.args and node.args[0] in views:
            return True
    return False


#: Warnings that torch gives about its own internals while a model is exported and
#: translated, with the reason each says nothing to the user: ``(category, message
#: pattern, reason)``.
INTERNAL_WARNINGS = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated",
     "torch's pytree warns about its own deprecated check while copying an exported "
     "program's tree specs; nothing of the model's"),
)


@contextlib.contextmanager
def _internal_warnings_logged() -> Iterator[None]:
    """Log :data:`INTERNAL_WARNINGS` (DEBUG, with their reason); show every other warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        reason = next((why for category, pattern, why in INTERNAL_WARNINGS
                       if issubclass(warning.category, category)
                       and re.search(pattern, str(warning.message))), None)
        if reason is not None:
            logger.debug("hidden %s (%s): %s", warning.category.__name__, reason,
                         warning.message)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno, source=warning.source)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """torch.fx nodes made meanwhile record no stack trace (``torch.fx.config``)."""
    import torch.fx.config

    kept = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = kept


def _export(module, args: tuple, kwargs: dict, dynamic_shapes):
    """``torch.export.export``, again with size-oblivious reasoning if a guard breaks a range.

    torch gives the merge of dimensions of a symbolic extent a stride such as
    ``min(64, 64*seq)`` (the least stride of the merged dimensions of size other
    than 1); splitting that dimension again checks the result's contiguity,
    ``seq*min(64, 64*seq) == 64*seq``. That holds for every ``seq >= 1``, but
    torch's range analysis cannot prove it, so the export fails with
    "Constraints violated (seq)". (Llama 4's experts: ``bmm(...).view(-1,
    hidden)`` then ``reshape(experts, -1, hidden)``.)

    Such an export is run again under torch's ``backed_size_oblivious``, its
    option for export that reasons about sizes as any size, not as 0, 1 or
    more, and so asks for no guard of this kind. A guard the model really
    places on a size (a branch on its value) still fails the export. Exports
    that pass the first time are left as they are.

    The nodes keep no stack trace (torch records one per node by default, a
    fifth of the export's time; nothing downstream reads them).

    Returns
    -------
    (torch.export.ExportedProgram, bool)
        The program, and whether torch's own range analysis proved it for every
        size in the ranges of ``dynamic_shapes`` (False: size-oblivious).
    """
    import torch

    with _no_stack_traces():
        try:
            return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes), \
                True
        except torch._dynamo.exc.UserError as err:
            if dynamic_shapes is None or \
                    err.error_type is not torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
                raise
            logger.info("torch.export of %s: %s; exporting again with size-oblivious reasoning",
                        type(module).__name__, str(err).splitlines()[0])
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return torch.export.export(module, args, kwargs,
                                       dynamic_shapes=dynamic_shapes), False


class WeightSpec(NamedTuple):
    """A weight's shape and dtype, where its values were not copied (``with_weights=False``)."""

    shape: tuple[int, ...]
    dtype: str


class Imported(NamedTuple):
    """What :func:`import_torch` gives: :func:`from_torch`'s pair, and how sure its sizes are."""

    mod: tvm.IRModule
    weights: dict
    #: True when torch proved the program for every size of its symbolic dimensions'
    #: ranges; False when the export needed size-oblivious reasoning (see ``_export``)
    exact_sizes: bool


def from_torch(module, example_inputs: tuple, *, dynamic_shapes=None,
               unwrap_single_result: bool = True, decompose: bool = False,
               with_weights: bool = True) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Import a PyTorch module as a Relax module whose weights are named parameters of ``main``.

    Parameters
    ----------
    module : torch.nn.Module
        The model, in eval mode.
    example_inputs : tuple of torch.Tensor
        Inputs of the traced forward (for a Hugging Face model: ``(input_ids,)``).
    dynamic_shapes : optional
        torch.export's ``dynamic_shapes`` for ``example_inputs``, e.g.
        ``({1: torch.export.Dim("seq", max=512)},)``: those dimensions become
        symbolic in the Relax program.
    unwrap_single_result : bool
        Return a tensor, not a 1-tuple, when the model returns one tensor.
    decompose : bool
        Run torch.export's decompositions first. Off by default: they turn a
        4-D attention matmul into a reshape that merges batch and heads and a
        3-D batch matmul, across which a split of the heads cannot be kept
        (the heads would be all-gathered); the 4-D matmul keeps them split.
    with_weights : bool
        Copy the weights out of the module. ``False`` gives each weight's
        :class:`WeightSpec` instead and reads no weight: for a module whose
        weights are placeholders (built without initialisation, to be read
        from a checkpoint later).

    Returns
    -------
    (tvm.IRModule, dict of str to numpy.ndarray)
        The module (``main`` takes the inputs, then the weights) and the
        weights by parameter name (see :func:`relax_name`).

    Raises
    ------
    ArgumentError
        If ``torch.export`` cannot trace the module.
    UnsupportedProgramError
        If TVM's frontend cannot translate an operator.
    """
    imported = import_torch(module, example_inputs, dynamic_shapes=dynamic_shapes,
                            unwrap_single_result=unwrap_single_result, decompose=decompose,
                            with_weights=with_weights)
    return imported.mod, imported.weights


def import_torch(module, example_inputs: tuple, *, dynamic_shapes=None,
                 unwrap_single_result: bool = True, decompose: bool = False,
                 with_weights: bool = True) -> Imported:
    """:func:`from_torch`, also telling whether torch proved every symbolic size.

    Takes :func:`from_torch`'s arguments and raises its errors.
    """
    import torch

    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    args, kwargs, dynamic_shapes = _export_arguments(module, example_inputs, dynamic_shapes)
    try:
        with torch.no_grad(), _without_cache(module), static_experts(module), \
                _internal_warnings_logged():
            exported, exact_sizes = _export(module.eval(), args, kwargs, dynamic_shapes)
        if _writes_into_views(exported):
            # ``y[..., :8].copy_(x)`` writes into a view of y; TVM's frontend would
            # copy into a temporary. Functionalising (no decomposition) turns such
            # writes into slice_scatter and the like.
            with _internal_warnings_logged():
                exported = exported.run_decompositions({})
    except Exception as err:  # torch raises many types while tracing
        raise ArgumentError(f"torch.export could not trace {type(module).__name__}: "
                            f"{type(err).__name__}: {str(err).splitlines()[0]}",
                            hint="make forward traceable (no data-dependent Python control "
                            "flow) or export it yourself") from None
    try:
        with _internal_warnings_logged():
            mod = from_exported_program(exported, keep_params_as_input=True,
                                        unwrap_unit_return_tuple=unwrap_single_result,
                                        run_ep_decomposition=decompose,
                                        custom_convert_map=converters(exported))
    except Exception as err:  # the frontend raises assertion and key errors
        node = _failing_node(err)
        where = f" at operator {node.target} (node '{node.name}')" if node is not None else ""
        raise UnsupportedProgramError(
            f"TVM's PyTorch frontend cannot translate {type(module).__name__}{where}: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            hint="replace the operator with supported ones, or pass the module through "
            "tvm.relax.frontend.torch with a custom_convert_map",
        ) from None
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    count = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else 0
    values = list(detached.get("main", []))
    mod = _one_parameter_per_tensor(mod, count, _tied_names(module, exported))
    mod, values = _without_unread_weights(mod, count, values)
    names = [p.name for p in mod["main"].params[count:]]
    if with_weights:
        weights = {name: value.numpy() for name, value in zip(names, values)}
    else:  # shapes and dtypes only: the placeholders' memory is never touched
        weights = {name: WeightSpec(tuple(int(d) for d in value.shape), str(value.dtype))
                   for name, value in zip(names, values)}
    logger.info("imported %s: %d inputs, %d weights", type(module).__name__, count, len(weights))
    return Imported(mod, weights, exact_sizes)


def _without_unread_weights(mod: tvm.IRModule, count: int, values: list
                            ) -> tuple[tvm.IRModule, list]:
    """``mod`` without the weights ``main`` never reads, and the values of those it keeps.

    torch.export lifts a tied weight under each of its names (an LM head tied to
    the token embedding is two parameters of one tensor); the program reads one
    of them. A parameter nothing reads would still be a weight every rank holds
    whole, so it is left out of the program.
    """
    main = mod["main"]
    read = {v for v in relax.analysis.free_vars(main.body)}
    weights = main.params[count:]
    kept = [i for i, p in enumerate(weights) if p in read]
    if len(kept) == len(weights):
        return mod, values
    logger.debug("from_torch: %s never read, left out",
                 ", ".join(p.name for i, p in enumerate(weights) if i not in kept))
    func = relax.Function(list(main.params[:count]) + [weights[i] for i in kept], main.body,
                          main.ret_ty, main.is_pure, main.attrs)
    out = mod.clone() if hasattr(mod, "clone") else mod
    out["main"] = func
    return out, [values[i] for i in kept]


def _tied_names(module, exported) -> dict[str, str]:
    """Each lifted parameter that is another's tensor (a tied weight) -> the first one's name.

    torch.export lifts a tensor once per name it is read under: an LM head tied to
    the token embedding, read by the lookup under one name and by the head under
    the other, becomes two inputs of one tensor.
    """
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    first: dict[int, str] = {}
    tied = {}
    for spec in exported.graph_signature.input_specs:
        target = getattr(spec, "target", None)
        tensor = tensors.get(target) if target is not None else None
        if tensor is None:
            continue
        name = first.setdefault(id(tensor), spec.arg.name)
        if name != spec.arg.name:
            tied[spec.arg.name] = name
    return tied


def _one_parameter_per_tensor(mod: tvm.IRModule, count: int, tied: dict[str, str]
                              ) -> tvm.IRModule:
    """``main`` reading each tied weight through one parameter (the others left unread)."""
    main = mod["main"]
    params = {p.name: p for p in main.params[count:]}
    remap = {params[other]: params[name] for other, name in tied.items()
             if other in params and name in params}
    if not remap:
        return mod

    @relax.expr_functor.mutator
    class Tie(relax.PyExprMutator):
        def visit_var_(self, var):
            return remap.get(var, var)

    logger.debug("from_torch: %s read as their tied weights",
                 ", ".join(f"{a.name} as {b.name}" for a, b in remap.items()))
    body = Tie().visit_expr(main.body)
    out = mod.clone() if hasattr(mod, "clone") else mod
    out["main"] = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    return out

