"""The ``tvm-distx`` command line.

:mod:`~tvm_distx.cli.main` parses the arguments and dispatches each subcommand,
loading only what that subcommand needs; the larger subcommands have modules of
their own (:mod:`~tvm_distx.cli.autoshard`, :mod:`~tvm_distx.cli.generate`), and
:mod:`~tvm_distx.cli.inputs` holds what they share. :mod:`~tvm_distx.cli.demo` is
the main job of ``scripts/demo``.
"""
