"""A board's job: every rank of one ``mpiexec`` run, rank 0 driving the others in the job.

On a board there is no driver process beside the ranks (:mod:`tvm_distx.runtime.mpi`
starts ``mpiexec`` from a Python with TVM; a board has none). The launcher
(:mod:`tvm_distx.runtime.board.launch`) starts the board's own ``mpiexec`` on
``python3 -m tvm_distx.runtime.board job ...``, and then:

* every rank checks the bundle (its manifest, the world size, its own weight files,
  the plan) and makes its program from the plan
  (:func:`tvm_distx.runtime.board.rank.plan_program`); the checks of all ranks meet at
  rank 0 before any call, so a bundle that cannot run ends the job with one line
  and no rank waiting;
* rank 0 holds a :class:`JobSession`, a :class:`~tvm_distx.runtime.base.Session`
  whose calls are scattered to the ranks through MPI itself and whose results are
  gathered back; it runs the command (``run``: one call; ``generate``: the greedy
  loop of :class:`~tvm_distx.generation.generator.Generator`, the cache kept on the
  ranks);
* the other ranks serve calls (:func:`serve_calls`) until rank 0 closes.

A failure during a call cannot be met: the failing rank writes one line and aborts
the job. Everything here imports no TVM.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import traceback
from typing import Callable

from tvm_distx.runtime.board.rank import plan_program
from tvm_distx.bundle.manifest import check_weights, read_manifest
from tvm_distx.errors import BundleError, DistxError
from tvm_distx.runtime.base import Call, RankProcess, Session
from tvm_distx.runtime.ranks import RankState, one_line

__all__ = ["JobSession", "serve_calls", "run_job", "MARK"]

logger = logging.getLogger(__name__)

#: How a rank's own lines start on its stderr (the launcher shows these, not MPI's noise).
MARK = "[tvm_distx] "

_CLOSE = ("close",)


class JobSession(Session):
    """Rank 0's session of the job's ranks: calls go out and come back through MPI.

    Parameters
    ----------
    manifest : tvm_distx.bundle.manifest.Manifest
        The bundle.
    comm : mpi4py.MPI.Comm
        The job's world; this process is its rank 0.
    state : RankState
        Rank 0's own rank.
    """

    backend = "board"

    def __init__(self, manifest, comm, state: RankState) -> None:
        super().__init__(manifest, check_here=False)  # every rank checked its own part
        self.comm, self.state = comm, state
        self.ranks = tuple(RankProcess(p) for p in comm.gather(
            (0, os.getpid(), socket.gethostname()), root=0))
        self._closed = False

    def _call(self, call: Call, timeout: float):
        mine = self.comm.scatter(self._messages(call), root=0)
        replies = self.comm.gather(self.state.handle(mine), root=0)
        return ({r: blocks for r, (blocks, _) in enumerate(replies)},
                {r: loaded for r, (_, loaded) in enumerate(replies)})

    def _stop(self, failed: bool) -> None:
        if not failed:
            self.comm.scatter([_CLOSE] * self.comm.Get_size(), root=0)


def serve_calls(comm, state: RankState) -> None:
    """A rank other than 0: run every call rank 0 scatters, until it closes."""
    comm.gather((comm.Get_rank(), os.getpid(), socket.gethostname()), root=0)
    while True:
        message = comm.scatter(None, root=0)
        if message == _CLOSE:
            return
        comm.gather(state.handle(message), root=0)


def _prepare(bundle, comm) -> tuple[RankState | None, str | None]:
    """This rank's state, or the one line that says why it cannot run."""
    rank = comm.Get_rank()
    try:
        manifest = read_manifest(bundle)
        if comm.Get_size() != manifest.num_ranks:
            raise BundleError(f"the bundle needs {manifest.num_ranks} ranks, and this MPI job "
                              f"has {comm.Get_size()}",
                              hint=f"launch it with ./run.sh (it starts {manifest.num_ranks}), "
                              f"or mpiexec -n {manifest.num_ranks}")
        check_weights(manifest, [rank])
        program = plan_program(manifest, comm, lambda f: f)
        return RankState(manifest, rank, program), None
    except DistxError as err:
        return None, _line(rank, err)


def _line(rank: int, err: BaseException) -> str:
    """One line for a rank's error: which rank, where, and what (with its hint)."""
    return f"rank {rank} on {socket.gethostname()}: {_what(err)}"


def _what(err: BaseException) -> str:
    """An error in one line (:func:`~tvm_distx.runtime.ranks.one_line`), with its hint."""
    hint = (err.cli_hint or getattr(err, "hint", None)) if isinstance(err, DistxError) else None
    return one_line(err) + (f" (hint: {hint})" if hint else "")


def run_job(bundle, command: Callable[[JobSession], None]) -> int:
    """Run ``command`` on rank 0's session of this job; every rank calls this.

    Returns the process's exit status: 0 when every rank could run, else 2 (the
    reason written once, by rank 0). A failure during a call aborts the job.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    state, problem = _prepare(bundle, comm)
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        if rank == 0:
            sys.stderr.write(f"{MARK}{problems[0]}\n")
        return 2
    session = None
    try:
        if rank != 0:
            serve_calls(comm, state)
            return 0
        session = JobSession(state.manifest, comm, state)
        command(session)
        session.close()
        return 0
    except DistxError as err:
        if session is not None and not session.closed:  # refused before any rank ran it
            session.close()
            sys.stderr.write(f"{MARK}{_what(err)}\n")
            return 2
        _abort(comm, rank, err)
    except BaseException as err:  # a failure in a call: every rank stops, told once
        _abort(comm, rank, err)
    return 1


def _abort(comm, rank: int, err: BaseException) -> None:
    """Say what failed on this rank in one line, and end every rank of the job."""
    line = _line(rank, err)
    sys.stderr.write(f"{MARK}{line}\n")
    if not isinstance(err, DistxError):
        sys.stderr.write(traceback.format_exc())  # shown with --verbose
    sys.stderr.flush()
    comm.Abort(1)
