"""The rank's half of every backend: what one rank keeps and how it runs one call.

Every backend's ranks (MPI processes, disco workers, emulated threads) hold a
:class:`RankState` and hand it each message their driver sends, so a call
means the same everywhere:

* ``("call", function, values, sizes, state, keep)``: this rank's entry of a
  bundle's public function on its shards (:meth:`RankState.call`);
* ``("entry", name, args)``: a rank-local function of a library with its
  arguments as they are (:meth:`RankState.run_entry`; the runs of compiled rank
  programs without a bundle, :func:`tvm_distx.runtime.emulated.emulate` and
  :func:`tvm_distx.runtime.disco.run_disco`).

What runs the rank's functions is a :class:`Program`: TVM's virtual machine
(:class:`VMProgram`) on every backend but the board's, whose ranks run the
same program as a plan with no TVM (:class:`tvm_distx.runtime.board.program.PlanProgram`).

Fault injection for tests (:func:`inject_fault`): ``TVM_DISTX_FAULT="<rank>:<kind>"``
with kind ``raise``, ``kill`` or ``hang``; each backend says where it honours
which kind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from typing import Callable, NamedTuple, Protocol

import numpy as np

from tvm_distx.errors import LaunchError
from tvm_distx.layout.arrays import first_holder

__all__ = ["RankState", "Program", "VMProgram", "FAULT_ENV", "fault", "inject_fault",
           "one_line", "to_numpy"]

#: The test hook: ``"<rank>:<kind>"``, kind ``raise``, ``kill`` or ``hang``.
FAULT_ENV = "TVM_DISTX_FAULT"


class Program(Protocol):
    """What runs a rank's functions, and the form its values take."""

    def function(self, name: str) -> Callable:
        """The rank-local function ``name`` of the program."""

    def tensor(self, array: np.ndarray) -> object:
        """A host array as the program's own value (copied if the program needs it)."""

    def numpy(self, value) -> np.ndarray:
        """A value of the program as a host array."""


class VMProgram:
    """A rank's functions run by TVM's virtual machine over the bundle's library.

    Parameters
    ----------
    vm : tvm.relax.VirtualMachine
        Created once, after the backend's collectives are registered.
    """

    def __init__(self, vm) -> None:
        import tvm

        self.vm, self._empty, self._cpu = vm, tvm.runtime.empty, tvm.cpu()
        self._copy = tvm.get_global_func("runtime.TVMTensorCopyFromBytes")

    def function(self, name: str) -> Callable:
        return self.vm[name]

    def tensor(self, array: np.ndarray) -> object:
        """A TVM tensor holding a copy of ``array``, made with no copy in between.

        (``tvm.runtime.tensor`` copies a ``bfloat16`` array once more through
        ``tobytes``: three copies of a rank's largest weight at once.)
        """
        array = np.ascontiguousarray(array)
        out = self._empty(array.shape, str(array.dtype), self._cpu)
        self._copy(out, array.ctypes.data_as(ctypes.c_void_p), array.nbytes)
        return out

    def numpy(self, value) -> np.ndarray:
        return value.numpy()


class _CallLayout(NamedTuple):
    """What a rank passes and reports for one function at one set of sizes.

    ``function`` is the rank's entry, ``arity`` its parameter count.
    ``stored``: per stored weight, ``(position, spec, fed)`` (fed: given its
    data rather than a placeholder). ``runtime``: per other parameter (an
    input, or a value kept on the ranks), ``(position, spec)``. ``results``:
    per result this rank holds, ``(index, position in the entry's results,
    reported)`` (reported: this rank is the first holder of its block).
    ``weights``: the arguments with the stored weights in place, filled at the
    first call (:meth:`RankState._with_weights`).
    """

    signature: object
    function: Callable
    arity: int
    stored: tuple
    runtime: tuple
    results: tuple
    weights: list


#: Layouts a rank keeps (one per function and set of symbolic sizes).
_LAYOUTS_KEPT = 64


class RankState:
    """What one rank keeps between calls, and how it runs one call.

    Parameters
    ----------
    manifest : tvm_distx.bundle.manifest.Manifest or None
        The bundle the rank serves (None: it runs rank-local functions only,
        ``("entry", ...)`` messages).
    rank : int
        This rank.
    program : Program
        What runs the rank's functions (:class:`VMProgram` over TVM's virtual
        machine, or the board's plan).

    Attributes
    ----------
    loaded : dict of str to tensor
        The stored weights this rank has loaded, each the first time a
        function needs it (read only through
        :meth:`tvm_distx.bundle.manifest.Manifest.read_weight`).
    resident : dict of str to tensor
        The values kept on this rank between calls, by name (``state``/``keep``).
    """

    def __init__(self, manifest, rank: int, program: Program) -> None:
        self.manifest, self.rank, self.program = manifest, rank, program
        self.loaded: dict[str, object] = {}
        self.resident: dict[str, object] = {}
        self._layouts: dict[tuple, _CallLayout | None] = {}

    def handle(self, message: tuple):
        """Run one message of the driver (see the module documentation); returns the reply.

        Returns
        -------
        tuple or object
            For ``"call"``: this rank's result blocks and how many stored
            weights it has loaded; for ``"entry"``: the function's result as
            numpy (a tuple for a tuple; None for a rank that runs nothing).
        """
        kind, *args = message
        if kind == "call":
            return self.call(*args), len(self.loaded)
        return self.run_entry(*args)

    def call(self, function: str, values: dict, sizes: dict, state: dict,
             keep: dict) -> dict[int, np.ndarray]:
        """Run this rank's entry of ``function``; returns the result blocks it reports.

        Parameters
        ----------
        function : str
            The public function.
        values : dict of str to numpy.ndarray
            This rank's shards of the run-time parameters, by name (see
            :meth:`tvm_distx.runtime.base.Session._rank_values`).
        sizes : dict
            The call's symbolic sizes.
        state, keep : dict
            As for :meth:`tvm_distx.runtime.base.Session.run`.

        Returns
        -------
        dict of int to numpy.ndarray
            Per result index not kept, this rank's block when it is the first
            holder of that block (each block is reported by one rank).
        """
        layout = self._layout(function, sizes)
        blocks: dict[int, np.ndarray] = {}
        if layout is None:  # no entry on this rank
            return blocks
        args = list(self._with_weights(layout))  # the stored weights in place, loaded once
        for position, spec in layout.runtime:
            if spec.name in state:  # a value kept on the ranks by an earlier call
                name = state[spec.name]
                if name not in self.resident:  # first use: zeros of this rank's shard
                    self.resident[name] = self.program.tensor(
                        np.zeros(spec.sharding.local_shape(spec.shape), spec.dtype))
                args[position] = self.resident[name]
            else:
                args[position] = self.program.tensor(values.get(spec.name))
        out = layout.function(*args)
        results = list(out) if layout.signature.tuple_result else [out]
        for index, position, reported in layout.results:
            if index in keep:  # stays on this rank, as it is: nothing moves
                self.resident[keep[index]] = results[position]
            elif reported:
                blocks[index] = self.program.numpy(results[position])
        return blocks

    def _with_weights(self, layout: "_CallLayout") -> list:
        """The entry's arguments with its stored weights in place (None elsewhere), made at
        its first call: each weight is loaded the first time a function needs it."""
        if len(layout.weights) < layout.arity:
            args = [None] * layout.arity
            for position, spec, fed in layout.stored:
                if spec.name not in self.loaded:
                    self.loaded[spec.name] = self.program.tensor(
                        self.manifest.read_weight(self.rank, spec.name)
                        if fed  # else TVM's feed: a placeholder
                        else layout.signature.rank_input(spec, None, self.rank))
                args[position] = self.loaded[spec.name]
            layout.weights[:] = args
        return layout.weights

    def _layout(self, function: str, sizes: dict) -> "_CallLayout | None":
        """What this rank passes and reports for ``function`` at ``sizes`` (None: no entry).

        Made once per function and sizes, as it walks every parameter (a decoder
        has hundreds), and asked on every call.
        """
        key = (function, tuple(sorted(sizes.items())))
        if key in self._layouts:
            return self._layouts[key]
        manifest, rank = self.manifest, self.rank
        signature = manifest.function(function)
        if signature.symbolic:
            signature = signature.specialize(sizes)
        entry = manifest.entry(function, rank)
        layout = None
        if entry is not None:
            stored = set(manifest.weights.get(function, ()))
            params = [spec for spec in signature.params if spec.held_by(rank)]
            held = [(index, spec) for index, spec in enumerate(signature.results)
                    if spec.held_by(rank)]
            layout = _CallLayout(
                signature, self.program.function(entry), len(params),
                tuple((i, spec, signature.fed(spec, rank)) for i, spec in enumerate(params)
                      if spec.name in stored),
                tuple((i, spec) for i, spec in enumerate(params) if spec.name not in stored),
                tuple((index, position, first_holder(spec.sharding, spec.shape, rank))
                      for position, (index, spec) in enumerate(held)), [])
        if len(self._layouts) >= _LAYOUTS_KEPT:  # prompts of many lengths: keep the newest
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = layout
        return layout

    def run_entry(self, entry: str | None, args) -> object:
        """Run the rank-local function ``entry`` on ``args`` (numpy); its result as numpy.

        None for a rank that runs nothing (``entry`` None).
        """
        if entry is None:
            return None
        program = self.program
        return to_numpy(program.function(entry)(*[program.tensor(a) for a in args]),
                        program.numpy)


def to_numpy(value, numpy: Callable = lambda v: v.numpy()):
    """A program's result as numpy: an array, a tuple of them (nested), or None."""
    if value is None:
        return None
    if isinstance(value, np.ndarray) or hasattr(value, "numpy"):
        return numpy(value)
    return tuple(to_numpy(v, numpy) for v in value)


def one_line(err: BaseException) -> str:
    """A rank's error in one line: a tvm_distx error's message, else ``Type: first line``."""
    message = getattr(err, "message", None)
    if isinstance(message, str) and message.strip():
        return message.strip().splitlines()[0]
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def fault(rank: int) -> str | None:
    """The kind of fault :data:`FAULT_ENV` asks of ``rank``, if any."""
    where, _, kind = os.environ.get(FAULT_ENV, "").partition(":")
    return kind.strip() if kind and where.strip() == str(rank) else None


def inject_fault(rank: int, kinds: tuple[str, ...], *, process: bool = True) -> None:
    """Fail as :data:`FAULT_ENV` asks of ``rank``, for the kinds a backend honours here.

    ``raise`` raises a :class:`~tvm_distx.errors.LaunchError`; ``kill`` sends
    this process SIGKILL; ``hang`` sleeps (an hour). A rank that is not a
    process of its own (``process=False``: a thread of the driver) may raise,
    but is never killed nor hung.
    """
    kind = fault(rank)
    if kind not in kinds:
        return
    if kind == "raise":
        raise LaunchError(f"injected fault on rank {rank} ({FAULT_ENV})", rank=rank,
                          reason="raised")
    if process and kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if process and kind == "hang":
        time.sleep(3600)
