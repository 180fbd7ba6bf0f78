"""A random program as a description: operations per function, inputs, and their placements.

Both the Relax module (:mod:`.relax_module`) and the numpy answer
(:mod:`.numpy_reference`) are built from this one description.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Op", "Function", "Input", "Program", "valid_placements", "is_double_split"]


@dataclass(frozen=True)
class Op:
    """One operation of a function.

    Parameters
    ----------
    kind : str
        ``"matmul"``, ``"add"``, ``"multiply"``, ``"subtract"``, ``"exp"``,
        ``"tanh"``, ``"relu"``, ``"sum"``, ``"max"``, ``"reshape"``,
        ``"permute_dims"``, ``"softmax"``, ``"split"`` (one of two halves),
        ``"annotate"`` (a change of
        placement; the value is unchanged) or ``"call"``.
    args : tuple of int
        Operands: indices into the function's values (its parameters first,
        then the results of its operations in order).
    shape : tuple of int
        The shape of the result.
    axis : int, optional
        For ``sum``, ``max``, ``softmax`` and ``split``.
    keepdims : bool
        For ``sum`` and ``max``.
    new_shape : tuple of int, optional
        For ``reshape``.
    axes : tuple of int, optional
        For ``permute_dims``.
    placement : str, optional
        For ``annotate``.
    callee : str, optional
        For ``call``: the private function called.
    half : int, optional
        For ``split``: which half (0 or 1) is the result.
    """

    kind: str
    args: tuple[int, ...]
    shape: tuple[int, ...]
    axis: int | None = None
    keepdims: bool = False
    new_shape: tuple[int, ...] | None = None
    axes: tuple[int, ...] | None = None
    placement: str | None = None
    callee: str | None = None
    half: int | None = None

    def describe(self, names: Sequence[str]) -> str:
        """One line of pseudo-code, with operands named by ``names``."""
        operands = ", ".join(names[a] for a in self.args)
        extra = []
        if self.axis is not None:
            extra.append(f"axis={self.axis}")
        if self.kind in ("sum", "max"):
            extra.append(f"keepdims={self.keepdims}")
        if self.new_shape is not None:
            extra.append(f"shape={self.new_shape}")
        if self.axes is not None:
            extra.append(f"axes={self.axes}")
        if self.placement is not None:
            extra.append(f'"{self.placement}"')
        if self.half is not None:
            extra.append(f"half={self.half}")
        head = self.callee if self.kind == "call" else self.kind
        return f"{head}({', '.join([operands, *extra]) if operands else ', '.join(extra)})"


@dataclass
class Function:
    """A function of a program: parameters, operations, results.

    Parameters
    ----------
    name : str
        ``"main"`` or the private function's name.
    params : list of tuple of int
        Parameter shapes.
    ops : list of Op
    outputs : list of int
        Indices of the values returned (a tuple when there are several).
    dataflow : bool
        Whether the body is a dataflow block.
    """

    name: str
    params: list[tuple[int, ...]]
    ops: list[Op] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    dataflow: bool = True

    def shapes(self) -> list[tuple[int, ...]]:
        """The shape of every value (parameters, then operation results)."""
        return list(self.params) + [op.shape for op in self.ops]

    def names(self) -> list[str]:
        """The name of every value in pseudo-code and in the Relax module."""
        prefix = "x" if self.name == "main" else "p"
        return ([f"{prefix}{i}" for i in range(len(self.params))]
                + [f"v{i}" for i in range(len(self.ops))])


@dataclass(frozen=True)
class Input:
    """A parameter of ``main``: its shape and the placement it is annotated with."""

    shape: tuple[int, ...]
    placement: str


@dataclass
class Program:
    """A random program: a mesh, ``main``'s inputs and every function.

    Parameters
    ----------
    mesh : tuple of int
        The shape of the one device mesh (devices ``0 .. n-1``).
    inputs : list of Input
        ``main``'s parameters, with their placements.
    functions : dict of str to Function
        ``"main"`` and the private functions, callees before callers.
    rules : bool
        Annotate the inputs with :class:`tvm_distx.ShardingRule` parameter
        rules instead of ``R.dist.annotate_sharding`` in the module.
    """

    mesh: tuple[int, ...]
    inputs: list[Input]
    functions: dict[str, Function]
    rules: bool = False

    @property
    def main(self) -> Function:
        """The public function."""
        return self.functions["main"]

    @property
    def num_devices(self) -> int:
        """How many devices (ranks) the mesh has."""
        return math.prod(self.mesh)

    def describe(self) -> str:
        """The program as readable pseudo-code (printed when a case fails)."""
        how = "ShardingRule(param=...) rules" if self.rules else "R.dist.annotate_sharding"
        lines = [f"mesh {self.mesh}; inputs annotated with {how}"]
        for name, func in self.functions.items():
            names = func.names()
            params = ", ".join(
                f"{names[i]}: {shape}" + (f' "{self.inputs[i].placement}"' if name == "main"
                                          else "")
                for i, shape in enumerate(func.params))
            private = "" if name == "main" else "private "
            flow = "" if func.dataflow else "  # no dataflow block"
            lines.append(f"{private}def {name}({params}):{flow}")
            for i, op in enumerate(func.ops):
                lines.append(f"    {names[len(func.params) + i]} = {op.describe(names)}"
                             f"  # {op.shape}")
            lines.append(f"    return {', '.join(names[o] for o in func.outputs)}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- placements
def valid_placements(shape: Sequence[int], mesh: Sequence[int]) -> list[str]:
    """Every placement of a tensor of ``shape`` on ``mesh`` whose splits divide it.

    Parameters
    ----------
    shape : sequence of int
        The tensor's global shape.
    mesh : sequence of int
        The mesh shape; a placement has one entry per mesh axis.

    Returns
    -------
    list of str
        Placements in TVM's text form that :meth:`tvm_distx.Placement.validate`
        accepts, fully replicated first.
    """
    from tvm_distx import DeviceMesh, Placement
    from tvm_distx.errors import ShardingError

    device_mesh = DeviceMesh(tuple(mesh), range(math.prod(mesh)))
    out = [""]
    for _ in mesh:
        out = [p + e for p in out for e in ["R", *(f"S[{d}]" for d in range(len(shape)))]]
    good = []
    for text in out:
        try:
            Placement.parse(text).validate(device_mesh, tuple(shape))
        except ShardingError:
            continue
        good.append(text)
    return good


def is_double_split(placement: str) -> bool:
    """Whether two mesh axes split the same dimension (``"S[0]S[0]"``)."""
    from tvm_distx import Placement

    dims = [e.dim for e in Placement.parse(placement).entries if e.is_shard()]
    return len(dims) != len(set(dims))
