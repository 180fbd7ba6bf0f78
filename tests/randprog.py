"""Random Relax programs with random shardings, and their numpy answers.

The randomized equivalence tests (``test_random_programs.py``) draw a
:class:`Program` with :func:`generate`, build it as an annotated Relax module
with :func:`build_module`, compile and run it with :func:`tvm_distx.compile`,
and compare with :func:`reference`, which evaluates the same program with
numpy on one process.

A program is a small description, not Relax: a list of operations per
function (``main`` and private functions called from it), each naming its
operands by index. Both the Relax module and the numpy answer are built from
that one description, so they cannot disagree about what the program is.

Covered:

* operators: ``matmul`` (2-D, batched 3-D by 2-D, 3-D by 3-D), ``add``,
  ``multiply``, ``subtract`` (with broadcasting operands), ``exp``, ``tanh``,
  ``relu``, ``sum`` and ``max`` over one axis (``keepdims`` or not),
  ``reshape`` (two dimensions merged, or one split), ``permute_dims``,
  ``softmax``, and one half of ``split`` (a kernel with a tuple result);
* calls of private functions, once or twice (on other operands, or on the
  first call's result), and calls from one private function to another;
* meshes ``(2,)``, ``(4,)``, ``(2, 2)`` and ``(2, 4)``;
* placements of the inputs that divide their shapes, given either as
  ``R.dist.annotate_sharding`` in the module or as
  :class:`tvm_distx.ShardingRule` parameter rules applied with
  :class:`tvm_distx.passes.AnnotateSharding`;
* annotations of intermediate values (changes of placement, planned as
  redistributes), in ``main`` and inside private functions;
* functions with and without dataflow blocks.

The draws come from a :class:`Drawer`: :class:`HypothesisDrawer` lets
hypothesis choose (and shrink a failing program), :class:`SeededDrawer` makes
the program a function of one integer seed (for replays and stress runs).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

__all__ = [
    "MESHES", "Drawer", "HypothesisDrawer", "SeededDrawer", "Op", "Function", "Input",
    "Program", "generate", "build_module", "reference", "random_inputs", "valid_placements",
    "is_double_split", "compare", "report",
    "run_case", "RTOL", "ATOL",
]

#: The mesh shapes programs are drawn on.
MESHES: tuple[tuple[int, ...], ...] = ((2,), (4,), (2, 2), (2, 4))

#: Extents of the dimensions of new inputs (each divides by 2; most by 4 or 8).
DIMS: tuple[int, ...] = (4, 8, 16, 12, 6)

#: No value grows beyond this many elements (keeps kernels fast).
MAX_ELEMENTS = 2048


# ---------------------------------------------------------------------- drawing
class Drawer(Protocol):
    """Where a program's random choices come from."""

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``; shrinks toward ``low``."""

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``; shrinks toward the first."""

    def chance(self, percent: int) -> bool:
        """True with probability ``percent`` / 100; shrinks toward False."""


class HypothesisDrawer:
    """Draws through hypothesis' ``st.data()``, so a failing program shrinks.

    Parameters
    ----------
    data : hypothesis.strategies.DataObject
        The object a ``@given(st.data())`` test receives.
    """

    def __init__(self, data) -> None:
        from hypothesis import strategies as st

        self._data = data
        self._st = st

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``."""
        return self._data.draw(self._st.integers(low, high))

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        return options[self.integer(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        """True with probability about ``percent`` / 100."""
        return self.integer(0, 99) >= 100 - percent


class SeededDrawer:
    """Draws from numpy's generator seeded with one integer.

    Parameters
    ----------
    seed : int
        The same seed gives the same program.
    """

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``."""
        return int(self._rng.integers(low, high + 1))

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        return options[self.integer(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        """True with probability ``percent`` / 100."""
        return self.integer(0, 99) < percent


# ---------------------------------------------------------------------- programs
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
    from tvm_distx import DeviceMesh, Placement, ShardingError

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


# ---------------------------------------------------------------------- generation
class _Scope:
    """A function being generated: its values and how to get new operands."""

    def __init__(self, program: "_Builder", func: Function, depth: int) -> None:
        self.program = program
        self.func = func
        self.depth = depth

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return self.func.shapes()

    def new_operand(self, shape: tuple[int, ...]) -> int:
        """A fresh input of ``shape``: a new parameter of this function.

        In ``main`` it is a new program input with a random placement; in a
        private function it becomes a parameter its callers must pass.
        """
        self.func.params.append(shape)
        index = len(self.func.params) - 1
        # parameters come first: shift operation operands that refer to results
        self.func.ops = [_shift(op, index) for op in self.func.ops]
        self.func.outputs = [o + 1 if o >= index else o for o in self.func.outputs]
        if self.func.name == "main":
            self.program.add_input(shape)
        return index

    def emit(self, op: Op) -> int:
        self.func.ops.append(op)
        return len(self.func.params) + len(self.func.ops) - 1


def _shift(op: Op, index: int) -> Op:
    from dataclasses import replace

    return replace(op, args=tuple(a + 1 if a >= index else a for a in op.args))


class _Builder:
    def __init__(self, draw: Drawer, mesh: tuple[int, ...]) -> None:
        self.draw = draw
        self.mesh = mesh
        self.inputs: list[Input] = []
        self.functions: dict[str, Function] = {}
        self.rules = draw.chance(30)

    def placement(self, shape: tuple[int, ...]) -> str:
        """A random valid placement; mostly with no dimension split twice."""
        every = valid_placements(shape, self.mesh)
        single = [p for p in every if not is_double_split(p)]
        double = [p for p in every if is_double_split(p)]
        if double and self.draw.chance(8):
            return self.draw.choice(double)
        return self.draw.choice(single)

    def add_input(self, shape: tuple[int, ...]) -> None:
        self.inputs.append(Input(shape, self.placement(shape)))

    def new_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(self.draw.choice(DIMS) for _ in range(rank))


def generate(draw: Drawer, *, max_ops: int = 7, mesh: tuple[int, ...] | None = None) -> Program:
    """Draw a random program.

    Parameters
    ----------
    draw : Drawer
        Where the choices come from.
    max_ops : int
        At most this many operations in ``main`` (a call counts as one).
    mesh : tuple of int, optional
        Use this mesh instead of drawing one from :data:`MESHES`.

    Returns
    -------
    Program
    """
    mesh = mesh if mesh is not None else draw.choice(MESHES)
    builder = _Builder(draw, mesh)
    main = Function("main", [], dataflow=not draw.chance(20))
    scope = _Scope(builder, main, depth=0)
    scope.new_operand(builder.new_shape(draw.choice((2, 3))))  # main's first parameter
    count = draw.integer(1, max_ops)
    for _ in range(count):
        _step(scope)
    main.outputs = [len(main.params) + len(main.ops) - 1]
    if draw.chance(15) and len(main.ops) >= 2:  # a second result: a tuple
        other = draw.integer(0, len(main.params) + len(main.ops) - 2)
        main.outputs.append(other)
    builder.functions["main"] = main
    # main's parameters were appended as new_operand asked; placements are in order
    program = Program(mesh, builder.inputs, builder.functions, rules=builder.rules)
    return program


def _pick(scope: _Scope, accept=lambda shape: True) -> int | None:
    """An existing value whose shape ``accept``s, preferring recent ones; None if none."""
    shapes = scope.shapes
    good = [i for i, s in enumerate(shapes) if accept(s)]
    if not good:
        return None
    # recent values first, so chains form; shrinks toward the most recent
    good.reverse()
    return scope.program.draw.choice(good)


KINDS = ("unary", "binary", "matmul", "reduce", "softmax", "reshape", "permute", "split",
         "annotate", "call")


def _step(scope: _Scope) -> None:
    draw = scope.program.draw
    kind = draw.choice(KINDS if scope.depth < 2 else KINDS[:-1])
    x = _pick(scope)
    shape = scope.shapes[x]
    rank = len(shape)
    if kind == "unary":
        unary = draw.choice(("tanh", "exp", "relu"))
        if unary == "exp":  # bounded first: exp of a large value overflows float32
            x = scope.emit(Op("tanh", (x,), shape))
        scope.emit(Op(unary, (x,), shape))
    elif kind == "binary":
        _binary(scope, x)
    elif kind == "matmul" and rank >= 2:
        _matmul(scope, x)
    elif kind == "reduce" and rank >= 2:
        axis = draw.integer(0, rank - 1)
        keep = draw.chance(50)
        out = tuple(1 if d == axis else n for d, n in enumerate(shape)) if keep else \
            tuple(n for d, n in enumerate(shape) if d != axis)
        scope.emit(Op(draw.choice(("sum", "max")), (x,), out, axis=axis, keepdims=keep))
    elif kind == "softmax":
        scope.emit(Op("softmax", (x,), shape, axis=draw.integer(0, rank - 1)))
    elif kind == "reshape":
        _reshape(scope, x)
    elif kind == "permute" and rank >= 2:
        axes = list(range(rank))
        order = []
        while axes:
            order.append(axes.pop(draw.integer(0, len(axes) - 1)))
        scope.emit(Op("permute_dims", (x,), tuple(shape[a] for a in order), axes=tuple(order)))
    elif kind == "split" and any(n % 2 == 0 for n in shape):
        axis = draw.choice([d for d, n in enumerate(shape) if n % 2 == 0])
        half = tuple(n // 2 if d == axis else n for d, n in enumerate(shape))
        scope.emit(Op("split", (x,), half, axis=axis, half=draw.integer(0, 1)))
    elif kind == "annotate" and not (scope.program.rules and scope.func.name == "main"
                                     and x < len(scope.func.params)):
        # (with rules, a parameter's first annotation is the rule's: annotating
        # a parameter of main again would be a conflicting input, not a move)
        scope.emit(Op("annotate", (x,), shape, placement=scope.program.placement(shape)))
    elif kind == "call":
        _call(scope)
    else:  # the operator does not apply to this value: an elementwise op instead
        scope.emit(Op("tanh", (x,), shape))


def _binary(scope: _Scope, x: int) -> None:
    draw = scope.program.draw
    shape = scope.shapes[x]

    def broadcasts(other):
        try:
            return np.broadcast_shapes(other, shape) == shape
        except ValueError:
            return False

    y = _pick(scope, broadcasts) if draw.chance(60) else None
    if y is None:
        if draw.chance(30):  # a broadcast operand: leading dims dropped, some set to 1
            drop = draw.integer(0, len(shape) - 1)
            other = tuple(1 if draw.chance(25) else n for n in shape[drop:])
        else:
            other = shape
        y = scope.new_operand(other)
        x = x + 1 if x >= y else x  # the new parameter shifted the results
    args = (y, x) if draw.chance(30) else (x, y)
    scope.emit(Op(draw.choice(("add", "multiply", "subtract")), args, shape))


def _matmul(scope: _Scope, x: int) -> None:
    draw = scope.program.draw
    shape = scope.shapes[x]
    k = shape[-1]
    if len(shape) == 3 and draw.chance(35):  # batch by batch
        want = lambda s: len(s) == 3 and s[0] == shape[0] and s[1] == k  # noqa: E731
        batch = (shape[0],)
    else:
        want = lambda s: len(s) == 2 and s[0] == k  # noqa: E731
        batch = ()
    y = _pick(scope, want) if draw.chance(40) else None
    if y is None:
        n = draw.choice(DIMS)
        y = scope.new_operand(batch + (k, n))
        x = x + 1 if x >= y else x
    n = scope.shapes[y][-1]
    out = shape[:-1] + (n,)
    if math.prod(out) > MAX_ELEMENTS:
        scope.emit(Op("tanh", (x,), shape))
        return
    scope.emit(Op("matmul", (x, y), out))


def _reshape(scope: _Scope, x: int) -> None:
    draw = scope.program.draw
    shape = scope.shapes[x]
    rank = len(shape)
    splittable = [d for d, n in enumerate(shape) if n >= 4 and n % 2 == 0]
    if rank >= 2 and (rank == 3 or not splittable or draw.chance(50)):
        d = draw.integer(0, rank - 2)  # merge d and d+1
        new = shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:]
    elif splittable:
        d = draw.choice(splittable)
        factors = [f for f in (2, 4, 3) if shape[d] % f == 0 and shape[d] // f >= 1]
        f = draw.choice(factors)
        new = shape[:d] + (f, shape[d] // f) + shape[d + 1:]
    else:
        scope.emit(Op("tanh", (x,), shape))
        return
    scope.emit(Op("reshape", (x,), new, new_shape=new))


def _call(scope: _Scope) -> None:
    """Wrap a new private function around a random body; call it once or twice."""
    builder = scope.program
    draw = builder.draw
    name = f"f{len(builder.functions)}"
    builder.functions[name] = None  # reserve the name (callees come before callers)
    x = _pick(scope)
    func = Function(name, [scope.shapes[x]], dataflow=not draw.chance(20))
    inner = _Scope(builder, func, depth=scope.depth + 1)
    for _ in range(draw.integer(1, 3)):
        _step(inner)
    func.outputs = [len(func.params) + len(func.ops) - 1]
    del builder.functions[name]
    builder.functions[name] = func
    # the caller passes: x for the first parameter, and for parameters the body
    # added, an existing value of that shape or a new operand of its own
    args = [x]
    for shape in func.params[1:]:
        y = _pick(scope, lambda s, shape=shape: s == shape) if draw.chance(40) else None
        if y is None:
            y = scope.new_operand(shape)
            args = [a + 1 if a >= y else a for a in args]
        args.append(y)
    result = scope.emit(Op("call", tuple(args), func.shapes()[func.outputs[0]], callee=name))
    if draw.chance(50):  # a second call: on the result when its shape fits, else on others
        first = func.params[0]
        if scope.shapes[result] == first and draw.chance(60):
            second = [result, *args[1:]]
        else:
            other = _pick(scope, lambda s: s == first)
            second = [other, *args[1:]]
        scope.emit(Op("call", tuple(second), func.shapes()[func.outputs[0]], callee=name))


# ---------------------------------------------------------------------- Relax
def build_module(program: Program):
    """The program as a Relax module annotated with its input placements.

    Returns
    -------
    tvm.IRModule
        Ready for :func:`tvm_distx.compile`: with ``program.rules``, the
        parameter annotations come from :class:`tvm_distx.ShardingRule` rules
        through :class:`tvm_distx.passes.AnnotateSharding`; otherwise they are
        ``R.dist.annotate_sharding`` calls at the start of ``main``.
    """
    import tvm
    from tvm import relax
    from tvm.relax.distributed import DeviceMesh, Placement

    mesh = DeviceMesh(list(program.mesh), tvm.ir.Range(0, program.num_devices))
    bb = relax.BlockBuilder()
    gvars: dict[str, object] = {}

    def annotate(value, placement: str):
        return relax.op.distributed.annotate_sharding(value, mesh, Placement.from_text(placement))

    for name, func in program.functions.items():
        names = func.names()
        params = [relax.Var(names[i], relax.TensorType(list(s), "float32"))
                  for i, s in enumerate(func.params)]
        is_main = name == "main"
        with bb.function(name, params, private=not is_main):
            values: list = list(params)
            with (bb.dataflow() if func.dataflow else contextlib.nullcontext()):
                if is_main and not program.rules:
                    for i, inp in enumerate(program.inputs):
                        values[i] = bb.emit(annotate(params[i], inp.placement), f"{names[i]}_s")
                for i, op in enumerate(func.ops):
                    var_name = names[len(func.params) + i]
                    expr = _relax_op(op, [values[a] for a in op.args], annotate, gvars)
                    values.append(bb.emit(expr, var_name))
                outs = [values[o] for o in func.outputs]
                result = outs[0] if len(outs) == 1 else relax.Tuple(outs)
                if func.dataflow:
                    result = bb.emit_output(result)
            # the GlobalVar to call: the BlockBuilder keeps one of two equal functions
            gvars[name] = bb.emit_func_output(result)
    mod = bb.get()
    mod.update_global_info("mesh", [mesh])
    if program.rules:
        from tvm_distx import ShardingRule
        from tvm_distx.passes import AnnotateSharding

        names = program.main.names()
        rules = [ShardingRule(param=names[i], result=inp.placement, function="main")
                 for i, inp in enumerate(program.inputs)]
        mod = AnnotateSharding(rules)(mod)
    return mod


def _relax_op(op: Op, args: list, annotate, gvars: dict):
    from tvm import relax

    R = relax.op
    if op.kind == "matmul":
        return R.matmul(args[0], args[1])
    if op.kind in ("add", "multiply", "subtract"):
        return getattr(R, op.kind)(args[0], args[1])
    if op.kind in ("exp", "tanh"):
        return getattr(R, op.kind)(args[0])
    if op.kind == "relu":
        return R.nn.relu(args[0])
    if op.kind in ("sum", "max"):
        return getattr(R, op.kind)(args[0], axis=[op.axis], keepdims=op.keepdims)
    if op.kind == "softmax":
        return R.nn.softmax(args[0], axis=op.axis)
    if op.kind == "reshape":
        return R.reshape(args[0], op.new_shape)
    if op.kind == "permute_dims":
        return R.permute_dims(args[0], list(op.axes))
    if op.kind == "split":
        return relax.TupleGetItem(R.split(args[0], 2, axis=op.axis), op.half)
    if op.kind == "annotate":
        return annotate(args[0], op.placement)
    if op.kind == "call":
        return relax.Call(gvars[op.callee], args)
    raise ValueError(f"unknown operation {op.kind!r}")


# ---------------------------------------------------------------------- numpy
def random_inputs(program: Program, seed: int) -> list[np.ndarray]:
    """Float32 inputs for ``main``, from numpy's generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    return [(0.5 * rng.standard_normal(inp.shape)).astype("float32") for inp in program.inputs]


def reference(program: Program, inputs: Sequence[np.ndarray]):
    """``main``'s result computed by numpy (in float64) on one process.

    Returns
    -------
    numpy.ndarray or tuple of numpy.ndarray
        A tuple when ``main`` returns several values.
    """
    outs = _evaluate(program, "main", [np.asarray(a, "float64") for a in inputs])
    return outs[0] if len(outs) == 1 else tuple(outs)


def _evaluate(program: Program, name: str, args: list[np.ndarray]) -> list[np.ndarray]:
    func = program.functions[name]
    values = list(args)
    for op in func.ops:
        a = [values[i] for i in op.args]
        values.append(_numpy_op(program, op, a))
        assert values[-1].shape == op.shape, (op, values[-1].shape)
    return [values[o] for o in func.outputs]


def _numpy_op(program: Program, op: Op, a: list[np.ndarray]) -> np.ndarray:
    kind = op.kind
    if kind == "matmul":
        return a[0] @ a[1]
    if kind == "add":
        return a[0] + a[1]
    if kind == "multiply":
        return a[0] * a[1]
    if kind == "subtract":
        return a[0] - a[1]
    if kind == "exp":
        return np.exp(a[0])
    if kind == "tanh":
        return np.tanh(a[0])
    if kind == "relu":
        return np.maximum(a[0], 0)
    if kind == "sum":
        return a[0].sum(axis=op.axis, keepdims=op.keepdims)
    if kind == "max":
        return a[0].max(axis=op.axis, keepdims=op.keepdims)
    if kind == "softmax":
        shifted = np.exp(a[0] - a[0].max(axis=op.axis, keepdims=True))
        return shifted / shifted.sum(axis=op.axis, keepdims=True)
    if kind == "reshape":
        return a[0].reshape(op.new_shape)
    if kind == "permute_dims":
        return a[0].transpose(op.axes)
    if kind == "split":
        return np.split(a[0], 2, axis=op.axis)[op.half]
    if kind == "annotate":
        return a[0]
    if kind == "call":
        return _evaluate(program, op.callee, a)[0]
    raise ValueError(f"unknown operation {kind!r}")


# ---------------------------------------------------------------------- checking
#: Relative tolerance of the comparison with numpy (float32 against float64).
RTOL = 1e-4
#: Absolute tolerance, relative to the largest magnitude of the expected result.
ATOL = 1e-4


def compare(program: Program, got, want) -> None:
    """Assert that ``got`` (the distributed run) equals ``want`` (numpy).

    Shapes and dtypes must match exactly; values to :data:`RTOL` and
    :data:`ATOL` times the largest magnitude of the expected value (at least 1).

    Raises
    ------
    AssertionError
        Naming the result, the shapes or the largest error.
    """
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    assert len(gots) == len(wants), f"{len(gots)} results, numpy has {len(wants)}"
    for i, (g, w) in enumerate(zip(gots, wants)):
        g = np.asarray(g)
        assert g.shape == w.shape, f"result {i}: shape {g.shape}, numpy says {w.shape}"
        assert g.dtype == np.float32, f"result {i}: dtype {g.dtype}, expected float32"
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL * scale,
                                   err_msg=f"result {i} differs from numpy")


def report(program: Program, seed: int | None, module=None) -> str:
    """What to print when a case fails: the seed, the program, its TVMScript."""
    lines = []
    if seed is not None:
        lines.append(f"seed {seed}: replay with TVM_DISTX_SEED={seed} "
                     "python -m pytest tests/test_random_programs.py -k replay")
    lines.append(program.describe())
    if module is not None:
        lines.append(module.script(show_meta=False))
    return "\n".join(lines)


def run_case(program: Program, inputs: Sequence[np.ndarray], backend: str = "emulate",
             **run_options) -> None:
    """Compile and run one program, and assert that it equals numpy.

    Nothing is refused: every generated program is valid, so any error
    (a ``tvm_distx`` error, a TVM ``InternalError``, a wrong number) fails.
    """
    import tvm_distx as td

    exe = td.compile(build_module(program), schedule=False)
    compare(program, exe.run(*inputs, backend=backend, **run_options),
            reference(program, inputs))


def main(argv: Sequence[str] | None = None) -> int:
    """Stress driver: ``python tests/randprog.py --cases N [--seed S]``.

    Runs the seeded programs ``S .. S+N-1`` on the emulated backend, prints
    every failing seed with its program, and a summary line. Returns 1 if any
    case failed.
    """
    import argparse
    import logging
    import time
    import traceback

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=None,
                        help="first seed (default: from the clock, printed)")
    parser.add_argument("--backend", default="emulate", choices=("emulate", "mpi", "disco"))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    first = args.seed if args.seed is not None else int(time.time()) % 1_000_000 * 1000
    print(f"stress: seeds {first} .. {first + args.cases - 1} on {args.backend}", flush=True)
    counts = {"ok": 0, "failed": 0}
    failed = []
    started = time.monotonic()
    for seed in range(first, first + args.cases):
        program = generate(SeededDrawer(seed))
        try:
            run_case(program, random_inputs(program, seed), args.backend)
            status = "ok"
        except Exception:  # noqa: BLE001 - every failure is reported, then counted
            status = "failed"
            failed.append(seed)
            print(f"FAILED {report(program, seed)}\n{traceback.format_exc()}", flush=True)
        counts[status] += 1
        if args.verbose or (seed - first + 1) % 100 == 0:
            print(f"  {seed - first + 1}/{args.cases}: {counts}", flush=True)
    elapsed = time.monotonic() - started
    print(f"stress: {args.cases} cases from seed {first} in {elapsed:.0f} s: "
          f"{counts['ok']} equal to numpy, {counts['failed']} failed"
          + (f" (seeds {', '.join(map(str, failed))})" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
