"""Run a rank plan with numpy and ctypes: the VM's program, with no TVM.

A plan (:mod:`tvm_distx.compiler.board_plan`) is the per-rank Relax program the VM would run,
as data. :class:`Executor` runs its functions: storage is numpy byte arrays, tensors are
numpy views of it, kernels are called through the tvm-ffi C ABI (``__tvm_ffi_<kernel>``,
the arguments as ``TVMFFIAny`` holding ``DLTensor`` pointers, as ``rvv_harness.c`` does),
symbolic extents live in a shape heap (an int64 array, as in TVM's VMShapeLower), and every
``tvm_distx.ccl.*`` call goes to ``collective(name, args)``.

Each function is translated once, when the executor is made, into a list of closures over
numbered registers (literals pre-filled), so that a decode step costs a few microseconds of
Python per instruction. ``DLTensor`` descriptors are packed into a ctypes arena, from the
storage address an allocation already knows.

Kernel failures: the kernels report an error through ``TVMFFIErrorSetRaisedFromCStrParts``,
which lives in TVM's runtime and is absent on a board. :class:`Kernels` points the library's
import slot for it (its GOT entry, found in the ELF file's relocations) at a Python callback,
so that a failing kernel raises :class:`PlanError` with the kernel's message instead of
ending the process with a "symbol lookup error". Where that cannot be done (not an ELF64
little-endian file, no ``dlinfo``) a failing kernel still ends the process.

This module imports numpy, ctypes and the standard library only (and
:mod:`tvm_distx.errors`): it is meant to run on a board that has Debian's python3-numpy and
nothing of TVM.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import math
import os
import struct
import threading
from operator import itemgetter

import numpy as np

from tvm_distx.runtime.board import _elf
from tvm_distx.runtime.board._builtins import (_ALIGN, _BUILTINS, BUILTINS, PlanError, _Fail,
                                        _getter, aligned)
from tvm_distx.sources.formats import is_bfloat16, numpy_dtype
from tvm_distx.errors import DistxError

__all__ = ["BUILTINS", "COLLECTIVE_PREFIX", "DTYPES", "FORMAT", "VERSIONS", "Executor", "Kernels",
           "PlanError", "check_plan",
           "aligned"]

logger = logging.getLogger(__name__)

#: What a rank plan says it is (``"format"``), and the versions this executor runs.
FORMAT = "tvm-distx-board-plan"
VERSIONS = (2,)
COLLECTIVE_PREFIX = "tvm_distx.ccl."
#: Data types of tensors and constants: their DLPack (code, bits).
DTYPES = {"bool": (6, 8), "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
          "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
          "float16": (2, 16), "float32": (2, 32), "float64": (2, 64)}
_DL = {np.dtype(name): code for name, code in DTYPES.items()}
_BFLOAT16 = (4, 16)  # kDLBfloat: ml_dtypes' bfloat16, or its bit patterns (BFLOAT16_BITS)


def _dl_code(dtype: np.dtype) -> tuple[int, int] | None:
    """The DLPack (code, bits) of an array's dtype; None for one kernels do not take."""
    return _BFLOAT16 if is_bfloat16(dtype) else _DL.get(dtype)

_TENSOR, _INT, _BOOL, _FLOAT = 7, 1, 2, 3  # kTVMFFIDLTensorPtr, kTVMFFIInt, kTVMFFIBool, ...
_CPU = 1


_SAFE_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                              ctypes.c_void_p)
_PARALLEL_BODY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_RAISED_PARTS = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                                 ctypes.c_int32)
_RAISED = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p)


_KEEP: list = []  # every callback given to a library (a library opened twice is one library)


class _ParallelEnv(ctypes.Structure):
    _fields_ = [("sync_handle", ctypes.c_void_p), ("num_task", ctypes.c_int32)]


class Kernels:
    """A kernel library opened with ctypes, its backend hooks filled (one task, numpy scratch).

    Parameters
    ----------
    path : str
        The library: the VM executable's exported ``lib.so`` (``__tvm_ffi_<kernel>``
        entries and the ``__TVMBackend*`` hook variables).
    runtime : str, optional
        The compiled board runtime (``board_runtime.so``, see
        ``tvm_distx.compiler.board_plan.build_board_runtime``): the hooks and the error
        reporter in C. Without it they are Python callbacks, correct but slow: kernels
        allocate workspace inside their parallel loops, thousands of times per step.

    A library is loaded once per process: opening the same file again gives the same
    library, whose hooks the last :class:`Kernels` made for it sets. Open each file once.

    Attributes
    ----------
    reports_errors : bool
        Whether a failing kernel raises :class:`PlanError` with its message (its error
        reporter import was redirected); otherwise a failing kernel ends the process.
    """

    def __init__(self, path: str, runtime: str | None = None) -> None:
        # lazy binding: the error reporter the kernels import lives in TVM's runtime, absent
        # here; it is only called when a kernel fails, and redirected below.
        # Local scope: every kernel library defines the same hook and entry names, and a
        # global one would interpose them on each library loaded after it (TVM's included).
        self.path = str(path)
        self.lib = ctypes.CDLL(self.path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        self._keep = _KEEP  # callbacks outlive the library's use of them: never freed
        self._scratch: dict[int, np.ndarray] = {}
        self._errors = threading.local()
        self._functions: dict[str, _SAFE_CALL] = {}
        self.runtime = None if runtime is None else ctypes.CDLL(str(runtime), mode=os.RTLD_LOCAL)
        if self.runtime is not None:
            hooks = {name: ctypes.cast(getattr(self.runtime, "tvm_distx_" + c_name),
                                       ctypes.c_void_p).value
                     for name, c_name in (("__TVMBackendParallelLaunch", "parallel_launch"),
                                          ("__TVMBackendAllocWorkspace", "alloc_workspace"),
                                          ("__TVMBackendFreeWorkspace", "free_workspace"))}
            self._set_hooks(hooks)
        else:
            self._python_hooks()
        self.reports_errors = self._redirect_error_reporters()

    def _set_hooks(self, hooks: dict[str, int]) -> None:
        for name, address in hooks.items():
            try:
                slot = ctypes.c_void_p.in_dll(self.lib, name)
            except ValueError:  # the kernels never need it
                continue
            slot.value = address

    def _python_hooks(self) -> None:
        @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
        def launch(body, cdata, num_task):
            env = _ParallelEnv(None, 1)
            return _PARALLEL_BODY(body)(0, ctypes.addressof(env), cdata)

        @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                          ctypes.c_int, ctypes.c_int)
        def alloc(device_type, device_id, size, code, bits):
            block = np.empty(max(int(size), 1) + _ALIGN, np.uint8)
            address = (block.ctypes.data + _ALIGN - 1) // _ALIGN * _ALIGN
            self._scratch[address] = block
            return address

        @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
        def free(device_type, device_id, pointer):
            self._scratch.pop(pointer, None)
            return 0

        self._keep += [launch, alloc, free]
        self._set_hooks({name: ctypes.cast(hook, ctypes.c_void_p).value for name, hook in (
            ("__TVMBackendParallelLaunch", launch), ("__TVMBackendAllocWorkspace", alloc),
            ("__TVMBackendFreeWorkspace", free))})

    def _redirect_error_reporters(self) -> bool:
        errors = self._errors

        @_RAISED_PARTS
        def raised_parts(kind, parts, count):
            text = b"".join(parts[i] or b"" for i in range(count))
            errors.message = f"{(kind or b'Error').decode()}: {text.decode(errors='replace')}"

        @_RAISED
        def raised(kind, message):
            errors.message = f"{(kind or b'Error').decode()}: {(message or b'').decode()}"

        self._keep += [raised_parts, raised]
        targets = {"TVMFFIErrorSetRaisedFromCStrParts": raised_parts,
                   "TVMFFIErrorSetRaisedFromCStr": raised}
        if self.runtime is not None:
            targets = {"TVMFFIErrorSetRaisedFromCStrParts": self.runtime.tvm_distx_error_parts,
                       "TVMFFIErrorSetRaisedFromCStr": self.runtime.tvm_distx_error}
        try:
            done = _elf.redirect_imports(self.path, self.lib._handle, {
                name: ctypes.cast(func, ctypes.c_void_p).value for name, func in targets.items()})
        except (OSError, struct.error) as err:
            logger.debug("%s: kernel errors cannot be redirected (%s)", self.path, err)
            return False
        return "TVMFFIErrorSetRaisedFromCStrParts" in done or not done

    def function(self, name: str) -> _SAFE_CALL:
        """The safe-call entry of kernel ``name`` (cached).

        Raises
        ------
        PlanError
            If the library has no such kernel.
        """
        found = self._functions.get(name)
        if found is None:
            try:
                found = self._functions[name] = _SAFE_CALL(("__tvm_ffi_" + name, self.lib))
            except AttributeError as err:
                raise PlanError(f"the kernel library {self.path} has no kernel {name}",
                                hint="build the plan and the library from the same module"
                                ) from err
        return found

    def failure(self, name: str) -> str:
        """The message of the kernel that just failed in this thread."""
        message = getattr(self._errors, "message", None)
        self._errors.message = None
        if self.runtime is not None:
            text = ctypes.create_string_buffer(4096)
            if self.runtime.tvm_distx_last_error(text, len(text)) > 0:
                message = text.value.decode(errors="replace")
        return f"kernel {name} failed" + (f": {message}" if message else "")


class _Storage:
    """An allocation: a 64-byte aligned byte array and its address."""

    __slots__ = ("array", "address")

    def __init__(self, size: int) -> None:
        block = np.empty(size + _ALIGN, np.uint8)
        address = block.ctypes.data
        start = -address % _ALIGN
        self.array, self.address = block[start:start + size], address + start


class _Arena:
    """DLTensor descriptors (and their shapes) packed into ctypes memory, reset per run."""

    _HEAD = "<QiiiBBHQQQ"  # data, device, ndim, dtype, shape, strides, byte_offset: 48 bytes

    def __init__(self, size: int = 1 << 16) -> None:
        self.blocks = [ctypes.create_string_buffer(size)]
        self.size, self.used = size, 0
        self.base = ctypes.addressof(self.blocks[0])
        self.formats = [struct.Struct(self._HEAD + "q" * n) for n in range(9)]

    def reset(self) -> None:
        del self.blocks[1:]
        self.base, self.used = ctypes.addressof(self.blocks[0]), 0

    def put(self, pointer: int, shape: tuple, code: tuple) -> int:
        ndim = len(shape)
        form = self.formats[ndim] if ndim < 9 else struct.Struct(self._HEAD + "q" * ndim)
        if self.used + form.size > self.size:  # a fresh block; the old ones stay until reset
            self.size = max(self.size, form.size)
            self.blocks.append(ctypes.create_string_buffer(self.size))
            self.base, self.used = ctypes.addressof(self.blocks[-1]), 0
        address = self.base + self.used
        form.pack_into(self.blocks[-1], self.used, pointer, _CPU, 0, ndim, code[0], code[1], 1,
                       address + 48, 0, 0, *shape)
        self.used += (form.size + 7) & ~7
        return address


class _Code:
    """One function, translated: registers with literals filled, and its steps."""

    __slots__ = ("name", "template", "params", "steps", "labels", "result")


def check_plan(plan) -> None:
    """Refuse what is not a rank plan of a version this executor runs.

    Raises
    ------
    PlanError
        Naming the format and version found.
    """
    found = plan if isinstance(plan, dict) else {}
    if found.get("format") != FORMAT or found.get("version") not in VERSIONS:
        raise PlanError(f"not a board plan this executor runs (format {found.get('format')!r}, "
                        f"version {found.get('version')!r}; runs {VERSIONS})",
                        hint="write the plan and run it with the same tvm_distx")


class Executor:
    """Runs the functions of one rank's plan (one executor per rank; not shared by threads).

    Parameters
    ----------
    plan : dict
        A rank plan (``rank_plan``).
    kernels : Kernels
        The plan's kernel library.
    collective : callable
        ``collective(name, args)`` for every ``tvm_distx.ccl.*`` call (the arrays and
        integers as the plan gives them; the output buffer last).

    Raises
    ------
    PlanError
        For a plan of another format or version, or an instruction this executor does not run.
    """

    def __init__(self, plan: dict, kernels: Kernels, collective) -> None:
        check_plan(plan)
        self.plan, self.kernels, self.collective = plan, kernels, collective
        self.constants = [_decode_constant(c) for c in plan.get("constants", [])]
        self._arena = _Arena()
        self._tensors: dict[int, tuple] = {}  # id -> (array, descriptor address, data address)
        self._depth = 0
        self._code = {name: self._translate(name, code)
                      for name, code in plan["functions"].items()}

    # ------------------------------------------------------------------ running
    def run(self, function: str, *args):
        """Run ``function`` on numpy arrays (and ints); returns its result (a tuple for tuples).

        Raises
        ------
        PlanError
            For an unknown function, a wrong number of arguments, a failed check of the
            program (shapes, dtypes) or a failing kernel, naming the function.
        """
        code = self._code.get(function)
        if code is None:
            raise PlanError(f"the plan has no function '{function}'",
                            hint=f"it has: {', '.join(self._code)}")
        if len(args) != len(code.params):
            raise PlanError(f"function '{function}' takes {len(code.params)} arguments, got "
                            f"{len(args)}", hint="pass every parameter, weights included")
        if self._depth == 0:
            self._arena.reset()
            self._tensors = {}
        self._depth += 1
        try:
            return self._execute(code, args)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._tensors = {}

    def _execute(self, code: _Code, args):
        registers = code.template.copy()
        for index, value in zip(code.params, args):
            if isinstance(value, np.ndarray) and id(value) not in self._tensors:
                value = self._enter(value)
            registers[index] = value
        step = -1
        try:
            for step, run in enumerate(code.steps):
                run(registers)
            return code.result(registers)
        except _Fail as err:  # a check of the program: the inputs do not fit it
            raise PlanError(f"{self._where(code, step)}: {err.message}",
                            hint="the inputs do not fit the program") from err
        except DistxError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure, named where it happened
            raise PlanError(f"{self._where(code, step)}: {err}", hint="a bug of the board "
                            "executor or of its plan: run the program with backend='mpi' and "
                            "report it") from err

    @staticmethod
    def _where(code, step: int) -> str:
        return f"function '{code.name}', instruction {step} ({code.labels[step]})"

    def _enter(self, array: np.ndarray) -> np.ndarray:
        """An argument as kernels take it: contiguous, 64-byte aligned (else copied), described."""
        if _dl_code(array.dtype) is None:
            raise PlanError(f"an argument of dtype {array.dtype}: the board executor runs "
                            f"{', '.join(DTYPES)} and bfloat16",
                            hint="convert it, or use backend='mpi'")
        address = array.ctypes.data
        if address % _ALIGN or not array.flags.c_contiguous:
            array = aligned(array)
            address = array.ctypes.data
        self._describe(array, address)
        return array

    def _describe(self, array: np.ndarray, address: int) -> int:
        """The DLTensor address of ``array`` (data at ``address``) for this run."""
        descriptor = self._arena.put(address, array.shape, _dl_code(array.dtype))
        self._tensors[id(array)] = (array, descriptor, address)
        return descriptor

    def _descriptor(self, array) -> int:
        found = self._tensors.get(id(array))
        if found is not None:
            return found[1]
        if not isinstance(array, np.ndarray):
            raise _Fail(f"a kernel argument is a {type(array).__name__}, not an array")
        address = array.ctypes.data
        if _dl_code(array.dtype) is None or address % _ALIGN or not array.flags.c_contiguous:
            raise _Fail(f"a kernel argument ({array.dtype}{list(array.shape)}) is not a "
                        "contiguous 64-byte aligned tensor of a known dtype")
        return self._describe(array, address)

    # ------------------------------------------------------------- translating
    def _translate(self, name: str, function: dict) -> _Code:
        code = _Code()
        code.name = name
        template = [None] * function["registers"]
        steps, labels = [], []

        def register(operand) -> int:
            """The register holding ``operand`` (a fresh one for a literal or a composite)."""
            (kind, value), = operand.items()
            if kind == "var":
                return value
            index = len(template)
            template.append(None)
            if kind in ("tuple", "item") and _has_var(operand):
                parts = [register(p) for p in (value if kind == "tuple" else value[:1])]
                if kind == "tuple":
                    get = itemgetter(*parts) if len(parts) > 1 else None

                    def build(r, get=get, only=parts[0] if parts else None):
                        r[index] = get(r) if get else (() if only is None else (r[only],))
                else:
                    def build(r, source=parts[0], field=value[1]):
                        r[index] = r[source][field]
                steps.append(build)
                labels.append(kind)
            else:
                template[index] = self._literal(operand)
            return index

        for instruction in function["body"]:
            regs = [register(a) for a in instruction["args"]]
            literals = [self._literal(a) if not _has_var(a) else None
                        for a in instruction["args"]]
            op, callee = instruction["op"], instruction.get("name")
            steps.append(self._step(op, callee, instruction["dst"], regs, literals))
            labels.append(callee or op)
        result = register(function["result"])
        code.template, code.params = template, tuple(function["params"])
        code.steps, code.labels = steps, labels
        code.result = lambda r: r[result]
        return code

    def _literal(self, operand: dict):
        (kind, value), = operand.items()
        if kind in ("int", "float", "bool", "str", "dtype", "null"):
            return value
        if kind == "shape":
            return tuple(value)
        if kind == "const":
            return self.constants[value]
        if kind == "tuple":
            return tuple(self._literal(v) for v in value)
        if kind == "item":
            return self._literal(value[0])[value[1]]
        raise PlanError(f"unknown operand {operand}", hint="write the plan with the same "
                        "tvm_distx that runs it")

    def _step(self, op: str, name: str | None, dst: int, regs: list, literals: list):
        if op == "kernel":
            return self._kernel(name, dst, regs, literals)
        if op == "builtin" and name.startswith(COLLECTIVE_PREFIX):
            get, collective = _getter(regs), self.collective

            def step(r):
                r[dst] = collective(name, list(get(r)))
            return step
        if op == "builtin":
            make = _BUILTINS.get(name)
            if make is None:
                raise PlanError(f"the builtin {name} is not run by the board executor",
                                hint="run this program with backend='mpi'")
            return make(self, dst, regs, literals)
        if op == "call":
            get, run = _getter(regs), self.run

            def step(r):
                r[dst] = run(name, *get(r))
            return step
        if op == "alloc_storage":
            return self._alloc_storage(dst, regs)
        if op == "alloc_tensor":
            return self._alloc_tensor(dst, regs, literals)
        if op == "kill":
            killed = regs[0]

            def step(r):
                r[killed] = r[dst] = None
            return step
        if op == "null":
            return lambda r: r.__setitem__(dst, None)
        if op == "alias":
            source = regs[0]
            return lambda r: r.__setitem__(dst, r[source])
        raise PlanError(f"unknown instruction {op}", hint="write the plan with the same "
                        "tvm_distx that runs it")

    def _kernel(self, name: str, dst: int, regs: list, literals: list):
        function, kernels, descriptor = self.kernels.function(name), self.kernels, self._descriptor
        count = len(regs)
        packer = struct.Struct("<" + "iIq" * count)
        buffer = ctypes.create_string_buffer(max(packer.size, 16))
        result = ctypes.create_string_buffer(16)
        args_address, result_address = ctypes.addressof(buffer), ctypes.addressof(result)
        values = [0] * (3 * count)
        variable = []
        for position, (reg, literal) in enumerate(zip(regs, literals)):
            if isinstance(literal, (bool, int, float)):
                values[3 * position:3 * position + 3] = _scalar(literal)
            else:  # an array (a register, or a constant)
                variable.append((3 * position, reg))
        pack_into = packer.pack_into

        def step(r):
            for slot, reg in variable:
                value = r[reg]
                if value.__class__ is np.ndarray:
                    found = self._tensors.get(id(value))
                    values[slot] = _TENSOR
                    values[slot + 2] = found[1] if found is not None else descriptor(value)
                else:
                    values[slot:slot + 3] = _scalar(value)
            pack_into(buffer, 0, *values)
            if function(None, args_address, count, result_address) != 0:
                raise _Fail(kernels.failure(name))
            r[dst] = None
        return step

    def _alloc_storage(self, dst: int, regs: list):
        size = regs[0]

        def step(r):
            r[dst] = _Storage(int(r[size][0]))
        return step

    def _alloc_tensor(self, dst: int, regs: list, literals: list):
        storage, offset, shape, dtype = regs[0], literals[1], regs[2], literals[3]
        if not isinstance(offset, int) or dtype is None:
            raise PlanError("alloc_tensor with a run-time offset or dtype is not run",
                            hint="run this program with backend='mpi'")
        dtype = numpy_dtype(dtype)
        itemsize, describe = dtype.itemsize, self._describe

        def step(r):
            where, extents = r[storage], r[shape]
            end = offset + math.prod(extents) * itemsize
            if end > where.array.size:  # the VM checks it too: never write past a storage
                raise _Fail(f"a tensor of shape {extents} needs {end} bytes of a storage of "
                            f"{where.array.size} (an extent beyond its upper bound?)")
            view = where.array[offset:end].view(dtype).reshape(extents)
            describe(view, where.address + offset)
            r[dst] = view
        return step


def _has_var(operand: dict) -> bool:
    (kind, value), = operand.items()
    if kind == "var":
        return True
    if kind == "tuple":
        return any(_has_var(v) for v in value)
    return kind == "item" and _has_var(value[0])


def _scalar(value) -> tuple:
    """A scalar kernel argument as (type index, padding, int64 bits)."""
    if isinstance(value, (bool, np.bool_)):
        return _BOOL, 0, int(value)
    if isinstance(value, (int, np.integer)):
        return _INT, 0, int(value)
    if isinstance(value, (float, np.floating)):
        return _FLOAT, 0, struct.unpack("<q", struct.pack("<d", float(value)))[0]
    raise _Fail(f"a kernel argument is a {type(value).__name__}")


def _decode_constant(written: dict) -> np.ndarray:
    dtype = numpy_dtype(written["dtype"])
    if "values" in written:
        array = np.array(written["values"], dtype)
    else:
        array = np.frombuffer(base64.b64decode(written["data"]), dtype)
    return aligned(array.reshape(written["shape"]))
