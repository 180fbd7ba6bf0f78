"""The ``vm.builtin.*`` functions the board executor runs, as TVM's VM runs them.

Each entry of :data:`BUILTINS` makes, once per instruction, a step ``step(registers)``
from the instruction's destination, argument registers and literal arguments (the codes of
``match_shape`` and ``make_shape`` are literals: VMShapeLower writes them so). The codes
are those of TVM's ``src/runtime/vm/builtin.h``. numpy and the standard library only.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from tvm_distx.sources.formats import is_bfloat16
from tvm_distx.errors import PlanCheckError as _Fail, PlanError

__all__ = ["BUILTINS", "PlanError", "aligned"]

_ALIGN = 64
# match_shape / make_shape codes of TVM's VM (src/runtime/vm/builtin.h)
_ASSERT_IMM, _STORE, _NOOP, _ASSERT_LOAD = 0, 1, 2, 3
_USE_IMM, _LOAD = 0, 1


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array on a 64-byte boundary, as kernels assume."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    block = np.empty(count * dtype.itemsize + _ALIGN, np.uint8)
    start = -block.ctypes.data % _ALIGN
    return block[start:start + count * dtype.itemsize].view(dtype).reshape(tuple(shape))


def aligned(array: np.ndarray) -> np.ndarray:
    """``array`` itself if C-contiguous and 64-byte aligned, as kernels assume; else a copy that is.

    Arguments are copied so at each run: align long-lived ones (weights) once with this.
    """
    array = np.asarray(array)
    if array.flags.c_contiguous and array.ctypes.data % _ALIGN == 0:
        return array
    block = np.empty(array.nbytes + _ALIGN, np.uint8)
    start = -block.ctypes.data % _ALIGN
    copy = block[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def _getter(regs: list):
    if not regs:
        return lambda r: ()
    if len(regs) == 1:
        only = regs[0]
        return lambda r: (r[only],)
    return itemgetter(*regs)


def _literals(name: str, literals: list, start: int, stop: int | None = None) -> list:
    chosen = literals[start:stop]
    if any(v is None for v in chosen):
        raise PlanError(f"{name} with run-time codes is not run",
                        hint="run this program with backend='mpi'")
    return chosen


def _context(literals: list) -> str:
    return str(literals[-1]).strip() if literals and isinstance(literals[-1], str) else ""


def _alloc_shape_heap(executor, dst, regs, literals):
    size, = _literals("alloc_shape_heap", literals, 0, 1)

    def step(r):
        r[dst] = aligned(np.zeros(size, np.int64))
    return step


def _match_shape(executor, dst, regs, literals):
    value, heap = regs[0], regs[1]
    ndim, = _literals("match_shape", literals, 2, 3)
    codes = _literals("match_shape", literals, 3, 3 + 2 * ndim)
    context = _context(literals)
    checks = [(axis, codes[2 * axis], codes[2 * axis + 1]) for axis in range(ndim)
              if codes[2 * axis] != _NOOP]

    def step(r):
        found = r[value]
        shape = found.shape if isinstance(found, np.ndarray) else found
        if len(shape) != ndim:
            raise _Fail(f"{context}: {len(shape)} dimensions, expected {ndim}")
        h = r[heap]
        for axis, mode, slot in checks:
            extent = shape[axis]
            if mode == _STORE:
                h[slot] = extent
            elif mode == _ASSERT_IMM:
                if extent != slot:
                    raise _Fail(f"{context}: dimension {axis} is {extent}, expected {slot}")
            elif mode == _ASSERT_LOAD:
                if extent != h.item(slot):
                    raise _Fail(f"{context}: dimension {axis} is {extent}, expected "
                                f"{h.item(slot)} (as bound before)")
            else:
                raise _Fail(f"unknown match_shape code {mode}")
        r[dst] = None
    return step


def _match_prim_value(executor, dst, regs, literals):
    value, heap = regs[0], regs[1]
    mode, slot = _literals("match_prim_value", literals, 2, 4)
    context = _context(literals)

    def step(r):
        found, h = int(r[value]), r[heap]
        if mode == _STORE:
            h[slot] = found
        elif mode == _ASSERT_IMM and found != slot:
            raise _Fail(f"{context}: the value is {found}, expected {slot}")
        elif mode == _ASSERT_LOAD and found != h.item(slot):
            raise _Fail(f"{context}: the value is {found}, expected {h.item(slot)}")
        r[dst] = None
    return step


def _make_shape(executor, dst, regs, literals):
    heap = regs[0]
    ndim, = _literals("make_shape", literals, 1, 2)
    codes = _literals("make_shape", literals, 2, 2 + 2 * ndim)
    pairs = [(codes[2 * i], codes[2 * i + 1]) for i in range(ndim)]
    if all(mode == _USE_IMM for mode, _ in pairs):
        fixed = tuple(v for _, v in pairs)
        return lambda r: r.__setitem__(dst, fixed)
    if any(mode not in (_USE_IMM, _LOAD) for mode, _ in pairs):
        raise PlanError(f"make_shape codes {pairs} are not run", hint="run this program with "
                        "backend='mpi'")

    def step(r):
        item = r[heap].item
        r[dst] = tuple(item(v) if mode else v for mode, v in pairs)
    return step


def _make_prim_value(executor, dst, regs, literals):
    heap = regs[0]
    mode, value = _literals("make_prim_value", literals, 1, 3)
    if mode == _USE_IMM:
        return lambda r: r.__setitem__(dst, value)

    def step(r):
        r[dst] = r[heap].item(value)
    return step


def _check(name: str, stop: int, prepare):
    """A ``vm.builtin.check_*_info``: ``prepare(*literals)``, once per instruction, gives the
    test of the value, which says what is wrong with it (or None).

    The literals are the builtin's after its value, up to the error context (which
    :func:`_context` reads); the check leaves None in its register.
    """
    def make(executor, dst, regs, literals):
        value = regs[0]
        problem = prepare(*_literals(name, literals, 1, stop))
        context = _context(literals)

        def step(r):
            wrong = problem(r[value])
            if wrong:
                raise _Fail(f"{context}: {wrong}")
            r[dst] = None
        return step
    return make


def _tensor_test(ndim, dtype):
    bf16 = dtype == "bfloat16"  # ml_dtypes' or, on a board, its 16-bit patterns
    wanted = None if dtype in ("", "void") or bf16 else np.dtype(dtype)

    def problem(found):
        if not isinstance(found, np.ndarray):
            return f"expected a tensor, got {type(found).__name__}"
        if ((ndim != -1 and found.ndim != ndim) or (bf16 and not is_bfloat16(found.dtype))
                or (wanted is not None and found.dtype != wanted)):
            return f"got {found.dtype}{list(found.shape)}"
        return None
    return problem


def _shape_test(ndim):
    def problem(found):
        if not isinstance(found, tuple) or (ndim != -1 and len(found) != ndim):
            return f"expected a shape of {ndim} dimensions, got {found!r}"
        return None
    return problem


def _prim_value_test(dtype):
    kind = None if dtype in ("", "void") else np.dtype(dtype).kind

    def problem(found):
        ok = (isinstance(found, (bool, np.bool_)) if kind == "b" else
              isinstance(found, (int, np.integer)) and not isinstance(found, bool)
              if kind in "iu" else isinstance(found, (int, float, np.number))) \
            if kind else True
        return None if ok else f"expected a {dtype} value, got {found!r}"
    return problem


def _tuple_test(size):
    def problem(found):
        if not isinstance(found, tuple) or len(found) != size:
            return f"expected a tuple of {size}, got {type(found).__name__}"
        return None
    return problem


_check_tensor_info = _check("check_tensor_info", 3, _tensor_test)
_check_shape_info = _check("check_shape_info", 2, _shape_test)
_check_prim_value_info = _check("check_prim_value_info", 2, _prim_value_test)
_check_tuple_info = _check("check_tuple_info", 2, _tuple_test)


def _tuple_getitem(executor, dst, regs, literals):
    source, index = regs

    def step(r):
        r[dst] = r[source][r[index]]
    return step


def _reshape(executor, dst, regs, literals):
    source, shape = regs
    describe = executor._describe

    def step(r):
        array = r[source]
        view = array.reshape(r[shape])  # a view: the arrays of a plan are contiguous
        found = executor._tensors.get(id(array))
        if found is not None:
            describe(view, found[2])
        r[dst] = view
    return step


def _shape_of(executor, dst, regs, literals):
    source, = regs
    return lambda r: r.__setitem__(dst, r[source].shape)


def _copy(executor, dst, regs, literals):
    source, = regs
    return lambda r: r.__setitem__(dst, r[source])


def _null_value(executor, dst, regs, literals):
    return lambda r: r.__setitem__(dst, None)


def _make_tuple(executor, dst, regs, literals):
    get = _getter(regs)
    return lambda r: r.__setitem__(dst, tuple(get(r)))


_BUILTINS = {
    "vm.builtin.alloc_shape_heap": _alloc_shape_heap,
    "vm.builtin.match_shape": _match_shape,
    "vm.builtin.match_prim_value": _match_prim_value,
    "vm.builtin.make_shape": _make_shape,
    "vm.builtin.make_prim_value": _make_prim_value,
    "vm.builtin.check_tensor_info": _check_tensor_info,
    "vm.builtin.check_shape_info": _check_shape_info,
    "vm.builtin.check_prim_value_info": _check_prim_value_info,
    "vm.builtin.check_tuple_info": _check_tuple_info,
    "vm.builtin.tuple_getitem": _tuple_getitem,
    "vm.builtin.reshape": _reshape,
    "vm.builtin.shape_of": _shape_of,
    "vm.builtin.copy": _copy,
    "vm.builtin.null_value": _null_value,
    "vm.builtin.make_tuple": _make_tuple,
}
#: The ``vm.builtin.*`` packed functions this executor runs (the plan writer refuses others).
BUILTINS = frozenset(_BUILTINS)
