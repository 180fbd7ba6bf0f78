"""Sharding rules: which values of a module get which sharding.

A :class:`ShardingRule` has exactly one *matcher*, which picks sites in a module,
and says what sharding each site gets:

``callee="mlp"``
    every call of the Relax function ``mlp`` (private functions included);
    ``args`` and ``result`` give the shardings of its arguments and result.
``op="relax.matmul"``
    every call of a Relax operator, with ``args`` and ``result`` as above.
``param="A"``
    a parameter of a function, annotated at the start of that function;
    ``result`` is the parameter's own sharding (a parameter is a site with no
    inputs whose value is the parameter).

``meshes`` is one mesh reference or a list that is cycled over the matched sites
in program order, which is how pipeline stages are written: the first call on
``mesh[0]``, the second on ``mesh[1]``, and so on. ``function`` restricts the rule
to the sites inside one function.

Examples
--------
>>> ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
ShardingRule(callee='mlp', args={0: 'R'}, meshes=['mesh[0]', 'mesh[1]'])
>>> ShardingRule(param="A", result="S[1]", function="mlp")
ShardingRule(param='A', result='S[1]', function='mlp')
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from tvm_distx.errors import MeshError, PlacementSyntaxError, RuleError
from tvm_distx.layout import Placement, PlacementLike, as_placement
from tvm_distx.layout.mesh import MeshReference

if TYPE_CHECKING:
    import tvm

__all__ = ["ShardingRule", "pattern_entries", "rules_for"]


@dataclass(frozen=True)
class ShardingRule:
    """One sharding rule; see the module documentation.

    Parameters
    ----------
    callee : str, optional
        Match calls of the Relax function with this name.
    op : str, optional
        Match calls of the Relax operator with this name, e.g. ``"relax.matmul"``.
    param : str, optional
        Match the function parameter with this name.
    args : mapping of int to placement, optional
        Shardings of call arguments by position (call matchers only).
    result : placement, optional
        Sharding of the call's result, or of the parameter itself.
    function : str, optional
        Only match sites inside this function.
    meshes : str or sequence of str, optional
        One mesh reference (``"mesh[0]"``) or a list cycled over the matched
        sites in program order. When omitted, the module must have exactly one
        mesh, which is used.

    Raises
    ------
    RuleError
        When the rule has no matcher or several, no sharding, arguments on a
        parameter rule, an unknown operator, a bad argument index, a bad
        placement or a bad mesh reference.
    """

    callee: str | None = None
    op: str | None = None
    param: str | None = None
    args: Mapping[int, PlacementLike] = field(default_factory=dict)
    result: PlacementLike | None = None
    function: str | None = None
    meshes: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        matchers = {k: v for k, v in (("callee", self.callee), ("op", self.op),
                                      ("param", self.param)) if v is not None}
        if len(matchers) != 1:
            seen = ", ".join(f"{k}={v!r}" for k, v in matchers.items()) or "none"
            raise RuleError(
                f"a sharding rule needs exactly one matcher (callee, op or param), got {seen}",
                hint="write one rule per matcher, e.g. ShardingRule(callee='mlp', args={0: 'R'})",
                cli_hint='write one rule per matcher, e.g. {"callee": "mlp", "args": {"0": "R"}}',
            )
        kind, target = next(iter(matchers.items()))
        if not isinstance(target, str) or not target:
            raise RuleError(f"{kind}= must be a non-empty name, got {target!r}")
        if kind == "op":
            _check_op_exists(target)

        if not isinstance(self.args, Mapping):
            raise RuleError(
                f"args must map argument positions to placements, got {self.args!r}",
                hint="write args={0: 'S[0]'}",
                cli_hint='write "args": {"0": "S[0]"}',
            )
        if kind == "param" and self.args:
            raise RuleError(
                f"param rule for {target!r} has args; a parameter has no arguments",
                hint=f"give the parameter's sharding as result=, e.g. "
                f"ShardingRule(param={target!r}, result='S[0]')",
                cli_hint=f'give the parameter\'s sharding as "result", e.g. '
                f'{{"param": "{target}", "result": "S[0]"}}',
            )
        if not self.args and self.result is None:
            raise RuleError(
                f"the rule for {kind}={target!r} gives no sharding",
                hint="add args={index: placement} and/or result=placement",
                cli_hint='add "args": {"<index>": "<placement>"} and/or "result": "<placement>"',
            )
        args: dict[int, Placement] = {}
        for index, placement in self.args.items():
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise RuleError(
                    f"argument positions must be non-negative ints, got {index!r} in the rule "
                    f"for {kind}={target!r}",
                    hint="args={0: 'R'} annotates the first argument",
                    cli_hint='"args": {"0": "R"} annotates the first argument',
                )
            args[index] = self._placement(placement, f"args[{index}]", kind, target)
        object.__setattr__(self, "args", dict(sorted(args.items())))
        if self.result is not None:
            object.__setattr__(
                self, "result", self._placement(self.result, "result", kind, target)
            )

        meshes = self.meshes
        if meshes is None:
            refs: tuple[MeshReference, ...] = ()
        else:
            if isinstance(meshes, (str, MeshReference)):
                meshes = [meshes]
            if not isinstance(meshes, (list, tuple)):
                raise RuleError(
                    f"meshes= in the rule for {kind}={target!r} must be a mesh reference or a "
                    f"list of them, got {meshes!r}",
                    hint='write meshes="mesh[0]" or meshes=["mesh[0]", "mesh[1]"]',
                    cli_hint='write "meshes": "mesh[0]" or "meshes": ["mesh[0]", "mesh[1]"]',
                )
            try:
                refs = tuple(MeshReference.parse(m) for m in meshes)
            except MeshError as err:
                raise RuleError(
                    f"bad meshes= in the rule for {kind}={target!r}: {err.message}",
                    hint=err.hint,
                ) from None
            if not refs:
                raise RuleError(
                    f"meshes= is an empty list in the rule for {kind}={target!r}",
                    hint="give at least one mesh, or leave meshes out to use the module's only mesh",
                )
        object.__setattr__(self, "meshes", refs)

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _placement(value: PlacementLike, what: str, kind: str, target: str) -> Placement:
        try:
            return as_placement(value)
        except PlacementSyntaxError as err:
            raise RuleError(
                f"bad {what} in the rule for {kind}={target!r}: {err.message}",
                placement=str(value),
                hint=err.hint,
            ) from None

    @property
    def kind(self) -> str:
        """Which matcher the rule uses: ``"callee"``, ``"op"`` or ``"param"``."""
        if self.callee is not None:
            return "callee"
        return "op" if self.op is not None else "param"

    @property
    def target(self) -> str:
        """The name the matcher looks for."""
        return self.callee or self.op or self.param  # type: ignore[return-value]

    def mesh_for_site(self, site_index: int) -> MeshReference | None:
        """The mesh of the ``site_index``-th matched site (None: the module's only mesh)."""
        if not self.meshes:
            return None
        return self.meshes[site_index % len(self.meshes)]

    def as_json(self) -> str:
        """The rule as a rules file writes it: ``{"param": "A", "result": "S[1]"}``."""
        fields: dict = {self.kind: self.target}
        if self.args:
            fields["args"] = {str(i): str(p) for i, p in self.args.items()}
        if self.result is not None:
            fields["result"] = str(self.result)
        if self.function is not None:
            fields["function"] = self.function
        if self.meshes:
            fields["meshes"] = [str(m) for m in self.meshes]
        return json.dumps(fields)

    def __repr__(self) -> str:
        parts = [f"{self.kind}={self.target!r}"]
        if self.args:
            shown = ", ".join(f"{i}: '{p}'" for i, p in self.args.items())
            parts.append(f"args={{{shown}}}")
        if self.result is not None:
            parts.append(f"result='{self.result}'")
        if self.function is not None:
            parts.append(f"function={self.function!r}")
        if self.meshes:
            parts.append(f"meshes={[str(m) for m in self.meshes]!r}")
        return f"ShardingRule({', '.join(parts)})"


def _check_op_exists(name: str) -> None:
    import tvm

    try:
        tvm.ir.Op.get(name)
    except Exception:  # TVM raises its own error type for unknown ops
        registered = [str(n) for n in tvm.ir.Op.list_op_names()]
        close = difflib.get_close_matches(name, registered, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else (
            "Relax operators are named like 'relax.matmul' or 'relax.nn.relu'"
        )
        raise RuleError(f"op={name!r} is not a registered operator", hint=hint) from None


def pattern_entries(patterns: dict[str, str],
                    mesh: str | None = None) -> tuple[tuple[str, str, str | None], ...]:
    """``{glob: placement}`` as the ``(glob, placement, mesh)`` entries presets keep."""
    return tuple((glob, placement, mesh) for glob, placement in patterns.items())


def rules_for(chosen: dict[str, tuple[str, str | None]], function: str) -> list[ShardingRule]:
    """One rule per parameter of ``chosen`` (name -> (placement, mesh or None))."""
    return [ShardingRule(param=name, result=placement, function=function,
                         **({"meshes": mesh} if mesh else {}))
            for name, (placement, mesh) in chosen.items()]
