"""Drawing a random :class:`~.program.Program`: operators, private calls, placements."""

from __future__ import annotations

import math

import numpy as np

from .draw import Drawer
from .program import Function, Input, Op, Program, is_double_split, valid_placements

__all__ = ["MESHES", "DIMS", "MAX_ELEMENTS", "generate"]

#: The mesh shapes programs are drawn on.
MESHES: tuple[tuple[int, ...], ...] = ((2,), (4,), (2, 2), (2, 4))

#: Extents of the dimensions of new inputs (each divides by 2; most by 4 or 8).
DIMS: tuple[int, ...] = (4, 8, 16, 12, 6)

#: No value grows beyond this many elements (keeps kernels fast).
MAX_ELEMENTS = 2048


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
