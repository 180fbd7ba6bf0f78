"""The ``tvm_distx`` error hierarchy.

Every error that ``tvm_distx`` raises on bad user input is a :class:`ShardingError`.
An error names the rule that was broken, where it happened (function, variable,
placement) and what to do about it, so that a user never has to read a TVM
``InternalError`` or a C++ backtrace to find the mistake in their annotations.

The message has a fixed layout::

    [placement-rank] in function 'main', variable 'x', placement "S[0]R": the
    placement has 2 entries but mesh "mesh[0]" (shape (2,), devices 0..1) has 1 axis
    hint: give one entry (R or S[k]) per mesh axis, for example "S[0]"
"""

from __future__ import annotations

import threading

__all__ = [
    "DistxError",
    "BundleError",
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentIndexError",
    "ArgumentKeyError",
    "SymbolicExtentError",
    "LaunchError",
    "DeployError",
    "HostMemoryError",
    "CollectiveGroupError",
    "PeerFailedError",
    "ShardingError",
    "CompilerStageError",
    "PlacementSyntaxError",
    "PlacementRankError",
    "ShardDimError",
    "IndivisibleShardError",
    "MeshError",
    "UnknownMeshError",
    "ShardingConflictError",
    "RuleError",
    "UnmatchedRuleError",
    "UnsupportedValueError",
    "CallGraphError",
    "UnsupportedProgramError",
    "ScriptError",
    "MemoryBudgetError",
    "QemuError",
    "InternalError",
    "PlanError",
    "PlanCheckError",
    "CollectiveGroupError",
    "PeerFailedError",
]


_latest = threading.local()


def latest_error() -> "ShardingError | None":
    """The ShardingError most recently built from its fields in this thread.

    When an error crosses TVM's FFI (a Python pass or visitor called from C++),
    only its type and text come back; this finds the original object, with its
    fields, again (see :mod:`tvm_distx.ir.module_pass`).
    """
    return getattr(_latest, "error", None)


class DistxError(Exception):
    """Base class of every error ``tvm_distx`` raises on purpose.

    :class:`ShardingError` covers the compiler's input (annotations, rules,
    programs); the other subclasses cover bundles, run arguments and running
    ranks. Each has a stable ``rule`` tag and its message ends with a hint.
    """

    rule: str = "tvm-distx"
    #: The hint in command-line terms (flags, not Python), when it differs.
    cli_hint: str | None = None
    #: ``(python text, command-line text)`` pairs the command line shows in place of the
    #: first: a sharding rule's ``ShardingRule(param='A', ...)`` as a rules file writes it.
    cli_names: tuple[tuple[str, str], ...] = ()

    def for_cli(self) -> str:
        """The message as the command line shows it: its hint in flags, where there is one."""
        text = str(self)
        hint = getattr(self, "hint", None)
        if self.cli_hint and hint and text.endswith(f"\nhint: {hint}"):
            text = text[: -len(hint)] + self.cli_hint
        for python, cli in self.cli_names:
            text = text.replace(python, cli)
        return text


class ShardingError(DistxError):
    """Base class of every error ``tvm_distx`` raises for bad sharding input.

    Parameters
    ----------
    message : str
        What was seen, as one sentence.
    function : str, optional
        The Relax function in which the problem was found.
    var : str, optional
        The variable (or parameter) that carries the offending sharding.
    placement : str, optional
        The placement involved, in TVM's text form.
    hint : str, optional
        How to fix the input.

    Attributes
    ----------
    rule : str
        A short, stable identifier of the rule that was broken; subclasses set it.
    """

    rule: str = "sharding"

    def __init__(
        self,
        message: str,
        *,
        function: str | None = None,
        var: str | None = None,
        placement: str | None = None,
        hint: str | None = None,
        cli_hint: str | None = None,
    ) -> None:
        self.cli_hint = cli_hint
        if f"[{self.rule}] " == message[: len(self.rule) + 3] and not (function or var or hint):
            # Rebuilt from its own text after crossing TVM's FFI: keep the text as is.
            self._text = message
        else:
            self._text = None
        if self._text is None:
            _latest.error = self  # see latest_raised()
        self.message = message
        self.function = function
        self.var = var
        self.placement = placement
        self.hint = hint
        super().__init__(self._format())

    def _format(self) -> str:
        if self._text is not None:
            return self._text
        where = []
        if self.function is not None:
            where.append(f"in function '{self.function}'")
        if self.var is not None:
            where.append(f"variable '{self.var}'")
        if self.placement is not None:
            where.append(f'placement "{self.placement}"')
        text = f"[{self.rule}] "
        if where:
            text += ", ".join(where) + ": "
        text += self.message
        if self.hint:
            text += f"\nhint: {self.hint}"
        return text


class PlacementSyntaxError(ShardingError, ValueError):
    """A placement string is not in TVM's text form (``"R"``, ``"S[1]"``, ``"S[0]R"``)."""

    rule = "placement-syntax"


class PlacementRankError(ShardingError, ValueError):
    """A placement has a different number of entries than its mesh has axes."""

    rule = "placement-rank"


class ShardDimError(ShardingError, ValueError):
    """A placement shards a tensor dimension that the tensor does not have."""

    rule = "shard-dim"


class IndivisibleShardError(ShardingError, ValueError):
    """A static tensor dimension is not divisible by the mesh axes that shard it."""

    rule = "shard-divisible"


class MeshError(ShardingError, ValueError):
    """A device mesh is malformed (bad shape, bad device range, bad reference)."""

    rule = "mesh"


class UnknownMeshError(ShardingError, KeyError):
    """A mesh reference (``"mesh[3]"``) names no mesh in the module's ``global_infos``."""

    rule = "unknown-mesh"

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return self._format()


class ShardingConflictError(ShardingError):
    """Two different shardings were asked for the same value."""

    rule = "sharding-conflict"


class RuleError(ShardingError, ValueError):
    """A rule is malformed: a :class:`tvm_distx.ShardingRule`, or a rule string of
    :func:`tvm_distx.register_sharding_rule` (at registration, or at a call it does not fit)."""

    rule = "sharding-rule"


class UnmatchedRuleError(ShardingError):
    """A sharding rule matched nothing in the module (raised in strict mode)."""

    rule = "rule-unmatched"


class UnsupportedValueError(ShardingError, TypeError):
    """A sharding was asked for a value that cannot carry one (not a tensor)."""

    rule = "unsupported-value"


class CallGraphError(ShardingError):
    """The call graph cannot be specialised (recursion, a call of an unknown function)."""

    rule = "call-graph"


class UnsupportedProgramError(ShardingError):
    """A construct that sharding propagation does not handle (yet)."""

    rule = "unsupported-program"


class CompilerStageError(UnsupportedProgramError):
    """TVM failed inside one stage of :func:`tvm_distx.compile` on a valid program.

    The message names the stage and TVM's reason; the hint says how to get
    the module of every stage (``dump_dir``) to see or report it.
    """

    rule = "compiler-stage"


class MemoryBudgetError(ShardingError):
    """No sharding plan keeps every rank's weights and activations under its memory budget."""

    rule = "memory-budget"


class ScriptError(ShardingError):
    """A TVMScript file cannot be read as an IRModule (:func:`tvm_distx.load_module`)."""

    rule = "tvmscript"


class _RuntimeErrorBase(DistxError):
    """An error with a message and a hint, outside the compiler (bundles, runs)."""

    def __init__(self, message: str, *, hint: str | None = None,
                 cli_hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        self.cli_hint = cli_hint
        text = f"[{self.rule}] {message}"
        if hint:
            text += f"\nhint: {hint}"
        super().__init__(text)

    def __reduce__(self):
        return _rebuild, (type(self), dict(self.__dict__), self.args)


def _rebuild(cls, state: dict, args: tuple) -> "_RuntimeErrorBase":
    """Unpickle an error with its fields (its constructor takes keywords)."""
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class BundleError(_RuntimeErrorBase, ValueError):
    """A bundle is unusable: its manifest, a weight file or the rank count is wrong.

    Raised before any rank computes.
    """

    rule = "bundle"


class ArgumentError(_RuntimeErrorBase, ValueError):
    """The inputs or options given to compile or run do not fit the program."""

    rule = "argument"


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of a ``tvm_distx`` function has the wrong type.

    Also a :class:`TypeError`, so code that catches the builtin keeps working.
    """


class ArgumentIndexError(ArgumentError, IndexError):
    """An index (an axis, a slice) given to a ``tvm_distx`` object is out of its range.

    Also an :class:`IndexError` (as :class:`numpy.exceptions.AxisError` is).
    """


class ArgumentKeyError(ArgumentError, KeyError):
    """A name looked up in a ``tvm_distx`` object (a value, a function) is not there.

    Also a :class:`KeyError`; its text is the message, not a quoted key.
    """

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return self.args[0] if self.args else ""


class SymbolicExtentError(ArgumentError):
    """A run-time size does not fit a symbolic dimension of the program.

    A symbolic extent split along mesh axes must be divisible by their size, and
    a symbolic variable that appears in several parameters must have one value.
    Raised from the actual inputs, before any rank starts.
    """

    rule = "symbolic-extent"


class ServerBusyError(_RuntimeErrorBase, RuntimeError):
    """The server's queue of requests is full: this one was not taken."""

    rule = "server-busy"


class ApiRequestError(_RuntimeErrorBase, ValueError):
    """A request to the HTTP server, answered with OpenAI's JSON error.

    Attributes
    ----------
    status : int
        The HTTP status (400 bad request, 401 wrong key, 404 unknown model, 500 a rank
        failed, 503 busy).
    param : str or None
        The request field at fault.
    code : str or None
        OpenAI's error code (``"invalid_api_key"``, ``"context_length_exceeded"``...).
    kind : str
        OpenAI's error type (``"invalid_request_error"``, ``"server_error"``).
    """

    rule = "api-request"

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        self.status, self.param, self.code, self.kind = status, param, code, kind
        super().__init__(message)

    def body(self) -> dict:
        """The ``error`` object of the answer."""
        return {"message": self.message, "type": self.kind, "param": self.param,
                "code": self.code}


class LaunchError(_RuntimeErrorBase, RuntimeError):
    """A distributed run failed: a rank raised, was killed, or did not finish in time.

    Attributes
    ----------
    rank : int or None
        The first rank that failed, when known.
    reason : str
        ``"raised"``, ``"killed"``, ``"lost"`` (nothing heard from the rank for
        a while: its host or the network to it is down), ``"timeout"``,
        ``"unreachable"`` (a host did not answer the remote shell), ``"files"``
        (a host lacks a file its ranks need) or ``"exited"``.
    details : str
        The failing rank's traceback or the launcher's last output.
    host : str or None
        The host of that rank (or the host that failed), when known.
    """

    rule = "launch"

    def __init__(self, message: str, *, rank: int | None = None, reason: str = "exited",
                 details: str = "", hint: str | None = None, cli_hint: str | None = None,
                 host: str | None = None) -> None:
        self.rank = rank
        self.reason = reason
        self.details = details
        self.host = host
        super().__init__(message + (f"\n{details.rstrip()}" if details else ""), hint=hint,
                         cli_hint=cli_hint)

    def for_cli(self) -> str:
        """The message and its hint in flags; the details (a rank's traceback, mpiexec's last
        lines) only with ``--verbose``."""
        hint = self.cli_hint or self.hint
        return f"[{self.rule}] {self.message}" + (f"\nhint: {hint}" if hint else "")


class DeployError(LaunchError):
    """A host cannot be reached, or its deployed copy of a bundle is missing, stale or damaged.

    Raised by :mod:`tvm_distx.hosts` (``deploy``, and ``check_deployed`` before a
    launch, so it is a :class:`LaunchError` too). The message is one line naming
    the host and, where there is one, the file.

    Attributes
    ----------
    host : str or None
        The host.
    file : str or None
        The file on that host, when one is to blame.
    """

    rule = "deploy"

    def __init__(self, message: str, *, host: str | None = None, file: str | None = None,
                 reason: str = "exited", hint: str | None = None,
                 cli_hint: str | None = None) -> None:
        self.file = file
        super().__init__(message, reason=reason, hint=hint, cli_hint=cli_hint, host=host)


class HostMemoryError(LaunchError):
    """A host has too little memory for its ranks: refused before any rank starts
    (``reason="memory"``), or a rank the kernel killed there, out of memory
    (``reason="oom"``).

    The message is one line naming the host, what its ranks need and what it has.

    Attributes
    ----------
    host : str
        The host.
    needed : int or None
        The bytes its ranks need (before a launch).
    available : int or None
        The bytes it has (its ``mem=``, memory cgroup limit or available memory).
    """

    rule = "host-memory"

    def __init__(self, message: str, *, host: str, needed: int | None = None,
                 available: int | None = None, rank: int | None = None,
                 reason: str = "memory", details: str = "", hint: str | None = None,
                 cli_hint: str | None = None) -> None:
        self.needed = needed
        self.available = available
        super().__init__(message, rank=rank, reason=reason, details=details, hint=hint,
                         cli_hint=cli_hint, host=host)


class QemuError(_RuntimeErrorBase, RuntimeError):
    """A RISC-V kernel could not be built or run under qemu (:mod:`tvm_distx.compiler.rvv`)."""

    rule = "qemu"


class PlanError(_RuntimeErrorBase, RuntimeError):
    """A rank plan asks for something the board's executor cannot do, or a check of the
    program failed while it ran (:mod:`tvm_distx.runtime.board.executor`)."""

    rule = "board"


class PlanCheckError(PlanError):
    """A check of the program failed in one instruction (the executor adds where)."""


class InternalError(_RuntimeErrorBase, RuntimeError):
    """An invariant of ``tvm_distx`` itself broke: a bug, not a mistake in the input.

    The message says which invariant; please report it with the program that
    triggered it (``compile(..., dump_dir=...)`` writes every stage's module).
    """

    rule = "internal"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or "this is a bug in tvm-distx; please report it "
                         "with the program that triggered it")


class CollectiveGroupError(DistxError, RuntimeError):
    """A rank called a collective or a send/recv that it takes no part in.

    This is a lowering bug (or ranks running different programs): the rank
    would otherwise wait forever for peers that never come.
    """

    rule = "collective-group"


class PeerFailedError(DistxError, RuntimeError):
    """Another rank of the run failed, so this one stopped waiting for it.

    Attributes
    ----------
    rank : int or None
        The rank that failed; None when the controller stopped the run.
    """

    rule = "peer-failed"

    def __init__(self, rank: int | None) -> None:
        super().__init__("the controller stopped the run" if rank is None
                         else f"rank {rank} failed")
        self.rank = rank

    def __reduce__(self):
        return type(self), (self.rank,)
