"""Importing PyTorch models: ``from_torch`` wraps ``torch.export`` and TVM's frontend.

The module's parameters stay named inputs of ``main`` (so that presets can
shard them by name) and come back as a dict of numpy arrays. TVM's frontend
names a parameter ``p_`` followed by its dotted PyTorch name with dots turned
into underscores: ``layers.0.mlp.fc1.weight`` becomes
``p_layers_0_mlp_fc1_weight``.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm

from .errors import ArgumentError, UnsupportedProgramError

__all__ = ["from_torch", "relax_name"]

logger = logging.getLogger(__name__)


def relax_name(torch_name: str) -> str:
    """The name of a PyTorch parameter in the imported module (``a.b.weight`` -> ``p_a_b_weight``)."""
    return "p_" + torch_name.replace(".", "_")


def from_torch(module, example_inputs: tuple, *, unwrap_single_result: bool = True,
               decompose: bool = False) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Import a PyTorch module as a Relax module whose weights are named parameters of ``main``.

    Parameters
    ----------
    module : torch.nn.Module
        The model, in eval mode.
    example_inputs : tuple of torch.Tensor
        Inputs of the traced forward.
    unwrap_single_result : bool
        Return a tensor, not a 1-tuple, when the model returns one tensor.
    decompose : bool
        Run torch.export's decompositions first. Off by default: they turn a
        4-D attention matmul into a reshape that merges batch and heads and a
        3-D batch matmul, across which a split of the heads cannot be kept
        (the heads would be all-gathered); the 4-D matmul keeps them split.

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
    import torch
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        with torch.no_grad():
            exported = torch.export.export(module.eval(), example_inputs)
    except Exception as err:  # torch raises many types while tracing
        raise ArgumentError(f"torch.export could not trace {type(module).__name__}: "
                            f"{type(err).__name__}: {str(err).splitlines()[0]}",
                            hint="make forward traceable (no data-dependent Python control "
                            "flow) or export it yourself") from None
    try:
        mod = from_exported_program(exported, keep_params_as_input=True,
                                    unwrap_unit_return_tuple=unwrap_single_result,
                                    run_ep_decomposition=decompose)
    except Exception as err:  # the frontend raises assertion and key errors
        raise UnsupportedProgramError(
            f"TVM's PyTorch frontend cannot translate {type(module).__name__}: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            hint="replace the operator with supported ones, or pass the module through "
            "tvm.relax.frontend.torch with a custom_convert_map",
        ) from None
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    count = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else 0
    names = [p.name for p in main.params[count:]]
    weights = {name: value.numpy() for name, value in zip(names, detached.get("main", []))}
    logger.info("imported %s: %d inputs, %d weights", type(module).__name__, count, len(weights))
    return mod, weights
