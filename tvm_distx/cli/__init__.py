"""The ``tvm-distx`` command line.

:mod:`~tvm_distx.cli.main` builds the parser and runs the chosen subcommand; each
subcommand's module adds its own parser and holds its handler, loading only what it
needs when it runs: :mod:`~tvm_distx.cli.sharding` (annotate, propagate),
:mod:`~tvm_distx.cli.explain` (explain, plan), :mod:`~tvm_distx.cli.compile` (compile,
bundle), :mod:`~tvm_distx.cli.autoshard`, :mod:`~tvm_distx.cli.run`,
:mod:`~tvm_distx.cli.generate`, :mod:`~tvm_distx.cli.serve` and
:mod:`~tvm_distx.cli.deploy`. The flags they share are in :mod:`~tvm_distx.cli.arguments`
and :mod:`~tvm_distx.cli.hosts`, the checks of their inputs and outputs in
:mod:`~tvm_distx.cli.inputs`. :mod:`~tvm_distx.cli.demo` is the main job of
``scripts/demo``.
"""
