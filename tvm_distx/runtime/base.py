"""What every session shares, whatever runs its ranks: the driver's half.

A session (:class:`~tvm_distx.runtime.mpi.MPISession`,
:class:`~tvm_distx.runtime.disco.DiscoSession`,
:class:`~tvm_distx.runtime.emulated.EmulatedSession`) serves a bundle's
functions on ranks that start once and load their stored weights once. A
one-shot run (:meth:`tvm_distx.DistExecutable.run`,
:func:`tvm_distx.runtime.backends.launch`) is a session opened, called once and
closed. This module holds the part that does not depend on how the ranks run:

* :class:`Session` checks the bundle before anything starts, checks every call
  (its inputs, its ``state`` and ``keep``) before any rank sees it, cuts the
  call's inputs into each rank's shards (:meth:`Session._rank_values`), puts
  the ranks' result blocks together (:meth:`Session._assemble`), counts the
  calls and the weights loaded, and closes the session on any failure, Ctrl-C
  included; a closed session refuses calls and closing twice does nothing.
  A backend implements :meth:`Session._call` (send a checked call, wait for its
  reply) and :meth:`Session._stop` (stop the ranks, free what they used).
* :func:`bind_inputs` checks a call's run-time inputs against a bundle's function.
* :class:`RankProcess` names a rank's process.

The rank's half (run one call on a rank's shards, keep its weights and its
resident values) is :class:`tvm_distx.runtime.ranks.RankState`. Which
backends exist, and opening a session by a backend's name, is
:mod:`tvm_distx.runtime.backends`; this module imports no backend.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Collection, Mapping, Sequence

import numpy as np

from tvm_distx.bundle.manifest import Manifest, check_library, check_weights, read_manifest
from tvm_distx.bundle.signature import WORKER0, FunctionSignature
from tvm_distx.errors import ArgumentError
from tvm_distx.layout.arrays import assemble_array

__all__ = ["Session", "RankProcess", "Call", "bind_inputs", "check_state"]

logger = logging.getLogger(__name__)


class RankProcess(tuple):
    """``(rank, pid, host)`` of one rank of a session."""

    __slots__ = ()

    @property
    def rank(self) -> int:
        """The rank."""
        return self[0]

    @property
    def pid(self) -> int:
        """Its process id (this process's for ranks that are threads)."""
        return self[1]

    @property
    def host(self) -> str:
        """The host it runs on."""
        return self[2]


class Call(tuple):
    """One checked call, as the driver holds it.

    ``(function, values, sizes, state, keep, signature)``: the public function,
    the global values of its run-time parameters by name (not those taken from
    ``state``), its symbolic sizes, ``state`` (parameter -> resident name),
    ``keep`` (result index -> resident name) and the function's signature at
    those sizes (made once, when the call is checked).
    """

    __slots__ = ()

    @property
    def function(self) -> str:
        return self[0]

    @property
    def values(self) -> dict:
        return self[1]

    @property
    def sizes(self) -> dict:
        return self[2]

    @property
    def state(self) -> dict:
        return self[3]

    @property
    def keep(self) -> dict:
        return self[4]

    @property
    def signature(self) -> FunctionSignature:
        return self[5]


def bind_inputs(manifest: Manifest, function: str, inputs: Sequence, params: Mapping | None,
                from_state: Collection[str] = ()):
    """Check a call's run-time inputs against a bundle's function, before any rank runs.

    ``from_state`` names the parameters the ranks take from values they keep
    (``state=``): like stored weights, they are neither inputs nor free.

    Returns
    -------
    tuple
        ``(signature, free, values, sizes)``: the function's signature and the
        one of the parameters passed at run time (not stored weights), both
        specialized to the call's symbolic sizes; the global values of the free
        parameters, in order; and those sizes.

    Raises
    ------
    ArgumentError
        For inputs that do not fit, or weights given again that the bundle stores.
    """
    signature = manifest.function(function)
    stored = set(manifest.weights.get(function, ()))
    # a fused weight given whole is cut into the segments the program takes
    derivations = manifest.derivations.get(signature.name)
    runtime_params = derivations.bind(params, stored) if derivations else dict(params or {})
    for name in stored & {m.name for m in (derivations.made if derivations else ())}:
        runtime_params.pop(name, None)  # made from the layout: the bundle holds the same values
    overlap = sorted(stored & set(runtime_params))
    if overlap:
        what = f"{overlap[0]} is a weight" if len(overlap) == 1 else \
            f"{', '.join(overlap)} are weights"
        raise ArgumentError(f"{what} stored in the bundle", hint="do not pass them again",
                            cli_hint=f"drop -i {overlap[0]}=...: the bundle gives "
                            f"{'it' if len(overlap) == 1 else 'them'}")
    # bind the run-time inputs against the parameters that are not stored weights
    free = signature.without(frozenset(stored.union(from_state)))
    _check_input_count(function, free, list(inputs), runtime_params, sorted(stored))
    values = free.bind(list(inputs), runtime_params)
    sizes = free.sizes(values)  # symbolic extents: checked here, before any rank starts
    for spec in (p for p in signature.params if p.name in from_state):
        unsized = [d for d in spec.shape if isinstance(d, str) and d not in sizes]
        if unsized:
            raise ArgumentError(f"'{function}' takes '{spec.name}' from state, but its extent "
                                f"{unsized[0]} is not set by any input of the call",
                                hint="pass an input whose shape sets it, or keep a value of "
                                "static shape")
    signature = signature.specialize(sizes) if signature.symbolic else signature
    free = free.specialize(sizes) if free.symbolic else free
    return signature, free, values, sizes


def _check_input_count(function: str, free, inputs: list, params: Mapping,
                       stored: list[str]) -> None:
    """Refuse a call with too few or too many positional inputs, saying where the weights are.

    A bundle compiled with its weights gives them itself; one compiled without
    takes every parameter as an input.
    """
    known = {p.name for p in free.params}
    if not set(params) <= known:
        return  # an unknown name: binding names it, which says more than a count
    positional = [p.name for p in free.params if p.name not in params]
    if len(inputs) == len(positional):
        return
    names = ", ".join(positional) or "none"
    files = " ".join(f"-i {n}.npy" for n in positional)
    if stored:
        raise ArgumentError(
            f"'{function}' takes {len(positional)} positional input(s) ({names}), got "
            f"{len(inputs)}; the bundle holds the weights {', '.join(stored)}",
            hint="pass the other inputs in order, or by name in params=",
            cli_hint=f"give one -i file per input, in parameter order ({files}), or "
            "-i NAME=PATH; the bundle gives the weights")
    raise ArgumentError(
        f"'{function}' takes {len(positional)} positional input(s) ({names}), got "
        f"{len(inputs)}; the bundle holds no weights, so each parameter is an input",
        hint="pass every parameter: in order, or by name in params=",
        cli_hint=f"give one -i file for each of {names}, in that order ({files}), or compile "
        "the bundle with --weights W.npz to store the weights in it")


class Session:
    """A bundle's ranks, started once and called many times (the backend-neutral part).

    Parameters
    ----------
    bundle : path or tvm_distx.bundle.manifest.Manifest
        A directory written by :meth:`tvm_distx.DistExecutable.export`, or its
        manifest already read.
    num_ranks : int, optional
        Must equal the bundle's rank count when given.
    timeout : float
        Seconds the ranks may take to start, and each call by default.
    check_here : bool
        Check the library and every rank's weights here, before anything
        starts (a session whose ranks run on other hosts checks there instead).

    Attributes
    ----------
    manifest : tvm_distx.bundle.manifest.Manifest
        The bundle's manifest.
    ranks : tuple of RankProcess
        The ranks, once started.
    calls : int
        Calls that returned.
    weights_loaded : dict of int to int
        Per rank, how many stored weights it has loaded so far (each once).

    Raises
    ------
    ArgumentError
        For a bad ``timeout`` or ``num_ranks``.
    BundleError
        For a bundle that cannot run here (before anything starts).
    """

    #: the backend's name, in messages (and its name in :mod:`tvm_distx.runtime.backends`)
    backend = "session"

    def __init__(self, bundle: str | os.PathLike | Manifest, *, num_ranks: int | None = None,
                 timeout: float = 300.0, check_here: bool = True) -> None:
        self._closed = True  # until the ranks run: __del__ has nothing to stop
        if not timeout > 0:
            raise ArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}",
                                hint="for example timeout=300")
        self.manifest: Manifest = bundle if isinstance(bundle, Manifest) else read_manifest(bundle)
        if num_ranks is not None and num_ranks != self.manifest.num_ranks:
            raise ArgumentError(f"the bundle at {self.manifest.root} needs "
                                f"{self.manifest.num_ranks} ranks, not {num_ranks}",
                                hint=f"open the session with {self.manifest.num_ranks} ranks")
        self._check_bundle(self.manifest)
        if check_here:
            check_library(self.manifest)
            check_weights(self.manifest)
        self.timeout = timeout
        self.ranks: tuple[RankProcess, ...] = ()
        self.calls = 0
        self.weights_loaded: dict[int, int] = {}
        self._owned: list[Path] = []  # directories removed on close (a bundle made for it)
        self._kept: dict[str, tuple[int, ...]] = {}  # the global shape of each value kept

    def _check_bundle(self, manifest: Manifest) -> None:
        """Refuse a bundle this backend cannot run, before anything starts (all run any)."""

    # -- calls
    def run(self, *inputs, params: Mapping | None = None, function: str = "main",
            timeout: float | None = None, state: Mapping[str, str] | None = None,
            keep: Mapping[int, str] | None = None):
        """Run ``function`` on the session's ranks; returns its global results.

        Parameters
        ----------
        *inputs : array
            The global values of the parameters that are not weights stored in
            the bundle (nor in ``params``, nor taken from ``state``), in order.
        params : mapping of str to array, optional
            Global values by name, for parameters not stored in the bundle.
        function : str
            A public function of the bundle.
        timeout : float, optional
            Seconds this call may take (the session's timeout by default).
        state : mapping of str to str, optional
            Parameters taken from values the ranks keep between calls:
            parameter name -> resident name. A name not kept yet starts as
            zeros. These parameters are not among ``inputs``.
        keep : mapping of int to str, optional
            Results kept on the ranks instead of returned: result index ->
            resident name (a later call's ``state``). Each rank keeps its own
            shard; nothing moves.

        Returns
        -------
        numpy.ndarray or tuple of numpy.ndarray
            The results not kept, in order (a tuple for a tuple-returning
            function).

        Raises
        ------
        ArgumentError
            For inputs that do not fit the function (the session stays usable),
            or a closed session.
        LaunchError
            If a rank fails or the call times out (the session is then closed).
        """
        if self._closed:
            raise ArgumentError("the session is closed",
                                hint="open a new one: with exe.session(...) as session: ...")
        call = self._check(inputs, params, function, state, keep)
        started = time.monotonic()
        try:
            blocks, loaded = self._call(call, timeout or self.timeout)
        except BaseException:  # a failed rank, a timeout, Ctrl-C: the session is over
            self._shut(failed=True)
            raise
        self.calls += 1
        self.weights_loaded = dict(loaded)
        self._remember_kept(call)
        logger.debug("%s: '%s' took %.2f ms", self.backend, function,
                     1e3 * (time.monotonic() - started))
        return self._assemble(call, blocks)

    def _check(self, inputs, params, function: str, state, keep) -> Call:
        """The call, checked against the function before any rank sees it."""
        state = {str(k): str(v) for k, v in (state or {}).items()}
        keep = {int(k): str(v) for k, v in (keep or {}).items()}
        signature = self.manifest.function(function)
        check_state(signature, state, keep)
        concrete, free, values, sizes = bind_inputs(self.manifest, function, inputs, params,
                                                    from_state=state)
        for spec in (p for p in concrete.params if p.name in state):
            kept = self._kept.get(state[spec.name])
            if kept is not None and kept != tuple(spec.shape):
                raise ArgumentError(
                    f"'{function}' takes '{spec.name}' of shape {tuple(spec.shape)} in this "
                    f"call, but the ranks keep '{state[spec.name]}' of shape {kept}",
                    hint="give inputs of the sizes the kept value was made with, or keep the "
                    "value under another name")
        return Call((function, {spec.name: value for spec, value in zip(free.params, values)},
                     sizes, state, keep, concrete))

    def _remember_kept(self, call: Call) -> None:
        """The global shapes of the values the ranks keep after ``call`` (taken, or kept)."""
        fresh = {p: name for p, name in call.state.items() if name not in self._kept}
        if not fresh and not call.keep:
            return
        signature = call.signature
        for spec in (p for p in signature.params if p.name in fresh):  # made as zeros
            self._kept.setdefault(fresh[spec.name], tuple(spec.shape))
        for index, name in call.keep.items():
            self._kept[name] = tuple(signature.results[index].shape)

    def _rank_values(self, call: Call) -> list[dict]:
        """Per rank, what it takes of the call's run-time inputs: its shards, by name.

        Under TVM's feed (a function lowered by TVM's ``LowerDistIR``) rank 0
        gets the global values and the other ranks placeholders (see
        :mod:`tvm_distx.bundle.signature`).
        """
        signature = call.signature
        values = call.values
        given = [spec for spec in signature.params if spec.name in values]
        return [{spec.name: signature.rank_input(spec, values[spec.name], rank)
                 for spec in given if spec.held_by(rank)}
                for rank in range(self.manifest.num_ranks)]

    def _messages(self, call: Call) -> list[tuple]:
        """Per rank, its message (:meth:`tvm_distx.runtime.ranks.RankState.handle`) for ``call``."""
        return [("call", call.function, values, call.sizes, call.state, call.keep)
                for values in self._rank_values(call)]

    def _assemble(self, call: Call, blocks: Mapping[int, Mapping[int, np.ndarray]]):
        """The global results of a call from every rank's blocks.

        ``blocks`` are per rank those of :meth:`tvm_distx.runtime.ranks.RankState.call`.

        Returns the results not kept, in order: a tuple for a tuple-returning
        function, else the one array.
        """
        signature = call.signature
        outputs = []
        for index, spec in enumerate(signature.results):
            if index in call.keep:
                continue
            shards = {r: b[index] for r, b in blocks.items() if index in b}
            outputs.append(assemble_array(shards, spec.sharding, spec.shape))
        return tuple(outputs) if signature.tuple_result else outputs[0]

    # -- what a backend implements
    def _call(self, call: Call, timeout: float) -> tuple[dict, Mapping[int, int]]:
        """Run one checked call; returns every rank's result blocks and weights loaded.

        The blocks are per rank those of :meth:`tvm_distx.runtime.ranks.RankState.call`.
        Raises LaunchError naming the rank when one fails or the call times out.
        """
        raise NotImplementedError

    def _stop(self, failed: bool) -> None:
        """Stop the ranks and free what they used (called once)."""
        raise NotImplementedError

    # -- life cycle
    def close(self) -> None:
        """Stop the ranks and clean up; a second call does nothing."""
        if not self._closed:
            self._shut(failed=False)

    def _shut(self, failed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._stop(failed)
        finally:
            for path in self._owned:
                shutil.rmtree(path, ignore_errors=True)

    @property
    def closed(self) -> bool:
        """Whether the session has ended (closed, or ended by a failure)."""
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a session dropped without close() leaves nothing running
        if not getattr(self, "_closed", True):
            self._shut(failed=True)


def check_state(signature, state: dict, keep: dict) -> None:
    """Refuse state that names no parameter, or keeps a result that does not exist.

    Raises
    ------
    ArgumentError
        Naming the function and the parameter or result index.
    """
    if (state or keep) and signature.feed == WORKER0:
        raise ArgumentError(f"'{signature.name}' was lowered by TVM's LowerDistIR: rank 0 takes "
                            "its inputs whole, so no shard kept on the ranks can feed it",
                            hint="call it without state= and keep=, or lower it with "
                            "tvm_distx.legalize.LowerDistIR")
    names = {p.name for p in signature.params}
    unknown = sorted(set(state) - names)
    if unknown:
        raise ArgumentError(f"'{signature.name}' has no parameter named "
                            f"{', '.join(unknown)} (in state=)",
                            hint=f"its parameters are {', '.join(sorted(names))}")
    count = len(signature.results)
    bad = sorted(i for i in keep if not 0 <= i < count)
    if bad:
        raise ArgumentError(f"'{signature.name}' has {count} result(s); keep= names {bad}",
                            hint=f"keep result indices from 0 to {count - 1}")
    if keep and count == len(keep):
        raise ArgumentError(f"keep= keeps every result of '{signature.name}' on the ranks",
                            hint="return at least one result (the logits, say)")
