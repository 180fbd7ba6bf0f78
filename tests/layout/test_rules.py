"""Unit tests for tvm_distx.layout.rules.ShardingRule: validation, normalisation, repr, cycling."""

from __future__ import annotations

import copy
import dataclasses
import doctest

import pytest

import tvm_distx.layout.rules as rules_module
from tvm_distx import Placement, Replicate, Shard, ShardingRule
from tvm_distx.errors import RuleError, ShardingError
from tvm_distx.layout.mesh import MeshReference


# ---------------------------------------------------------------------------- matchers


class TestMatchers:
    @pytest.mark.parametrize(
        "kwargs, kind, target",
        [
            ({"callee": "mlp", "args": {0: "R"}}, "callee", "mlp"),
            ({"op": "relax.matmul", "result": "S[0]"}, "op", "relax.matmul"),
            ({"op": "relax.nn.relu", "args": {0: "R"}}, "op", "relax.nn.relu"),
            ({"param": "A", "result": "S[1]"}, "param", "A"),
        ],
    )
    def test_kind_and_target(self, kwargs, kind, target):
        rule = ShardingRule(**kwargs)
        assert rule.kind == kind
        assert rule.target == target

    def test_no_matcher(self):
        with pytest.raises(RuleError) as info:
            ShardingRule(result="R")
        text = str(info.value)
        assert "needs exactly one matcher (callee, op or param), got none" in text
        assert "hint: write one rule per matcher" in text

    def test_two_matchers(self):
        with pytest.raises(RuleError) as info:
            ShardingRule(callee="mlp", param="A", result="R")
        assert "got callee='mlp', param='A'" in str(info.value)

    def test_three_matchers(self):
        with pytest.raises(RuleError, match="got callee='f', op='relax.add', param='x'"):
            ShardingRule(callee="f", op="relax.add", param="x", result="R")

    @pytest.mark.parametrize("target", ["", 5, ("mlp",)])
    def test_matcher_must_be_a_non_empty_name(self, target):
        with pytest.raises(RuleError) as info:
            ShardingRule(callee=target, result="R")
        assert f"callee= must be a non-empty name, got {target!r}" in str(info.value)

    def test_misspelt_operator_suggests_the_real_one(self):
        with pytest.raises(RuleError) as info:
            ShardingRule(op="relax.matmull", result="R")
        err = info.value
        text = str(err)
        assert "op='relax.matmull' is not a registered operator" in text
        assert err.hint is not None and err.hint.startswith("did you mean ")
        first = err.hint[len("did you mean "):].split(", ")[0].rstrip("?")
        assert first == "relax.matmul"
        assert "\nhint: did you mean relax.matmul" in text

    def test_operator_without_a_close_match(self):
        with pytest.raises(RuleError) as info:
            ShardingRule(op="zzzzqqq", result="R")
        assert "named like 'relax.matmul'" in info.value.hint

    def test_unknown_callee_is_accepted_at_construction(self):
        # Callee names are only checked against a module when the rule is applied.
        assert ShardingRule(callee="no_such_function", result="R").target == "no_such_function"


# ---------------------------------------------------------------------------- shardings


class TestShardings:
    def test_param_rule_with_args(self):
        with pytest.raises(RuleError) as info:
            ShardingRule(param="A", args={0: "R"}, result="R")
        text = str(info.value)
        assert "param rule for 'A' has args" in text
        assert "ShardingRule(param='A', result='S[0]')" in text

    @pytest.mark.parametrize(
        "kwargs, shown",
        [
            ({"callee": "mlp"}, "callee='mlp'"),
            ({"op": "relax.matmul", "args": {}}, "op='relax.matmul'"),
            ({"param": "A"}, "param='A'"),
        ],
    )
    def test_no_sharding_given(self, kwargs, shown):
        with pytest.raises(RuleError) as info:
            ShardingRule(**kwargs)
        assert f"the rule for {shown} gives no sharding" in str(info.value)
        assert "hint: add args=" in str(info.value)

    @pytest.mark.parametrize("index", [-1, "0", True, 1.0, None])
    def test_bad_argument_positions(self, index):
        with pytest.raises(RuleError) as info:
            ShardingRule(callee="mlp", args={index: "R"})
        text = str(info.value)
        assert f"argument positions must be non-negative ints, got {index!r}" in text
        assert "in the rule for callee='mlp'" in text

    @pytest.mark.parametrize("args", [["R"], "R", None, [(0, "R")]])
    def test_args_must_be_a_mapping(self, args):
        with pytest.raises(RuleError, match="args must map argument positions to placements"):
            ShardingRule(callee="mlp", args=args, result="R")

    def test_placements_are_parsed_and_sorted(self):
        rule = ShardingRule(callee="mlp", args={2: "S[1]", 0: "S[0], R"}, result="RS[0]")
        assert list(rule.args) == [0, 2]
        assert rule.args[0] == Placement((Shard(0), Replicate()))
        assert rule.args[2] == Placement((Shard(1),))
        assert rule.result == Placement((Replicate(), Shard(0)))
        assert all(isinstance(p, Placement) for p in rule.args.values())

    def test_placement_objects_are_accepted(self):
        p = Placement.parse("S[1]")
        rule = ShardingRule(op="relax.matmul", args={1: p}, result=p)
        assert rule.args == {1: p}
        assert rule.result is p

    def test_input_mapping_is_not_mutated(self):
        args = {1: "R", 0: "S[0]"}
        ShardingRule(callee="mlp", args=args)
        assert args == {1: "R", 0: "S[0]"}

    @pytest.mark.parametrize("bad", ["S[x]", "", "T", 7])
    def test_bad_arg_placement(self, bad):
        with pytest.raises(RuleError) as info:
            ShardingRule(callee="mlp", args={1: bad})
        err = info.value
        text = str(err)
        assert "bad args[1] in the rule for callee='mlp'" in text
        assert err.placement == str(bad)
        assert f'placement "{bad}"' in text
        assert type(err) is RuleError

    def test_bad_result_placement(self):
        with pytest.raises(RuleError) as info:
            ShardingRule(param="A", result="S[0")
        text = str(info.value)
        assert text.startswith('[sharding-rule] placement "S[0": ')
        assert "bad result in the rule for param='A'" in text
        assert "cannot parse 'S[0' at position 0" in text
        assert "\nhint: " in text

    def test_rule_error_is_a_sharding_and_value_error(self):
        with pytest.raises(ShardingError):
            ShardingRule(callee="mlp")
        with pytest.raises(ValueError):
            ShardingRule(callee="mlp")


# ---------------------------------------------------------------------------- meshes


class TestMeshes:
    def test_no_meshes_is_an_empty_tuple(self):
        rule = ShardingRule(callee="mlp", result="R")
        assert rule.meshes == ()
        assert rule.mesh_for_site(0) is None
        assert rule.mesh_for_site(5) is None

    def test_single_string_becomes_a_one_tuple(self):
        rule = ShardingRule(callee="mlp", result="R", meshes="mesh[1]")
        assert rule.meshes == (MeshReference("mesh", 1),)
        assert isinstance(rule.meshes, tuple)

    def test_list_is_parsed_in_order(self):
        rule = ShardingRule(callee="mlp", result="R", meshes=["mesh[1]", " mesh[0] "])
        assert rule.meshes == (MeshReference("mesh", 1), MeshReference("mesh", 0))

    def test_cycling_over_two_meshes(self):
        rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
        assert [str(rule.mesh_for_site(i)) for i in range(4)] == [
            "mesh[0]",
            "mesh[1]",
            "mesh[0]",
            "mesh[1]",
        ]

    def test_cycling_over_three_meshes(self):
        rule = ShardingRule(callee="mlp", result="R", meshes=["m[0]", "m[1]", "m[2]"])
        assert [rule.mesh_for_site(i).index for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]

    def test_one_mesh_serves_every_site(self):
        rule = ShardingRule(callee="mlp", result="R", meshes="mesh[0]")
        assert {rule.mesh_for_site(i) for i in range(5)} == {MeshReference("mesh", 0)}

    @pytest.mark.parametrize("bad", ["mesh", "mesh[x]", "mesh[-1]", ["mesh[0]", "mesh"], [0]])
    def test_bad_mesh_references(self, bad):
        with pytest.raises(RuleError) as info:
            ShardingRule(callee="mlp", result="R", meshes=bad)
        text = str(info.value)
        assert "bad meshes= in the rule for callee='mlp'" in text
        assert 'a mesh reference looks like "mesh[0]"' in text
        assert "hint: name a mesh" in text

    @pytest.mark.parametrize("empty", [[], ()])
    def test_empty_mesh_list(self, empty):
        with pytest.raises(RuleError) as info:
            ShardingRule(callee="mlp", result="R", meshes=empty)
        assert "meshes= is an empty list in the rule for callee='mlp'" in str(info.value)


# ---------------------------------------------------------------------------- repr & value


class TestReprAndValue:
    @pytest.mark.parametrize(
        "rule, text",
        [
            (
                ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"]),
                "ShardingRule(callee='mlp', args={0: 'R'}, meshes=['mesh[0]', 'mesh[1]'])",
            ),
            (
                ShardingRule(param="A", result="S[1]", function="mlp"),
                "ShardingRule(param='A', result='S[1]', function='mlp')",
            ),
            (
                ShardingRule(op="relax.matmul", args={1: "S[0], R", 0: "R"}, result="S[0]R",
                             meshes="mesh[0]"),
                "ShardingRule(op='relax.matmul', args={0: 'R', 1: 'S[0]R'}, result='S[0]R', "
                "meshes=['mesh[0]'])",
            ),
        ],
    )
    def test_repr(self, rule, text):
        assert repr(rule) == text

    def test_repr_evaluates_to_an_equal_rule(self):
        rule = ShardingRule(
            callee="mlp", args={1: "S[0]"}, result="R", function="main", meshes=["mesh[0]", "mesh[1]"]
        )
        rebuilt = eval(repr(rule), {"ShardingRule": ShardingRule})  # noqa: S307
        assert rebuilt == rule

    def test_equal_rules_compare_equal(self):
        a = ShardingRule(callee="mlp", args={0: "S[0]", 1: "R"}, meshes="mesh[0]")
        b = ShardingRule(callee="mlp", args={1: Placement.parse("R"), 0: "S[0]"}, meshes=["mesh[0]"])
        assert a == b
        assert a != ShardingRule(callee="mlp", args={0: "S[0]", 1: "R"}, meshes="mesh[1]")

    def test_frozen(self):
        rule = ShardingRule(param="A", result="R")
        with pytest.raises(dataclasses.FrozenInstanceError):
            rule.result = "S[0]"  # type: ignore[misc]

    def test_copy_keeps_the_rule(self):
        rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
        assert copy.deepcopy(rule) == rule

    def test_dataclasses_replace_keeps_meshes(self):
        # replace() re-runs validation on already-normalised fields; a rule with
        # meshes must survive it.
        rule = ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"])
        moved = dataclasses.replace(rule, function="main")
        assert moved.function == "main"
        assert moved.meshes == rule.meshes
        assert moved.args == rule.args


def test_module_doctests_pass():
    result = doctest.testmod(rules_module, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0
