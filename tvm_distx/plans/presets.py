"""Sharding presets: the usual parallel layouts as name patterns over a model's weights.

A :class:`Preset` maps glob patterns over the parameter names of ``main``
(as :func:`tvm_distx.frontend.pytorch.from_torch` names them, ``p_layers_0_mlp_fc1_weight``) to
placements, and turns into :class:`tvm_distx.ShardingRule` objects for one
module with :meth:`Preset.rules`. Later patterns win, so a user overrides a
preset by adding patterns (:meth:`Preset.override`).

PyTorch's ``Linear`` stores its weight as ``(out, in)``, so:

* column parallel (the output features split): weight ``S[0]``, bias ``S[0]``;
* row parallel (the input features split): weight ``S[1]``, bias replicated;
  the matmul then yields partial sums, completed by one all-reduce.

:func:`megatron` puts the first MLP layer and the q/k/v projections column
parallel and the second MLP layer and the output projection row parallel: one
all-reduce per MLP and one per attention block, as in Megatron-LM. With
``sequence_parallel=True`` the activations between those layers are split
along the tokens instead: one all-gather before and one reduce-scatter after
each parallel region, and no all-reduce.
"""

from __future__ import annotations

import logging
from typing import Sequence

from tvm_distx.errors import RuleError
from tvm_distx.layout.mesh import set_device_meshes  # noqa: F401 (re-exported: presets need meshes)
# the presets' class and the other plans, re-exported here: one place to import any plan from
from tvm_distx.plans.hf import HFPlan, from_hf  # noqa: F401
from tvm_distx.plans.moe import (choose_expert_plan, expert_parallel,  # noqa: F401
                                 expert_tensor_parallel)
from tvm_distx.plans.patterns import Preset  # noqa: F401
from tvm_distx.plans.tensor_parallel import TensorParallel, tensor_parallel  # noqa: F401

__all__ = ["Preset", "megatron", "data_parallel", "data_and_tensor_parallel", "pipeline_stages",
           "set_device_meshes", "tensor_parallel", "TensorParallel", "expert_parallel",
           "choose_expert_plan", "expert_tensor_parallel", "from_hf", "HFPlan"]

logger = logging.getLogger(__name__)

COLUMN_WEIGHTS = ("*q_proj_weight", "*k_proj_weight", "*v_proj_weight", "*fc1_weight")
COLUMN_BIASES = ("*q_proj_bias", "*k_proj_bias", "*v_proj_bias", "*fc1_bias")
ROW_WEIGHTS = ("*out_proj_weight", "*fc2_weight")


def megatron(column: Sequence[str] = COLUMN_WEIGHTS, column_bias: Sequence[str] = COLUMN_BIASES,
             row: Sequence[str] = ROW_WEIGHTS, model_axis: int = 0, mesh_ndim: int = 1, *,
             sequence_parallel: bool = False, inputs: Sequence[str] = ("x",),
             sequence_dim: int = 1) -> Preset:
    """Megatron-style tensor parallelism on mesh axis ``model_axis``.

    Column-parallel weights and biases are split on their output features,
    row-parallel weights on their input features.

    Parameters
    ----------
    column, column_bias, row : sequence of str
        Globs over parameter names: column-parallel weights and biases, and
        row-parallel weights.
    model_axis : int
        The mesh axis of the tensor parallelism.
    mesh_ndim : int
        The number of mesh axes.
    sequence_parallel : bool
        Megatron sequence parallelism: ``inputs`` are split along their
        ``sequence_dim`` (the tokens) on ``model_axis``, so that the norms,
        residual adds and other elementwise work between the parallel layers
        run on each rank's tokens only. Propagation then all-gathers the
        tokens before the column-parallel layers, and completes the partial
        sums of the row-parallel ones with a reduce-scatter along the tokens
        instead of an all-reduce (half the bytes; no all-reduce is left).
    inputs : sequence of str
        With ``sequence_parallel``, the activations entering the model.
    sequence_dim : int
        Their token dimension (1 for ``(batch, seq, hidden)``).

    Examples
    --------
    >>> preset = megatron(sequence_parallel=True)
    >>> preset.placements(["x", "p_layers_0_mlp_fc1_weight"])["x"]
    ('S[1]', None)
    """
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int) or sequence_dim < 0:
        raise RuleError(f"megatron(sequence_dim={sequence_dim!r}): the token dimension must be "
                        "a non-negative int",
                        hint="megatron(sequence_parallel=True, sequence_dim=1) for "
                        "(batch, seq, hidden) activations")

    def on_axis(entry: str) -> str:
        entries = ["R"] * mesh_ndim
        entries[model_axis] = entry
        return "".join(entries)

    patterns = [(g, on_axis("S[0]"), None) for g in (*column, *column_bias)]
    patterns += [(g, on_axis("S[1]"), None) for g in row]
    if sequence_parallel:
        patterns += [(name, on_axis(f"S[{sequence_dim}]"), None) for name in inputs]
    return Preset(tuple(patterns))


def data_parallel(inputs: Sequence[str] = ("x",), batch_dim: int = 0, data_axis: int = 0,
                  mesh_ndim: int = 1) -> Preset:
    """Inputs split along their batch dimension on mesh axis ``data_axis``; weights replicated."""
    entries = ["R"] * mesh_ndim
    entries[data_axis] = f"S[{batch_dim}]"
    return Preset(tuple((name, "".join(entries), None) for name in inputs))


def data_and_tensor_parallel(inputs: Sequence[str] = ("x",), batch_dim: int = 0) -> Preset:
    """A 2-D mesh: data parallel on mesh axis 0, Megatron tensor parallel on axis 1."""
    data = data_parallel(inputs, batch_dim, data_axis=0, mesh_ndim=2)
    model = megatron(model_axis=1, mesh_ndim=2)
    return Preset(data.patterns + model.patterns)


def pipeline_stages(num_layers: int, meshes: Sequence[str], inputs: Sequence[str] = ("x",),
                    layer_pattern: str = "*layers_{i}_*") -> Preset:
    """Layer ``i``'s weights replicated on stage ``i * len(meshes) // num_layers``.

    The inputs start on the first stage; propagation moves the activations from
    one stage to the next (a send/recv between the rank sets).
    """
    if num_layers < len(meshes):
        raise RuleError(f"{num_layers} layers cannot fill {len(meshes)} stages",
                        hint="use at most one stage per layer")
    patterns = [(name, "R", meshes[0]) for name in inputs]
    patterns += [(layer_pattern.format(i=i), "R", meshes[i * len(meshes) // num_layers])
                 for i in range(num_layers)]
    return Preset(tuple(patterns))

