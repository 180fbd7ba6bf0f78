"""The one list of backends, and running a bundle on one of them by its name.

:data:`BACKENDS` maps each backend's name to its session class and the keyword
options that class takes. Everything that picks a backend by name uses it:
:meth:`tvm_distx.DistExecutable.run` and :meth:`~tvm_distx.DistExecutable.session`,
:func:`open_session`, :func:`launch` (bundles, ``run.sh`` and ``tvm-distx run``), the
command line's ``--backend`` choices and :class:`tvm_distx.llm.causal_lm.CausalLM`.

Adding a backend means one module with a :class:`~tvm_distx.runtime.base.Session`
subclass (see :mod:`tvm_distx.runtime.emulated`, the smallest) and one entry here,
which imports it. The MPI and board backends are imported with this module; the
disco and emulated backends import TVM (seconds), so their entries import them when
a session of them is opened. Either way the import is written out, so the layer
contracts see every backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from tvm_distx.bundle.manifest import Manifest, read_manifest
from tvm_distx.errors import ArgumentError, BundleError
from tvm_distx.runtime.base import Session, bind_inputs
from tvm_distx.runtime.board.session import BoardSession
from tvm_distx.runtime.mpi import MPISession

__all__ = ["Backend", "BACKENDS", "NAMES", "check_backend", "open_session", "launch"]


@dataclass(frozen=True)
class Backend:
    """One backend: its name, how to get its session class, and the options it takes."""

    name: str
    load: Callable[[], type[Session]]
    options: tuple[str, ...] = ()
    summary: str = ""

    def session_class(self) -> type[Session]:
        """The :class:`~tvm_distx.runtime.base.Session` subclass (imported now if it waited)."""
        return self.load()


def _disco() -> type[Session]:
    from tvm_distx.runtime.disco import DiscoSession  # imports TVM: loaded when a session opens
    return DiscoSession


def _emulated() -> type[Session]:
    from tvm_distx.runtime.emulated import EmulatedSession  # imports TVM, as disco does
    return EmulatedSession


#: The options of a backend whose ranks are processes started by a launcher, on hosts.
_PROCESS_OPTIONS = ("hosts", "hostfile", "rsh", "dest", "shared_fs", "mpiexec", "env")

#: Every backend, by name: the first is the default.
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("mpi", lambda: MPISession, _PROCESS_OPTIONS,
            "one process per rank under mpiexec, on this host or several"),
    Backend("disco", _disco, (),
            "TVM disco worker processes on this host, collectives over shared memory"),
    Backend("emulate", _emulated, (),
            "every rank a thread of this process, collectives over numpy"),
    Backend("board", lambda: BoardSession, _PROCESS_OPTIONS,
            "MPI processes running the bundle's plan with numpy, no TVM (as a RISC-V board)"),
)}

#: The backends' names, in order (the command line's ``--backend`` choices).
NAMES: tuple[str, ...] = tuple(BACKENDS)


def check_backend(backend: str, options: Mapping) -> Backend:
    """The backend named ``backend``, refusing an unknown one or options it does not take.

    Raises
    ------
    ArgumentError
        Naming the backend or the options (before any work).
    """
    if backend not in BACKENDS:
        raise ArgumentError(f"unknown backend {backend!r}",
                            hint=f"use one of {', '.join(NAMES)}",
                            cli_hint="--backend " + " | --backend ".join(NAMES))
    found = BACKENDS[backend]
    extra = sorted(set(options) - set(found.options))
    if extra:
        takes = (f"it takes {', '.join(found.options)}" if found.options
                 else "it takes none")
        owners = [b.name for b in BACKENDS.values() if set(extra) <= set(b.options)]
        hint = f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} for backend=" \
            f"\"{owners[0]}\"" if owners else takes
        raise ArgumentError(f"a {backend} session takes no option {', '.join(extra)}",
                            hint=hint)
    return found


def open_session(bundle, *, backend: str = "mpi", num_ranks: int | None = None,
                 timeout: float = 300.0, **options) -> Session:
    """Start a session of a bundle on ``backend``.

    Parameters
    ----------
    bundle : path or tvm_distx.bundle.manifest.Manifest
        A directory written by :meth:`tvm_distx.DistExecutable.export`.
    backend : str
        A name of :data:`BACKENDS`: ``"mpi"``
        (:class:`~tvm_distx.runtime.mpi.MPISession`), ``"disco"``
        (:class:`~tvm_distx.runtime.disco.DiscoSession`) or ``"emulate"``
        (:class:`~tvm_distx.runtime.emulated.EmulatedSession`).
    num_ranks : int, optional
        Must equal the bundle's rank count when given.
    timeout : float
        Seconds for the ranks to start, and for each call by default.
    **options
        The backend's options (for ``"mpi"``: the options of
        :class:`~tvm_distx.runtime.mpi.MPISession`: ``hostfile`` or
        ``hosts``, ``rsh``, ``dest``, ``shared_fs``, ``mpiexec``, ``env``).

    Returns
    -------
    tvm_distx.runtime.base.Session

    Raises
    ------
    ArgumentError
        For an unknown backend, or options it does not take.
    """
    kind = check_backend(backend, options).session_class()
    return kind(bundle, num_ranks=num_ranks, timeout=timeout, **options)


def launch(bundle: str | os.PathLike | Manifest, inputs: Sequence = (), *, params: Mapping | None = None,
           num_ranks: int | None = None, function: str = "main", timeout: float = 300.0,
           backend: str = "mpi", **options) -> np.ndarray | tuple:
    """Run a bundle's function once and return its global results: a session called once.

    Everything is checked before any rank starts: the backend and its options,
    the rank count, the inputs, then the library and every weight file (see
    :func:`tvm_distx.bundle.manifest.check_weights`).

    Parameters
    ----------
    bundle : path or tvm_distx.bundle.manifest.Manifest
        A directory written by :meth:`tvm_distx.DistExecutable.export`, or its manifest
        already read.
    inputs : sequence of array
        The global values of the function's parameters that are not weights
        stored in the bundle (nor given in ``params``), in order.
    params : mapping of str to array, optional
        Global values by parameter name (for weights not in the bundle).
    num_ranks : int, optional
        The ``-n`` to launch with; it must equal the manifest's.
    function : str
        The public function to run.
    timeout : float
        Seconds for the ranks to start, and again for the call.
    backend : str
        A name of :data:`BACKENDS`.
    **options
        The backend's options (for ``"mpi"``: the options of
        :class:`~tvm_distx.runtime.mpi.MPISession`: ``hostfile`` or
        ``hosts``, ``rsh``, ``dest``, ``shared_fs``, ``mpiexec``, ``env``).

    Returns
    -------
    numpy.ndarray or tuple of numpy.ndarray
        The global result (a tuple for a tuple-returning function).

    Raises
    ------
    BundleError
        For a bad manifest or weight file, or a rank count that differs from
        the bundle's; nothing is launched then.
    ArgumentError
        For an unknown backend or option, inputs that do not fit the function,
        or a timeout that is not positive.
    LaunchError
        If a rank fails or the run times out.
    """
    check_backend(backend, options)
    manifest = bundle if isinstance(bundle, Manifest) else read_manifest(bundle)
    if num_ranks is not None and num_ranks != manifest.num_ranks:
        raise BundleError(f"the bundle at {manifest.root} needs {manifest.num_ranks} ranks, "
                          f"not {num_ranks}", hint=f"launch it with -n {manifest.num_ranks}")
    bind_inputs(manifest, function, list(inputs), params)  # refused before any rank starts
    with open_session(manifest, backend=backend, timeout=timeout, **options) as session:
        return session.run(*inputs, params=params, function=function)
