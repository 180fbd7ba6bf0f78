"""``FunctionRewriter``: re-emit a Relax function binding by binding (internal).

Both :class:`tvm_distx.passes.PropagateSharding` and
:class:`tvm_distx.legalize.LowerDistIR` rewrite whole functions into a shared
``BlockBuilder`` (so that calls between rewritten functions type-check) while
keeping the block structure, the names and which variables leave dataflow
blocks. This base class does that walk; a subclass says what each binding
becomes.
"""

from __future__ import annotations

from contextlib import nullcontext

import tvm
from tvm import relax

from tvm_distx.errors import ArgumentError

__all__ = ["FunctionRewriter"]


class FunctionRewriter:
    """Walk a function's blocks and let :meth:`binding` re-emit each binding.

    Parameters
    ----------
    bb : relax.BlockBuilder
        The builder of the output module.
    name : str
        The name of the function to write (also used in error messages).
    """

    def __init__(self, bb: relax.BlockBuilder, name: str) -> None:
        self.bb = bb
        self.name = name
        self.remap: dict[relax.Var, relax.Expr] = {}
        #: the index of the block being written (dataflow variables live in one block)
        self.block = 0

    def rewrite(self, func: relax.Function,
                params: list[relax.Var] | dict[relax.Var, relax.Var], public: bool, *,
                dataflow: bool = True, pure: bool | None = None) -> tvm.ir.GlobalVar:
        """Write ``func`` with new ``params``; returns the new function's GlobalVar.

        ``params`` replaces ``func``'s parameters one for one, or is a dict from
        the original parameters kept to their replacements (the others are
        dropped). With ``dataflow=False`` every block is written as a plain
        binding block (needed for impure calls); ``pure`` overrides the
        function's purity.
        """
        if isinstance(params, dict):
            self.remap.update(params)
            params = list(params.values())
        else:
            if len(params) != len(func.params):
                raise ArgumentError(f"{len(params)} parameters for the {len(func.params)} of "
                                    f"'{self.name}'", hint="pass a dict to drop some")
            self.remap.update(zip(func.params, params))
        attrs = {k: v for k, v in (func.attrs or {}).items() if k != "global_symbol"}
        with self.bb.function(self.name, params, attrs=attrs or None,
                              pure=func.is_pure if pure is None else pure, private=not public):
            index = 0
            for block_index, block in enumerate(func.body.blocks):
                self.block = block_index
                in_dataflow = dataflow and isinstance(block, relax.DataflowBlock)
                with self.bb.dataflow() if in_dataflow else nullcontext():
                    for binding in block.bindings:
                        self.binding(index, binding, in_dataflow)
                        index += 1
            return self.bb.emit_func_output(self.output(func.body.body))

    def output(self, expr: relax.Expr) -> relax.Expr:
        """The rewritten function's result for the original result ``expr``."""
        return self.use(expr)

    def binding(self, index: int, binding, dataflow: bool) -> None:
        """Re-emit the ``index``-th binding of the function."""
        raise NotImplementedError

    def use(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` with every variable replaced by its rewritten value."""
        if isinstance(expr, relax.Var):
            return self.remap.get(expr, expr)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self.use(f) for f in expr.fields])
        return expr

    def bind(self, var: relax.Var, value: relax.Expr, dataflow: bool,
             name: str | None = None) -> relax.Var:
        """Bind ``value`` under ``var``'s name (or ``name``); a dataflow output stays one."""
        name = var.name if name is None else name
        if dataflow and not isinstance(var, relax.DataflowVar):
            new = self.bb.emit_output(value, name_hint=name)
        else:
            new = self.bb.emit(value, name_hint=name)
        self.remap[var] = new
        return new

    def match_cast(self, var: relax.Var, value: relax.Expr, ty, dataflow: bool) -> None:
        """Re-emit a ``match_cast`` binding to ``ty``."""
        new = self.bb.match_cast(value, ty, name_hint=var.name)
        if dataflow and not isinstance(var, relax.DataflowVar):
            new = self.bb.emit_output(new, name_hint=var.name)
        self.remap[var] = new
