"""Unit tests for tvm_distx.errors: message layout, attributes, class relations."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import tomllib
from pathlib import Path

import pytest

import tvm_distx
from tvm_distx import errors
from tvm_distx.errors import (
    CallGraphError,
    IndivisibleShardError,
    MeshError,
    PlacementRankError,
    PlacementSyntaxError,
    RuleError,
    ShardDimError,
    ShardingConflictError,
    ShardingError,
    UnknownMeshError,
    UnmatchedRuleError,
    UnsupportedProgramError,
    UnsupportedValueError,
)
from tvm_distx.frontend.script import ScriptError

ALL_ERRORS = [getattr(errors, name) for name in errors.__all__]


class TestLayout:
    def test_bare_message_gets_the_rule_tag(self):
        assert str(ShardingError("something is off")) == "[sharding] something is off"

    def test_full_layout(self):
        err = PlacementRankError(
            "the placement has 2 entries",
            function="main",
            var="x",
            placement="S[0]R",
            hint="drop one entry",
        )
        assert str(err) == (
            "[placement-rank] in function 'main', variable 'x', placement \"S[0]R\": "
            "the placement has 2 entries\nhint: drop one entry"
        )

    @pytest.mark.parametrize(
        "kwargs, prefix",
        [
            ({"function": "f"}, "[shard-dim] in function 'f': "),
            ({"var": "v"}, "[shard-dim] variable 'v': "),
            ({"placement": "R"}, '[shard-dim] placement "R": '),
            ({"function": "f", "placement": "R"}, "[shard-dim] in function 'f', placement \"R\": "),
            ({"var": "v", "placement": "S[1]"}, "[shard-dim] variable 'v', placement \"S[1]\": "),
        ],
    )
    def test_partial_locations(self, kwargs, prefix):
        assert str(ShardDimError("msg", **kwargs)) == prefix + "msg"

    def test_hint_is_on_its_own_last_line(self):
        text = str(MeshError("bad mesh", hint="use range(0, 2)"))
        assert text.splitlines() == ["[mesh] bad mesh", "hint: use range(0, 2)"]

    @pytest.mark.parametrize("hint", [None, ""])
    def test_no_hint_line_without_a_hint(self, hint):
        text = str(RuleError("bad rule", hint=hint))
        assert text == "[sharding-rule] bad rule"
        assert "hint" not in text

    def test_attributes_are_kept(self):
        err = IndivisibleShardError(
            "does not divide", function="f", var="v", placement="S[0]", hint="pad"
        )
        assert err.message == "does not divide"
        assert err.function == "f"
        assert err.var == "v"
        assert err.placement == "S[0]"
        assert err.hint == "pad"
        assert err.rule == "shard-divisible"

    def test_location_is_keyword_only(self):
        with pytest.raises(TypeError):
            ShardingError("msg", "main")  # type: ignore[misc]

    def test_unknown_mesh_str_is_not_quoted_like_a_key_error(self):
        err = UnknownMeshError('mesh "mesh[3]" is missing', var="x")
        assert str(err) == "[unknown-mesh] variable 'x': mesh \"mesh[3]\" is missing"
        assert not str(err).startswith("'")


class TestRebuilding:
    """An error rebuilt from its own text (after crossing TVM's FFI) keeps the text."""

    def test_rebuilt_from_formatted_text_is_unchanged(self):
        original = ShardDimError("too far", function="main", var="y", placement="S[3]", hint="h")
        rebuilt = ShardDimError(str(original))
        assert str(rebuilt) == str(original)
        assert str(rebuilt).count("[shard-dim]") == 1

    def test_other_rule_tag_is_not_treated_as_rebuilt(self):
        err = RuleError("[mesh] looks like a mesh error")
        assert str(err) == "[sharding-rule] [mesh] looks like a mesh error"

    @pytest.mark.parametrize(
        "err",
        [
            PlacementRankError("boom", function="f", var="v", placement="R", hint="fix"),
            UnknownMeshError("no such mesh", var="x", hint="declare it"),
            RuleError("bad"),
            ScriptError("cannot read x.py"),
        ],
    )
    def test_pickle_round_trip_keeps_type_and_text(self, err):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err)
        assert str(back) == str(err)


class TestHierarchy:
    @pytest.mark.parametrize("cls", ALL_ERRORS)
    def test_every_error_is_a_distx_error(self, cls):
        assert issubclass(cls, errors.DistxError)
        assert issubclass(cls, Exception)

    @pytest.mark.parametrize("cls", [c for c in ALL_ERRORS if c.rule not in
                                     ("tvm-distx", "bundle", "argument", "symbolic-extent",
                                      "launch", "deploy", "host-memory", "qemu",
                                      "collective-group", "peer-failed", "internal", "board")])
    def test_every_compiler_error_is_a_sharding_error(self, cls):
        assert issubclass(cls, ShardingError)

    @pytest.mark.parametrize("err", [
        errors.BundleError("bad manifest", hint="export again"),
        errors.ArgumentError("bad input"),
        errors.LaunchError("rank 1 failed", rank=1, reason="raised", details="Traceback ..."),
        errors.QemuError("illegal instruction", hint="build for a smaller VLEN"),
        errors.CollectiveGroupError("rank 3 is not in group (0, 1)"),
        errors.PeerFailedError(1),
        errors.PeerFailedError(None),
    ])
    def test_runtime_errors_pickle_with_their_fields(self, err):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert getattr(back, "rank", None) == getattr(err, "rank", None)

    @pytest.mark.parametrize(
        "cls",
        [
            PlacementSyntaxError,
            PlacementRankError,
            ShardDimError,
            IndivisibleShardError,
            MeshError,
            RuleError,
        ],
    )
    def test_value_errors(self, cls):
        assert issubclass(cls, ValueError)
        assert isinstance(cls("x"), ValueError)

    def test_unknown_mesh_is_a_lookup_error(self):
        err = UnknownMeshError("x")
        assert isinstance(err, KeyError)
        assert isinstance(err, LookupError)
        assert not isinstance(err, ValueError)

    @pytest.mark.parametrize("cls, builtin", [
        (errors.ArgumentTypeError, TypeError),
        (errors.ArgumentIndexError, IndexError),
        (errors.ArgumentKeyError, KeyError),
        (errors.InternalError, RuntimeError),
    ])
    def test_errors_that_stand_for_a_builtin_are_caught_as_it(self, cls, builtin):
        with pytest.raises(builtin, match=r"^\[[a-z-]+\] the message\nhint: "):
            raise cls("the message", hint="the hint")

    def test_an_argument_key_error_shows_its_message_not_a_quoted_key(self):
        err = errors.ArgumentKeyError("no value 'y' in function 'main'", hint="look")
        assert str(err) == "[argument] no value 'y' in function 'main'\nhint: look"
        assert isinstance(err, errors.ArgumentError) and isinstance(err, ValueError)

    def test_an_internal_error_asks_for_a_report(self):
        assert "please report it" in str(errors.InternalError("invariant broke"))

    def test_unsupported_value_is_a_type_error(self):
        assert isinstance(UnsupportedValueError("x"), TypeError)

    @pytest.mark.parametrize(
        "cls",
        [ShardingConflictError, UnmatchedRuleError, CallGraphError, UnsupportedProgramError, ScriptError],
    )
    def test_plain_sharding_errors(self, cls):
        assert not issubclass(cls, (ValueError, TypeError, KeyError))

    def test_catching_the_base_catches_placement_errors(self):
        with pytest.raises(ShardingError):
            raise PlacementSyntaxError("bad text")
        with pytest.raises(ValueError):
            raise PlacementSyntaxError("bad text")

    def test_rule_tags(self):
        expected = {
            ShardingError: "sharding",
            PlacementSyntaxError: "placement-syntax",
            PlacementRankError: "placement-rank",
            ShardDimError: "shard-dim",
            IndivisibleShardError: "shard-divisible",
            MeshError: "mesh",
            UnknownMeshError: "unknown-mesh",
            ShardingConflictError: "sharding-conflict",
            RuleError: "sharding-rule",
            UnmatchedRuleError: "rule-unmatched",
            UnsupportedValueError: "unsupported-value",
            CallGraphError: "call-graph",
            UnsupportedProgramError: "unsupported-program",
            ScriptError: "tvmscript",
        }
        for cls, tag in expected.items():
            assert cls.rule == tag, cls
            assert str(cls("m")) == f"[{tag}] m"
        tags = [cls.rule for cls in expected]
        assert len(tags) == len(set(tags))

    def test_package_exports_the_base_error_and_the_module(self):
        """``DistxError`` at the top level; every other class in :mod:`tvm_distx.errors`."""
        assert tvm_distx.DistxError is errors.DistxError and tvm_distx.errors is errors
        for name in errors.__all__:
            if name != "DistxError":
                assert not hasattr(tvm_distx, name), name


ROOT = Path(__file__).resolve().parents[1]


def _package_modules() -> list:
    """Every module of every package ``pyproject.toml`` installs, imported.

    ``tvm_distx.passes`` and ``tvm_distx.legalize`` live outside ``tvm_distx/``
    (see ``package-dir``), so walking ``tvm_distx`` alone would miss them.
    """
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = set()
    for name in config["tool"]["setuptools"]["packages"]:
        names.add(name)
        package = importlib.import_module(name)
        names.update(info.name for info in pkgutil.walk_packages(package.__path__, name + "."))
    return [importlib.import_module(name) for name in sorted(names)]


class TestArchitecture:
    """Every exception class the package defines lives in errors.py and is a DistxError."""

    def test_every_exception_class_of_the_package_is_a_distx_error(self):
        modules = _package_modules()
        names = {m.__name__ for m in modules}
        # the walk reaches the subpackages installed from other directories, and the entry points
        assert {"tvm_distx.__main__", "tvm_distx.runtime.mpi_rank", "tvm_distx.passes.tir_access",
                "tvm_distx.legalize.planner", "tvm_distx.compiler.schedule.matmul"} <= names
        defined = {obj for m in modules for obj in vars(m).values()
                   if inspect.isclass(obj) and issubclass(obj, BaseException)
                   and obj.__module__.startswith("tvm_distx")}
        assert {errors.ScriptError, errors.QemuError, errors.CollectiveGroupError,
                errors.PeerFailedError, errors.LaunchError} <= defined
        for cls in defined:
            assert issubclass(cls, errors.DistxError), cls
            assert cls.__module__ == "tvm_distx.errors", cls

    @pytest.mark.parametrize("module, name, bases", [
        ("tvm_distx.frontend.script", "ScriptError", (ShardingError,)),
        ("tvm_distx.compiler.rvv", "QemuError", (RuntimeError,)),
        ("tvm_distx.runtime.mpi_ccl", "CollectiveGroupError", (RuntimeError,)),
        ("tvm_distx.runtime.disco_shm", "PeerFailedError", (RuntimeError,)),
    ])
    def test_moved_errors_keep_their_old_names_and_bases(self, module, name, bases):
        cls = getattr(importlib.import_module(module), name)
        assert cls is getattr(errors, name)
        assert issubclass(cls, errors.DistxError)
        for base in bases:
            assert issubclass(cls, base)



def test_a_hint_speaks_the_interface_the_user_is_in():
    """Python callers read the Python hint; the CLI prints the flag-level one."""
    err = errors.ArgumentError("'main' takes 1 input, got 2", hint="pass weights in params=",
                               cli_hint="give one -i file per input")
    assert str(err).endswith("hint: pass weights in params=")
    assert err.for_cli() == "[argument] 'main' takes 1 input, got 2\nhint: give one -i file per input"
    plain = errors.BundleError("no manifest", hint="export it again")
    assert plain.for_cli() == str(plain)
    sharding = errors.ShardingError("bad", function="f", hint="annotate it in Python",
                                    cli_hint="add a rule to --rules")
    assert sharding.for_cli().endswith("hint: add a rule to --rules")
