"""From a sharded Relax module to rank programs that run.

- :mod:`~tvm_distx.compiler.pipeline`: ``lower_to_ranks`` (propagate, then lower to the rank programs) and ``compile``;
- :mod:`~tvm_distx.compiler.executable`: :class:`DistExecutable`, its runs, sessions and bundles;
- :mod:`~tvm_distx.compiler.schedule`: the CPU kernel schedules;
- :mod:`~tvm_distx.compiler.targets` and :mod:`~tvm_distx.compiler.rvv`: x86 and RISC-V targets.
"""
