"""Exporting a causal language model for token generation, its key-value cache as explicit state.

:func:`export_decoder` imports a Hugging Face causal LM (or any module that
takes transformers' ``past_key_values``) as one Relax module with two public
functions of the same form::

    prefill(input_ids, cache_position, key_0, value_0, key_1, value_1, ..., <weights>)
    decode (input_ids, cache_position, key_0, value_0, key_1, value_1, ..., <weights>)
        -> (logits, key_0', value_0', key_1', value_1', ...)

* ``logits`` are the last position's, ``(batch, 1, vocab)`` (``all_logits=True``:
  every position's).
* The cache of layer ``l`` is two tensors ``key_l`` and ``value_l`` of shape
  ``(batch, kv_heads, max_length, head_dim)``: a **static maximum length**.
  Each function returns the caches with the new tokens' keys and values
  written at ``cache_position``; the caller feeds them back. (The compiled
  program writes those rows into the given cache tensors themselves, see
  :mod:`tvm_distx.compiler.schedule.cache_write`: the returned caches are the
  buffers that went in.)
* ``cache_position`` holds the absolute positions of ``input_ids``' tokens (as
  in transformers): the **current length** is a run-time value, so one compiled
  ``decode`` serves every step, and ``prefill`` can continue a cache (a long
  prompt in chunks). Attention is over the causal mask of those positions; the
  compiled attention kernel skips the positions the mask hides
  (:mod:`tvm_distx.compiler.schedule.attention`), so a step costs its context, not
  ``max_length``.
* ``prefill`` takes a prompt of a **symbolic length** ``seq`` (``input_ids`` of
  shape ``(batch, seq)``, ``cache_position = arange(start, start + seq)``), or
  of one static length (``prompt_length=``); ``decode`` takes one token
  (``(batch, 1)``).

``max_batch=b`` adds ``prefill_batch`` and ``decode_batch``, for left-padded
batches of ``b`` prompts of different lengths as transformers' ``generate`` runs
them: after ``cache_position`` they take ``position_ids`` ``(b, seq)`` (each row's
own positions) and ``attention_mask`` ``(b, max_length)`` (0 on a row's padding),
and their caches have ``b`` rows. The batch-1 functions are unchanged. A model
whose masks do not export keeps only those, with a logged reason.

The mechanism is general, with no knowledge of model families: the model is
called with a transformers :class:`~transformers.cache_utils.Cache` whose layers
hold the cache tensors given as inputs and write into them out of place
(``index_copy``, translated by :mod:`tvm_distx.frontend.torch_ops`), and the cache
geometry (layers, heads, head sizes) is read from one eager step of the model
with its own cache. Models whose cache is not made of key-value layers
(linear attention, state-space layers) are refused.

Sharding needs nothing more: the cache is written by the key and value
projections' heads, so a plan that splits those heads
(:func:`tvm_distx.plans.presets.tensor_parallel`) splits the cache the same way,
with no collective on it.
"""

from __future__ import annotations

from dataclasses import dataclass
import inspect
import logging

import numpy as np
from tvm import relax
import tvm

from tvm_distx.errors import ArgumentError, UnsupportedProgramError
from tvm_distx.bundle.generation import KVCacheLayout
from tvm_distx.frontend.pytorch import import_torch

__all__ = ["DecoderProgram", "KVCacheLayout", "STEP_ATTRIBUTE", "export_decoder"]

logger = logging.getLogger(__name__)

#: The attribute of the traced step module that holds the model: every parameter of the
#: exported functions is named from a path that starts with it (``p_model_model_...`` for
#: a transformers model whose own paths start with ``model.``).
STEP_ATTRIBUTE = "model"

#: The public functions :func:`export_decoder` writes.
FUNCTIONS = ("prefill", "decode")
#: The suffix of the batched functions (``prefill_batch``, ``decode_batch``).
BATCH_SUFFIX = "_batch"


@dataclass(frozen=True)
class DecoderProgram:
    """What :func:`export_decoder` returns; unpacks as ``mod, weights, cache``.

    Attributes
    ----------
    mod : tvm.IRModule
        Public functions ``prefill`` and ``decode`` (see the module doc), the
        weights as named parameters after the inputs (the names of
        :func:`tvm_distx.frontend.pytorch.relax_name`, the same in both functions).
    weights : dict of str to numpy.ndarray
        The weights by parameter name.
    cache : KVCacheLayout
        The cache's parameters and shapes.
    batch_cache : KVCacheLayout or None
        The cache of ``prefill_batch`` and ``decode_batch``, when exported
        (``max_batch=``).
    """

    mod: tvm.IRModule
    weights: dict
    cache: KVCacheLayout
    batch_cache: KVCacheLayout | None = None

    def __iter__(self):
        return iter((self.mod, self.weights, self.cache))


# ------------------------------------------------------------------- the cache as inputs
def _cache_layer_class():
    """A transformers cache layer over given tensors, written out of place (built lazily)."""
    from transformers.cache_utils import CacheLayerMixin

    class ExplicitLayer(CacheLayerMixin):
        """One layer's keys and values, given as inputs; ``update`` returns new tensors."""

        is_compileable = True
        is_sliding = False  # it holds every position; a sliding window is the mask's work

        def __init__(self, keys, values, positions) -> None:
            super().__init__()
            self.keys, self.values, self.positions = keys, values, positions
            self.max_cache_len = int(keys.shape[2])
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            """Nothing to allocate: the tensors are the function's inputs."""

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys = self.keys.index_copy(2, self.positions, key_states)
            self.values = self.values.index_copy(2, self.positions, value_states)
            return self.keys, self.values

        def get_mask_sizes(self, query_length) -> tuple[int, int]:
            return self.max_cache_len, 0

        def get_seq_length(self):
            return self.positions[0]

        def get_max_length(self) -> int:
            return self.max_cache_len

    return ExplicitLayer


def _step_module(model, layers: int, masked: bool = False, all_logits: bool = False):
    """``model`` as a module ``(input_ids, cache_position, *caches) -> (logits, *caches)``.

    ``masked``: ``(input_ids, cache_position, position_ids, attention_mask, *caches)``,
    for left-padded batches (``attention_mask`` of shape ``(batch, max_length)``).
    The logits are the last position's, unless ``all_logits``.
    """
    import torch
    from transformers.cache_utils import Cache

    layer_class = _cache_layer_class()
    # the LM head on the last position only, where the model can be told so
    keep_last = not all_logits and \
        "logits_to_keep" in inspect.signature(model.forward).parameters

    class DecoderStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model  # STEP_ATTRIBUTE: every parameter's path starts with it

        def forward(self, input_ids, cache_position, *inputs):
            if masked:
                positions, mask, caches = inputs[0], inputs[1], inputs[2:]
            else:
                positions = cache_position.unsqueeze(0).expand(input_ids.shape[0], -1)
                mask, caches = None, inputs
            cache = Cache(layers=[layer_class(caches[2 * i], caches[2 * i + 1], cache_position)
                                  for i in range(layers)])
            extra = {"attention_mask": mask} if masked else {}
            # the last position as an index tensor (the token count less one): a slice
            # ``[-1:]`` of the symbolic length would need a run-time shape check
            last = (torch.ones_like(cache_position).sum() - 1).reshape(1)
            if keep_last:
                extra["logits_to_keep"] = last
            out = self.model(input_ids=input_ids, past_key_values=cache,
                             cache_position=cache_position, position_ids=positions,
                             use_cache=True, **extra)
            logits = out.logits
            if not all_logits and not keep_last:
                logits = torch.index_select(logits, 1, last)
            result = [logits]
            for layer in cache.layers:
                result += [layer.keys, layer.values]
            return tuple(result)

    return DecoderStep().eval()


def _cache_geometry(model, batch: int) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """Per layer, the key and value shapes of one token and the dtype, from one eager step."""
    import torch
    from transformers.cache_utils import CacheLayerMixin

    ids = torch.zeros((batch, 1), dtype=torch.long)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    except Exception as err:  # the model's own code raises many types
        raise ArgumentError(f"{type(model).__name__} does not run one token with use_cache=True: "
                            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                            hint="export_decoder(model, ...) takes a transformers causal LM "
                            "(AutoModelForCausalLM)") from None
    cache = getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if not layers:
        raise UnsupportedProgramError(
            f"{type(model).__name__} returned no transformers Cache with layers "
            f"(got {type(cache).__name__})",
            hint="export_decoder needs a model that takes past_key_values as a transformers Cache")
    geometry = []
    for index, layer in enumerate(layers):
        if not isinstance(layer, CacheLayerMixin) or getattr(layer, "keys", None) is None:
            raise UnsupportedProgramError(
                f"{type(model).__name__}'s cache layer {index} is a {type(layer).__name__}, "
                "not key-value attention states",
                hint="export_decoder handles attention caches only; linear-attention and "
                "state-space layers are not supported")
        keys, values = layer.keys, layer.values
        geometry.append((tuple(keys.shape), tuple(values.shape), str(keys.dtype).split(".")[-1]))
    return geometry


# ---------------------------------------------------------------------------- the export
def export_decoder(model, max_length: int, *, batch_size: int = 1,
                   prompt_length: int | None = None, with_weights: bool = True,
                   max_batch: int | None = None, all_logits: bool = False) -> DecoderProgram:
    """Import ``model`` as ``prefill`` and ``decode`` with its key-value cache as explicit state.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (``AutoModelForCausalLM``), in eval mode.
    max_length : int
        The static maximum number of tokens, prompt included.
    batch_size : int
        The batch of both functions (the caches' first axis).
    prompt_length : int, optional
        None (the default): ``prefill`` takes a prompt of any length, a
        symbolic extent ``seq``. An int from 2 to ``max_length``: ``prefill``
        takes prompts of exactly that length (for programs whose sharding
        cannot move a symbolic extent yet, such as the experts' dispatch).
    with_weights : bool
        ``False`` reads no weight: ``weights`` then holds each one's
        :class:`tvm_distx.frontend.pytorch.WeightSpec` (see
        :meth:`tvm_distx.llm.causal_lm.CausalLM.from_pretrained`).
    max_batch : int, optional
        Also export ``prefill_batch`` and ``decode_batch`` for left-padded
        batches of ``max_batch`` prompts (see the module doc). If the model's
        masks cannot be exported, they are left out with a logged reason
        (``batch_cache`` is then None).
    all_logits : bool
        ``False`` (the default): every function returns the logits of the last
        position only, ``(batch, 1, vocab)``, and the LM head runs on that
        position alone (what generation needs: a long prompt's logits would be
        its largest tensor). ``True``: the logits of every position, for
        scoring a prompt.

    Returns
    -------
    DecoderProgram
        ``mod, weights, cache = export_decoder(...)``: see :class:`DecoderProgram`.

    Raises
    ------
    ArgumentError
        For a bad length, or if torch.export cannot trace the model.
    UnsupportedProgramError
        For a model whose cache is not key-value attention states, or an
        operator TVM's frontend cannot translate.

    Examples
    --------
    >>> mod, weights, cache = export_decoder(model, max_length=64)    # doctest: +SKIP
    >>> exe = td.compile(presets.tensor_parallel().apply(annotated))  # doctest: +SKIP
    >>> out = exe.run(ids, np.arange(n), *cache.zeros(), params=weights,
    ...               function="prefill")                              # doctest: +SKIP
    """
    traced = min(4, max_length) if prompt_length is None else prompt_length
    if max_length < 2 or not 2 <= traced <= max_length or batch_size < 1:
        raise ArgumentError(
            f"export_decoder(max_length={max_length}, batch_size={batch_size}, "
            f"prompt_length={prompt_length}): lengths out of range",
            hint="export_decoder(model, max_length=64) with 2 <= prompt_length "
            "<= max_length and batch_size >= 1")
    if max_batch is not None and max_batch < 2:
        raise ArgumentError(f"export_decoder(max_batch={max_batch}): a batch needs 2 or more "
                            "prompts", hint="export_decoder(model, max_length=64, max_batch=4), "
                            "or leave max_batch out")
    model = model.eval()
    geometry = _cache_geometry(model, batch_size)
    layers = len(geometry)
    cache = _layout(geometry, batch_size, max_length)
    functions = _pair(model, layers, cache, traced, prompt_length, with_weights,
                      masked=False, suffix="", all_logits=all_logits)
    batch_cache = None
    if max_batch is not None:
        batch_cache = _layout(geometry, max_batch, max_length, masked=True)
        try:
            functions.update(_pair(model, layers, batch_cache, traced, prompt_length,
                                   with_weights, masked=True, suffix=BATCH_SUFFIX,
                                   all_logits=all_logits))
        except (ArgumentError, UnsupportedProgramError) as err:
            logger.warning("%s: no batched prefill and decode (%s); batches of prompts run one "
                           "prompt after another", type(model).__name__,
                           str(err).splitlines()[0])
            batch_cache = None
    mod, weights = _merge(functions)
    logger.info("exported %s for generation: %d layers, cache %s x %s (%d bytes), %d weights%s",
                type(model).__name__, layers, cache.shapes[0], len(cache.shapes), cache.nbytes(),
                len(weights), f", batches of {max_batch}" if batch_cache else "")
    return DecoderProgram(mod, weights, cache, batch_cache)


def _layout(geometry, batch: int, max_length: int, masked: bool = False) -> KVCacheLayout:
    """The cache of ``batch`` sequences from the per-layer geometry of one token."""
    names, shapes = [], []
    for index, (key, value, _) in enumerate(geometry):
        names += [f"key_{index}", f"value_{index}"]
        shapes += [(batch, key[1], max_length, key[3]), (batch, value[1], max_length, value[3])]
    return KVCacheLayout(tuple(names), tuple(shapes), geometry[0][2], max_length, masked)


def _pair(model, layers: int, cache: KVCacheLayout, traced: int, prompt_length: int | None,
          with_weights: bool, *, masked: bool, suffix: str, all_logits: bool = False) -> dict:
    """``prefill`` and ``decode`` (names + ``suffix``) over ``cache``, imported."""
    import torch

    step = _step_module(model, layers, masked, all_logits)
    batch, max_length = cache.shapes[0][0], cache.max_length
    caches = tuple(torch.zeros(s, dtype=getattr(torch, cache.dtype)) for s in cache.shapes)
    seq = torch.export.Dim("seq", min=1, max=max_length)
    prompt = prompt_length is None
    calls = {}
    for name, length in (("prefill", traced), ("decode", 1)):
        symbolic = prompt and name == "prefill"
        ids = torch.zeros((batch, length), dtype=torch.long)
        positions = torch.arange(length, dtype=torch.long)
        example, dims = [ids, positions], [{1: seq} if symbolic else None,
                                           {0: seq} if symbolic else None]
        inputs = ["input_ids", "cache_position"]
        if masked:
            example += [positions.unsqueeze(0).expand(batch, -1).contiguous(),
                        torch.ones((batch, max_length), dtype=torch.long)]
            dims += [{1: seq} if symbolic else None, None]
            inputs += ["position_ids", "attention_mask"]
        calls[name] = (step, (*example, *caches),
                       (*dims[:2], (*dims[2:], *(None for _ in caches))), name + suffix,
                       [*inputs, *cache.names], with_weights)
    try:
        prefill = _import(*calls["prefill"])
    except UnsupportedProgramError as err:
        if prompt:
            _refuse_a_run_time_length(err, calls["prefill"], traced)
        raise
    decode = _decode_of(prefill) if prompt else None
    if decode is None:
        decode = _import(*calls["decode"])
    return {"prefill" + suffix: prefill[:2], "decode" + suffix: decode[:2]}


def _decode_of(prefill: tuple) -> tuple | None:
    """The decode step as the prefill of one token, or None where that is not proven.

    A prefill over a symbolic prompt length ``seq`` (``1 <= seq <= max_length``)
    computes, at ``seq = 1``, what the decode step computes: the same model code,
    traced once. Binding ``seq`` to 1 gives that function with static shapes, and
    saves a second ``torch.export`` of the model (seconds for a large one). Only a
    prefill whose sizes torch proved for the whole range is used so (not one
    exported with size-oblivious reasoning, which may assume ``seq != 1``).
    """
    mod, weights, exact_sizes = prefill
    if not exact_sizes:
        return None
    main = mod["main"]
    symbolic = list(relax.analysis.defined_symbolic_vars(main))
    if len(symbolic) != 1:
        return None
    out = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(dict(mod.functions))
    # fresh variables: the two functions of one module share no binding
    out["main"] = relax.utils.copy_with_new_vars(main.bind_symbolic_vars({symbolic[0]: 1}))
    return out, weights, exact_sizes


def _refuse_a_run_time_length(err: UnsupportedProgramError, arguments: tuple,
                              traced: int) -> None:
    """Raise ``err`` with the fix when the prefill imports with a fixed prompt length only.

    Some operators translate for a fixed prompt length but not for a run-time one (the
    experts' dispatch of some mixture-of-experts models). The prefill is imported again
    with the traced length fixed; if that works, the length was the cause, and the error
    says how to fix the length. Otherwise the caller raises ``err`` as it is.
    """
    step, example, dynamic, function, names, with_weights = arguments
    try:
        _import(step, example, tuple(None for _ in dynamic[:2]) + (tuple(
            None for _ in dynamic[2]),), function, names, with_weights=False)
    except UnsupportedProgramError:
        return
    raise UnsupportedProgramError(
        f"{err.message}; it translates for a fixed prompt length ({traced} tokens traced), "
        "not for a prompt of any length",
        hint="fix the prompt length: CausalLM.from_hf(model, prompt_length=N) or "
        "export_decoder(model, prompt_length=N); prompts are then N tokens",
        cli_hint="the command line serves prompts of any length: export a bundle in Python "
        "with CausalLM.from_hf(model, prompt_length=N).export(DIR)") from None


def _import(step, example: tuple, dynamic_shapes: tuple, function: str,
            input_names: list[str], with_weights: bool = True
            ) -> tuple[tvm.IRModule, dict[str, np.ndarray], bool]:
    """One function of the decoder, its inputs renamed ``input_names``; whether its sizes are
    exact (see :class:`tvm_distx.frontend.pytorch.Imported`)."""
    import torch

    with torch.no_grad():
        mod, weights, exact_sizes = import_torch(
            step, example, dynamic_shapes=dynamic_shapes, unwrap_single_result=False,
            with_weights=with_weights)
    main = mod["main"]
    count = int(main.attrs["num_input"])
    if count != len(input_names):
        raise UnsupportedProgramError(
            f"the exported {function} has {count} inputs, expected {len(input_names)} "
            "(input_ids, cache_position and the caches)",
            hint="the model must use every cache tensor it is given")
    return _with_input_names(mod, input_names), weights, exact_sizes


def _with_input_names(mod: tvm.IRModule, names: list[str]) -> tvm.IRModule:
    """``mod`` with ``main``'s first inputs renamed (same types)."""

    main = mod["main"]
    renamed = {old: relax.Var(new, old.ty) for old, new in zip(main.params, names)}

    @relax.expr_functor.mutator
    class Rename(relax.PyExprMutator):
        def visit_var_(self, var):
            return renamed.get(var, var)

    body = Rename().visit_expr(main.body)
    func = relax.Function([renamed.get(p, p) for p in main.params], body, main.ret_ty,
                          main.is_pure, main.attrs)
    out = mod.clone() if hasattr(mod, "clone") else mod
    out["main"] = func
    return out


def _merge(functions: dict[str, tuple[tvm.IRModule, dict]]
           ) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """One module with each imported ``main`` under its name; the weights, which must agree."""
    out = tvm.IRModule()
    weights: dict[str, np.ndarray] = {}
    for name, (mod, found) in functions.items():
        func = mod["main"].with_attr("global_symbol", name)
        out[name] = func
        for gv, other in mod.functions.items():
            if gv.name_hint != "main":
                out[gv.name_hint] = other
        for key, value in found.items():
            if key in weights and weights[key].shape != value.shape:
                raise UnsupportedProgramError(
                    f"weight {key} has shape {weights[key].shape} in one function and "
                    f"{value.shape} in {name}", hint="report this as a bug")
            weights.setdefault(key, value)
    return out, weights
