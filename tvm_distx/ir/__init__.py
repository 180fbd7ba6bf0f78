"""Helpers over Relax IR shared by the compiler's passes (internal).

- :mod:`~tvm_distx.ir.helpers`: small questions about Relax expressions and types;
- :mod:`~tvm_distx.ir.inline`: calls to private functions written in place, to plan through them;
- :mod:`~tvm_distx.ir.module_pass`: TVM's module-pass decorator, keeping our errors intact;
- :mod:`~tvm_distx.ir.rewriter`: re-emitting a Relax function binding by binding;
- :mod:`~tvm_distx.ir.weight_decode`: what a weight decode is, in Relax and in a fused kernel.
"""
