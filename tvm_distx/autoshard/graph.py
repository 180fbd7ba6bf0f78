"""The sharding problem as pure data: values, their candidate strategies, repeated layers.

A :class:`ShardGraph` is a program in the order it runs: inputs, parameters and
operator calls (:class:`Node`), each operator with the einsum-like labels of
its operator rule (:class:`tvm_distx.passes.op_signatures.OpSignature`, read
by :mod:`tvm_distx.autoshard.extract`). Nothing here imports TVM.

A **strategy** (:class:`Strategy`) of an operator picks, for every mesh axis,
one label to split along that axis, or none (two axes never split one label:
lowering would run such a kernel on the outer split only). It fixes the placement of the
result (a split output label is ``S[dim]``, a split reduction label is ``P``,
anything else ``R``) and the placement every operand must arrive in. A
parameter's or an input's strategies are its placements. Splits obey the
operator rule (no unshardable label) and divide every extent the label has.

**Repeated layers.** Parameters named ``..layers_<i>_..`` (as
:func:`tvm_distx.from_torch` names them) mark layer ``i``; an operator belongs
to the highest layer among its operands. When every layer has the same nodes
in the same order (same operators, shapes and strategies), node ``j`` of every
layer is put in one *class*: one choice serves all the layers, and its costs
count once per layer. Nodes after the last layer's own nodes (the final norm)
and before the first (the embedding) are classes of their own. In a function
that calls a private function (a decoder layer), the ``k``-th call site is
layer ``k`` instead (:data:`CALL_SITE_PATTERN`), whatever the weights are named.

**State.** An input whose new value the function returns (a key-value cache:
``decode(ids, pos, key_0, ...) -> (logits, key_0', ...)``) is state, not a
transient activation: ``ShardGraph.state`` pairs it with the result that
returns it. Its bytes count once, for the whole call, and the result keeps
the input's placement, so the next call reads it where this one wrote it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import re
from dataclasses import dataclass, field

import numpy as np

from tvm_distx.layout import TensorSharding
from tvm_distx.layout.mesh import DeviceMesh

__all__ = ["Node", "Strategy", "ShardGraph", "placement_text", "LAYER_PATTERN"]

logger = logging.getLogger(__name__)

#: Where a parameter's layer number is in its name (``p_model_layers_3_mlp_up_proj_weight``).
LAYER_PATTERN = re.compile(r"(?:^|_)(?:layers|layer|h|blocks|block)_(\d+)_")
#: What a value of the ``k``-th call site of a private function, inlined for planning
#: (:func:`tvm_distx.ir.inline.inline_calls`), has after its name, before ``k``.
CALL_SITE = "__call"
#: Reads ``k`` back from such a name (``<name>__call<k>``).
CALL_SITE_PATTERN = re.compile(re.escape(CALL_SITE) + r"(\d+)$")


def itemsize(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (``bfloat16`` 2, ``float8_*`` 1)."""
    if dtype == "bfloat16":
        return 2
    if dtype.startswith("float8"):
        return 1
    return int(np.dtype(dtype).itemsize)


@dataclass(frozen=True)
class Node:
    """One value of the program.

    Parameters
    ----------
    name : str
        The Relax variable's name.
    shape : tuple of int
        Static global shape.
    dtype : str
        Element type.
    kind : str
        ``"input"``, ``"param"`` or ``"op"``.
    op : str
        The operator (``"relax.matmul"``); empty for inputs and parameters.
    operands : tuple of int
        Node ids of the tensor operands, in the order of ``labels``.
    labels : tuple of tuple of str, optional
        The operator rule's labels per operand; None when the operator has no
        rule (it then runs replicated).
    output : tuple of str, optional
        The result's labels.
    unshardable : frozenset of str
        Labels the rule forbids to split.
    view : bool
        A layout change (reshape, transpose): no arithmetic and no buffer of its own.
    dynamic : frozenset of int
        Dimensions of a run-time (symbolic) extent, ``shape`` holding the example
        size: no strategy splits them, and no collective moves the value.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    op: str = ""
    operands: tuple[int, ...] = ()
    labels: tuple[tuple[str, ...], ...] | None = None
    output: tuple[str, ...] | None = None
    unshardable: frozenset[str] = frozenset()
    view: bool = False
    dynamic: frozenset[int] = frozenset()

    @property
    def itemsize(self) -> int:
        """Bytes of one element (``bfloat16`` 2, ``float8_*`` 1)."""
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the mesh.

    Parameters
    ----------
    split : tuple
        Per mesh axis, the label (operator) or dimension (input, parameter)
        split along it, or None.
    out : str
        The placement of the result (``"S[0]R"``, ``"P"``).
    ins : tuple of str
        The placement each operand must arrive in.
    parts : int
        Into how many pieces the work is cut (product of the split axes' sizes).
    """

    split: tuple
    out: str
    ins: tuple[str, ...]
    parts: int


def placement_text(dims: tuple[str, ...] | int, split: tuple, mesh_shape: tuple[int, ...],
                   reductions: frozenset[str] = frozenset()) -> str:
    """The placement of a tensor with labels ``dims`` when ``split`` is chosen.

    ``dims`` may also be a rank, for inputs and parameters whose ``split``
    names dimensions directly.
    """
    entries = []
    for axis, what in enumerate(split):
        if what is None or mesh_shape[axis] == 1:
            entries.append("R")
        elif isinstance(dims, int):
            entries.append(f"S[{what}]")
        elif what in dims:
            entries.append(f"S[{dims.index(what)}]")
        elif what in reductions:
            entries.append("P")
        else:
            entries.append("R")
    return "".join(entries)


def _divides(parts_of: dict, extents: dict) -> bool:
    return all(all(e % parts == 0 for e in extents.get(label, ())) for label, parts in
               parts_of.items())


@dataclass
class ShardGraph:
    """A program as nodes in execution order, with its mesh.

    Parameters
    ----------
    nodes : list of Node
        In program order; operands come before their users.
    outputs : tuple of int
        The node ids the function returns.
    mesh_shape : tuple of int
        The device mesh.
    """

    nodes: list[Node]
    outputs: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    strategies: list[list[Strategy]] = field(init=False)
    classes: list[int] = field(init=False)
    layers: int = field(init=False, default=0)
    variables: list = field(init=False, default_factory=list)
    #: state the function carries from call to call (a key-value cache): input node ->
    #: the result node that returns its new value (the input itself when returned as is)
    state: dict[int, int] = field(init=False, default_factory=dict)
    #: the example size each symbolic variable was priced at
    sizes: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.strategies = [self._enumerate(n) for n in self.nodes]
        self.classes = self._classes()

    # ------------------------------------------------------------ strategies
    def _enumerate(self, node: Node) -> list[Strategy]:
        axes = range(len(self.mesh_shape))
        if node.kind in ("input", "param"):
            dims = [d for d in range(len(node.shape)) if d not in node.dynamic]
            choices = [[None] + (dims if self.mesh_shape[a] > 1 else []) for a in axes]
            out = []
            for split in itertools.product(*choices):
                parts_of: dict[int, int] = {}
                for a, d in enumerate(split):
                    if d is not None:
                        parts_of[d] = parts_of.get(d, 1) * self.mesh_shape[a]
                if all(node.shape[d] % p == 0 for d, p in parts_of.items()):
                    text = placement_text(len(node.shape), split, self.mesh_shape)
                    out.append(Strategy(split, text, (), math.prod(parts_of.values() or [1])))
            return out
        replicated = Strategy((None,) * len(self.mesh_shape), "R" * len(self.mesh_shape),
                              ("R" * len(self.mesh_shape),) * len(node.operands), 1)
        if node.labels is None or node.output is None:
            return [replicated]
        extents: dict[str, set[int]] = {}
        for operand, labels in zip(node.operands, node.labels):
            for label, extent in zip(labels, self.nodes[operand].shape):
                extents.setdefault(label, set()).add(extent)
        for label, extent in zip(node.output, node.shape):
            extents.setdefault(label, set()).add(extent)
        dynamic = {label for d, label in enumerate(node.output) if d in node.dynamic}
        for operand, labels in zip(node.operands, node.labels):
            dynamic |= {label for d, label in enumerate(labels)
                        if d in self.nodes[operand].dynamic}
        candidates = sorted(label for label in extents
                            if label not in node.unshardable and label not in dynamic)
        produced = set(node.output)
        reductions = frozenset(label for labels in node.labels for label in labels
                               if label not in produced)
        choices = [[None] + (candidates if self.mesh_shape[a] > 1 else []) for a in axes]
        out = []
        for split in itertools.product(*choices):
            used = [label for label in split if label is not None]
            if len(used) != len(set(used)):
                # a kernel on a dimension split by two mesh axes runs on the outer split
                # only (tvm_distx.legalize.local_view): not a strategy of its own
                continue
            parts_of: dict[str, int] = {}
            for a, label in enumerate(split):
                if label is not None:
                    parts_of[label] = parts_of.get(label, 1) * self.mesh_shape[a]
            if not _divides(parts_of, extents):
                continue
            ins = tuple(placement_text(labels, split, self.mesh_shape) for labels in node.labels)
            text = placement_text(node.output, split, self.mesh_shape, reductions)
            out.append(Strategy(split, text, ins, math.prod(parts_of.values() or [1])))
        return out

    def flops(self, index: int) -> float:
        """Arithmetic of a node on one device: the product of its label extents (x2 with a sum)."""
        node = self.nodes[index]
        if node.kind != "op" or node.view:
            return 0.0
        if node.labels is None or node.output is None:
            return float(math.prod(node.shape))
        extents: dict[str, int] = {}
        for operand, labels in zip(node.operands, node.labels):
            for label, extent in zip(labels, self.nodes[operand].shape):
                extents[label] = max(extents.get(label, 1), extent)
        for label, extent in zip(node.output, node.shape):
            extents[label] = max(extents.get(label, 1), extent)
        reduces = any(label not in node.output for labels in node.labels for label in labels)
        return float(math.prod(extents.values())) * (2.0 if reduces else 1.0)

    def kernel_bytes(self, index: int, strategy: Strategy) -> int:
        """Bytes one device's kernel of a node reads and writes under ``strategy``.

        Its operands in the placements the strategy wants them in, and its
        result; 0 for an input, a parameter or a view.
        """
        node = self.nodes[index]
        if node.kind != "op" or node.view:
            return 0
        mesh = tuple(self.mesh_shape)
        total = math.prod(_local_shape(node.shape, strategy.out, mesh)) * node.itemsize
        for operand, placement in zip(node.operands, strategy.ins):
            source = self.nodes[operand]
            total += math.prod(_local_shape(source.shape, placement, mesh)) * source.itemsize
        return total

    def local_bytes(self, index: int, strategy: Strategy) -> int:
        """Bytes one device holds of a node's result under ``strategy``.

        The local shape is :class:`tvm_distx.layout.TensorSharding`'s.
        """
        node = self.nodes[index]
        local = _local_shape(node.shape, strategy.out, tuple(self.mesh_shape))
        return math.prod(local) * node.itemsize

    def state_nodes(self) -> set[int]:
        """The state inputs and the results that return them: their bytes count once, as state."""
        return set(self.state) | set(self.state.values())

    # ------------------------------------------------------------ repeated layers
    def separate_layers(self) -> None:
        """Give every node its own choice again (when rules treat layers differently)."""
        self.classes = list(range(len(self.nodes)))
        self.layers = 0

    def _layer_of_call_sites(self) -> list[int | None] | None:
        """Per node, its call site (a parameter: its users' one call site), or None."""
        sites = [CALL_SITE_PATTERN.search(n.name) if n.kind == "op" else None
                 for n in self.nodes]
        if not any(sites):
            return None
        layer: list[int | None] = [int(m.group(1)) if m else None for m in sites]
        users: dict[int, set] = {}
        for index, node in enumerate(self.nodes):
            for operand in node.operands:
                users.setdefault(operand, set()).add(layer[index])
        for index, node in enumerate(self.nodes):
            found = users.get(index, set())
            if node.kind == "param" and len(found) == 1:
                layer[index] = next(iter(found))
        return layer

    def _layer_of_nodes(self) -> list[int | None]:
        by_site = self._layer_of_call_sites()
        if by_site is not None:
            return by_site
        layer: list[int | None] = []
        for node in self.nodes:
            if node.kind == "param":
                match = LAYER_PATTERN.search(node.name)
                layer.append(int(match.group(1)) if match else None)
            elif node.kind == "input":
                layer.append(None)
            else:
                params = [self.nodes[o] for o in node.operands if self.nodes[o].kind == "param"]
                if any(LAYER_PATTERN.search(p.name) is None for p in params):
                    layer.append(None)  # uses a parameter of no layer: the final norm, LM head
                    continue
                found = [layer[o] for o in node.operands if layer[o] is not None]
                layer.append(max(found) if found else None)
        return layer

    def _key(self, index: int) -> tuple:
        node = self.nodes[index]
        return (node.kind, node.op, node.shape, node.dtype, node.view,
                tuple(self.strategies[index]), self.flops(index),
                tuple(self.nodes[o].shape for o in node.operands))

    def _classes(self) -> list[int]:
        own = list(range(len(self.nodes)))
        layer = self._layer_of_nodes()
        members: dict[int, list[int]] = {}
        for index, found in enumerate(layer):
            if found is not None:
                members.setdefault(found, []).append(index)
        numbers = sorted(members)
        if len(numbers) < 2 or numbers != list(range(len(numbers))):
            return own
        length = min(len(members[i]) for i in numbers)
        if any(len(members[i]) != length for i in numbers[:-1]):
            logger.info("layers differ in size (%s); solving the whole program",
                        [len(members[i]) for i in numbers])
            return own
        keys = [self._key(j) for j in members[0][:length]]
        for i in numbers[1:]:
            if [self._key(j) for j in members[i][:length]] != keys:
                logger.info("layer %d differs from layer 0; solving the whole program", i)
                return own
        classes = own
        for i in numbers[1:]:
            for position, j in enumerate(members[i][:length]):
                classes[j] = members[0][position]
        self.layers = len(numbers)
        logger.info("%d identical layers of %d nodes: solved once", self.layers, length)
        return classes


@functools.lru_cache(maxsize=65536)
def _local_shape(shape: tuple[int, ...], placement: str,
                 mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    mesh = DeviceMesh(mesh_shape, range(0, math.prod(mesh_shape)))
    return TensorSharding(mesh, placement).local_shape(shape)
