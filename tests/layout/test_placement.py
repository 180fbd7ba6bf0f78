"""Unit tests for tvm_distx.layout: entries, text form, TVM conversion, validate()."""

from __future__ import annotations

import doctest

import pytest
from tvm.relax.distributed import Placement as TVMPlacement

import tvm_distx.layout.placement as placement_module
from tvm_distx import DeviceMesh, Placement, Replicate, Shard
from tvm_distx.errors import (
    IndivisibleShardError,
    PlacementRankError,
    PlacementSyntaxError,
    ShardDimError,
    ShardingError,
    UnsupportedValueError,
)
from tvm_distx.layout import Partial, TensorSharding, as_placement

# Texts in our compact form, with the entries each one should produce.
TEXTS = {
    "R": (Replicate(),),
    "S[1]": (Shard(1),),
    "S[0]R": (Shard(0), Replicate()),
    "RS[0]": (Replicate(), Shard(0)),
    "S[0]S[1]": (Shard(0), Shard(1)),
    "S[0]S[0]": (Shard(0), Shard(0)),
    "S[2]RS[1]": (Shard(2), Replicate(), Shard(1)),
    "RRR": (Replicate(), Replicate(), Replicate()),
    "S[10]": (Shard(10),),
}

BAD_TEXTS = ["", "X", "S[]", "S[-1]", "S[a]", "S[0", "RR]"]


def tvm_text(tvm_placement) -> str:
    """TVM prints a placement with surrounding double quotes: '"S[0], R"'."""
    printed = str(tvm_placement)
    assert printed.startswith('"') and printed.endswith('"'), printed
    return printed[1:-1]


# ---------------------------------------------------------------------------- entries


class TestEntries:
    def test_replicate_queries_and_text(self):
        r = Replicate()
        assert r.is_replicate() is True
        assert r.is_shard() is False
        assert r.is_shard(0) is False
        assert str(r) == "R"

    def test_shard_queries_and_text(self):
        s = Shard(2)
        assert s.dim == 2
        assert s.is_replicate() is False
        assert s.is_shard() is True
        assert s.is_shard(2) is True
        assert s.is_shard(1) is False
        assert str(s) == "S[2]"

    def test_entries_compare_and_hash_by_value(self):
        assert Shard(1) == Shard(1)
        assert Shard(1) != Shard(2)
        assert Replicate() == Replicate()
        assert Replicate() != Shard(0)
        assert len({Shard(0), Shard(0), Replicate(), Replicate()}) == 2

    def test_entries_are_frozen(self):
        s = Shard(0)
        with pytest.raises(AttributeError):
            s.dim = 3  # type: ignore[misc]

    @pytest.mark.parametrize("dim", [-1, True, False, "0", 1.0, None])
    def test_shard_rejects_non_natural_dims(self, dim):
        with pytest.raises(PlacementSyntaxError) as info:
            Shard(dim)
        assert f"got {dim!r}" in str(info.value)
        assert "hint: write Shard(0)" in str(info.value)


# ---------------------------------------------------------------------------- construction


class TestConstruction:
    def test_entries_are_normalised_to_a_tuple(self):
        p = Placement([Shard(0), Replicate()])
        assert p.entries == (Shard(0), Replicate())
        assert isinstance(p.entries, tuple)

    def test_empty_entries_rejected(self):
        with pytest.raises(PlacementSyntaxError, match="at least one entry"):
            Placement(())

    @pytest.mark.parametrize("entry", ["R", 0, None, ("S", 0)])
    def test_foreign_entries_rejected(self, entry):
        with pytest.raises(PlacementSyntaxError) as info:
            Placement((Replicate(), entry))
        assert f"got {entry!r}" in str(info.value)

    def test_equality_and_hash_are_by_entries(self):
        a = Placement.parse("S[0]R")
        b = Placement((Shard(0), Replicate()))
        c = Placement.parse("RS[0]")
        assert a == b
        assert hash(a) == hash(b)
        assert a != c
        assert len({a, b, c}) == 2

    def test_placement_is_frozen(self):
        p = Placement.parse("R")
        with pytest.raises(AttributeError):
            p.entries = (Shard(0),)  # type: ignore[misc]


# ---------------------------------------------------------------------------- text form


class TestParse:
    @pytest.mark.parametrize("text", list(TEXTS))
    def test_parse_gives_expected_entries(self, text):
        assert Placement.parse(text).entries == TEXTS[text]

    @pytest.mark.parametrize("text", list(TEXTS))
    def test_str_is_the_compact_text(self, text):
        assert str(Placement.parse(text)) == text

    @pytest.mark.parametrize(
        "text, expected",
        [
            ("S[0], R", "S[0]R"),
            ("S[0],R", "S[0]R"),
            ("  R ,  S[1]  ", "RS[1]"),
            ("S[ 3 ]", "S[3]"),
            ("S[2], R, S[1]", "S[2]RS[1]"),
            ("R,", "R"),
            ("S[0]R\n", "S[0]R"),
        ],
    )
    def test_separators_and_whitespace_are_accepted(self, text, expected):
        assert str(Placement.parse(text)) == expected

    @pytest.mark.parametrize("text", BAD_TEXTS)
    def test_bad_text_raises_syntax_error_naming_the_text(self, text):
        with pytest.raises(PlacementSyntaxError) as info:
            Placement.parse(text)
        err = info.value
        assert isinstance(err, ShardingError)
        assert isinstance(err, ValueError)
        assert err.placement == text
        assert f'placement "{text}"' in str(err)
        assert str(err).startswith("[placement-syntax] ")
        assert "\nhint: " in str(err)

    @pytest.mark.parametrize("text", ["", "   "])
    def test_empty_text_says_empty(self, text):
        with pytest.raises(PlacementSyntaxError, match="the placement is empty"):
            Placement.parse(text)

    @pytest.mark.parametrize(
        "text, position, rest",
        [("X", 0, "'X'"), ("S[-1]", 0, "'S[-1]'"), ("RR]", 2, "']'"), ("S[0]Q", 4, "'Q'")],
    )
    def test_error_points_at_the_failing_position(self, text, position, rest):
        with pytest.raises(PlacementSyntaxError) as info:
            Placement.parse(text)
        assert f"cannot parse {text!r} at position {position}: {rest}" in str(info.value)

    @pytest.mark.parametrize("value", [5, None, b"R", ["R"]])
    def test_non_string_raises_syntax_error(self, value):
        with pytest.raises(PlacementSyntaxError) as info:
            Placement.parse(value)  # type: ignore[arg-type]
        err = info.value
        assert isinstance(err, ShardingError)
        assert f"got {type(value).__name__} {value!r}" in str(err)

    def test_tvm_quoted_form_is_not_a_placement(self):
        # The quotes belong to TVM's printer, not to the placement text.
        with pytest.raises(PlacementSyntaxError):
            Placement.parse('"S[0], R"')


class TestAsPlacement:
    def test_passes_placements_through_unchanged(self):
        p = Placement.parse("S[0]R")
        assert as_placement(p) is p

    def test_parses_text(self):
        assert as_placement("RS[1]") == Placement((Replicate(), Shard(1)))

    def test_rejects_bad_values(self):
        with pytest.raises(PlacementSyntaxError):
            as_placement("S[x]")
        with pytest.raises(PlacementSyntaxError):
            as_placement(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- queries


class TestQueries:
    def test_ndim(self):
        assert Placement.parse("R").ndim == 1
        assert Placement.parse("S[2]RS[1]").ndim == 3

    @pytest.mark.parametrize(
        "text, replicated", [("R", True), ("RRR", True), ("RS[0]", False), ("S[0]", False)]
    )
    def test_is_replicated(self, text, replicated):
        assert Placement.parse(text).is_replicated() is replicated

    @pytest.mark.parametrize(
        "text, dims",
        [("R", ()), ("S[1]", (1,)), ("S[2]RS[1]", (1, 2)), ("S[0]S[0]", (0,)), ("S[3]S[1]S[3]", (1, 3))],
    )
    def test_sharded_dims_are_sorted_and_unique(self, text, dims):
        assert Placement.parse(text).sharded_dims() == dims

    def test_mesh_axes_sharding(self):
        p = Placement.parse("S[1]RS[1]S[0]")
        assert p.mesh_axes_sharding(1) == (0, 2)
        assert p.mesh_axes_sharding(0) == (3,)
        assert p.mesh_axes_sharding(2) == ()


# ---------------------------------------------------------------------------- TVM round trips


class TestTVMConversion:
    @pytest.mark.parametrize("text", list(TEXTS))
    def test_tvm_parses_our_text_back_to_an_equal_placement(self, text):
        ours = Placement.parse(text)
        theirs = TVMPlacement.from_text(str(ours))
        assert Placement.from_tvm(theirs) == ours

    @pytest.mark.parametrize("text", list(TEXTS))
    def test_we_parse_tvm_printed_form(self, text):
        theirs = TVMPlacement.from_text(text)
        printed = tvm_text(theirs)
        assert Placement.parse(printed) == Placement.parse(text)

    @pytest.mark.parametrize("text", list(TEXTS))
    def test_to_tvm_then_from_tvm(self, text):
        ours = Placement.parse(text)
        theirs = ours.to_tvm()
        assert isinstance(theirs, TVMPlacement)
        assert len(theirs.dim_specs) == ours.ndim
        assert Placement.from_tvm(theirs) == ours

    def test_to_tvm_specs_match_entries(self):
        theirs = Placement.parse("S[2]RS[1]").to_tvm()
        specs = list(theirs.dim_specs)
        # TVM's PlacementSpecKind: 0 shards, 1 replicates.
        assert [int(s.kind) for s in specs] == [0, 1, 0]
        assert int(specs[0].axis) == 2
        assert int(specs[2].axis) == 1
        assert tvm_text(theirs) == "S[2], R, S[1]"

    def test_from_tvm_uses_only_dim_specs(self):
        theirs = TVMPlacement.from_text("R, S[4]")
        assert Placement.from_tvm(theirs).entries == (Replicate(), Shard(4))


# ---------------------------------------------------------------------------- validate


MESH_1D = DeviceMesh((2,), range(0, 2), "mesh[0]")
MESH_2X2 = DeviceMesh((2, 2), range(0, 4), "mesh[0]")
MESH_2X3 = DeviceMesh((2, 3), range(0, 6))


class TestValidate:
    def test_good_placements_pass(self):
        Placement.parse("S[0]").validate(MESH_1D, (4, 3))
        Placement.parse("R").validate(MESH_1D, (3,))
        Placement.parse("S[0]S[1]").validate(MESH_2X3, (4, 9))
        Placement.parse("RR").validate(MESH_2X2, (3, 5))

    def test_no_shape_checks_only_the_rank(self):
        # S[7] would be out of range for most tensors, but without a shape only
        # the mesh rank is checked.
        Placement.parse("S[7]R").validate(MESH_2X2)

    def test_rank_mismatch(self):
        with pytest.raises(PlacementRankError) as info:
            Placement.parse("S[0]R").validate(MESH_1D, (4, 4), function="main", var="x")
        err = info.value
        text = str(err)
        assert text.startswith(
            "[placement-rank] in function 'main', variable 'x', placement \"S[0]R\": "
        )
        assert "the placement has 2 entries but mesh" in text
        assert '"mesh[0]"' in text
        assert "has 1 axis" in text
        assert '\nhint: give one entry (R or S[k]) per mesh axis, for example "S[0]"' in text
        assert err.function == "main"
        assert err.var == "x"
        assert err.placement == "S[0]R"
        assert isinstance(err, ShardingError) and isinstance(err, ValueError)

    def test_rank_mismatch_on_2d_mesh_suggests_two_entries(self):
        with pytest.raises(PlacementRankError) as info:
            Placement.parse("R").validate(MESH_2X2, function="mlp", var="A")
        text = str(info.value)
        assert "in function 'mlp', variable 'A'" in text
        assert "has 2 axes" in text
        assert 'for example "S[0]R"' in text

    def test_rank_checked_before_shape(self):
        with pytest.raises(PlacementRankError):
            Placement.parse("S[5]R").validate(MESH_1D, (3,))

    def test_shard_dim_out_of_range(self):
        with pytest.raises(ShardDimError) as info:
            Placement.parse("S[2]").validate(MESH_1D, (4, 4), function="f", var="y")
        text = str(info.value)
        assert text.startswith("[shard-dim] in function 'f', variable 'y', placement \"S[2]\": ")
        assert "S[2] shards dimension 2, but the tensor has rank 2 (shape (4, 4))" in text
        assert "hint: shard a dimension between 0 and 1" in text

    def test_shard_of_a_scalar(self):
        with pytest.raises(ShardDimError) as info:
            Placement.parse("S[0]").validate(MESH_1D, ())
        assert "hint: a scalar cannot be sharded; use R" in str(info.value)

    def test_indivisible_static_dim(self):
        with pytest.raises(IndivisibleShardError) as info:
            Placement.parse("S[1]").validate(MESH_1D, (4, 5), function="main", var="w")
        err = info.value
        text = str(err)
        assert text.startswith(
            "[shard-divisible] in function 'main', variable 'w', placement \"S[1]\": "
        )
        assert "dimension 1 has extent 5, which does not divide into 2 equal shards" in text
        assert "divides 5" in text
        assert isinstance(err, ValueError)

    def test_dynamic_dims_are_not_checked(self):
        Placement.parse("S[0]").validate(MESH_1D, (None, 3))
        Placement.parse("S[0]S[1]").validate(MESH_2X3, (None, None))
        Placement.parse("S[0]S[0]").validate(MESH_2X2, (None,))

    def test_dynamic_dim_still_needs_to_exist(self):
        with pytest.raises(ShardDimError):
            Placement.parse("S[1]").validate(MESH_1D, (None,))

    def test_repeated_shard_needs_product_divisibility(self):
        p = Placement.parse("S[0]S[0]")
        p.validate(MESH_2X2, (4, 1))
        p.validate(MESH_2X2, (8, 3))
        with pytest.raises(IndivisibleShardError) as info:
            p.validate(MESH_2X2, (6, 1))
        assert "extent 6, which does not divide into 4 equal shards" in str(info.value)
        with pytest.raises(IndivisibleShardError):
            p.validate(MESH_2X2, (2, 4))

    def test_each_mesh_axis_divides_its_own_dim(self):
        p = Placement.parse("S[0]S[1]")
        p.validate(MESH_2X3, (2, 3))
        with pytest.raises(IndivisibleShardError, match="extent 4, which does not divide into 3"):
            p.validate(MESH_2X3, (2, 4))
        with pytest.raises(IndivisibleShardError, match="extent 3, which does not divide into 2"):
            p.validate(MESH_2X3, (3, 3))

    def test_replicated_dims_need_not_divide(self):
        Placement.parse("RR").validate(MESH_2X3, (5, 7))
        Placement.parse("RS[1]").validate(MESH_2X3, (5, 9))

    def test_without_location_the_message_has_only_the_placement(self):
        with pytest.raises(IndivisibleShardError) as info:
            Placement.parse("S[0]").validate(MESH_1D, (3,))
        text = str(info.value)
        assert text.startswith('[shard-divisible] placement "S[0]": ')
        assert "function" not in text.split(":")[0]
        assert info.value.function is None and info.value.var is None


def test_module_doctests_pass():
    result = doctest.testmod(placement_module, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


# ---------------------------------------------------------------------------- partial sums


class TestPartial:
    @pytest.mark.parametrize("text,entries", [
        ("P", (Partial(),)),
        ("PR", (Partial(), Replicate())),
        ("S[0]P", (Shard(0), Partial())),
        ("P, S[1]", (Partial(), Shard(1))),
    ])
    def test_text_form(self, text, entries):
        placement = Placement.parse(text)
        assert placement.entries == entries
        assert Placement.parse(str(placement)) == placement

    def test_partial_is_a_sum_by_default_and_queries(self):
        assert Partial() == Partial("sum") and hash(Partial()) == hash(Partial("sum"))
        entry = Partial()
        assert (entry.is_partial(), entry.is_replicate(), entry.is_shard()) == (True, False, False)
        assert not Replicate().is_partial() and not Shard(0).is_partial()
        p = Placement.parse("S[0]PP")
        assert p.has_partial() and p.partial_axes() == (1, 2)
        assert not p.is_replicated() and p.sharded_dims() == (0,)
        assert not Placement.parse("S[0]R").has_partial()

    @pytest.mark.parametrize("op", ["max", "avg", "", None])
    def test_other_reductions_are_refused_with_a_hint(self, op):
        with pytest.raises(PlacementSyntaxError) as info:
            Partial(op)
        assert repr(op) in str(info.value)
        assert 'hint: write Partial() (a partial sum, "P" in text)' in str(info.value)

    def test_to_tvm_refuses_a_partial_sum(self):
        with pytest.raises(PlacementSyntaxError) as info:
            Placement.parse("S[0]P").to_tvm()
        assert info.value.placement == "S[0]P"
        assert "TVM DTensor type cannot carry" in str(info.value)
        assert "hint: reduce it first" in str(info.value)

    def test_validate(self):
        Placement.parse("P").validate(MESH_1D, (3, 5))  # nothing is split: any extent
        Placement.parse("PS[1]").validate(MESH_2X2, (3, 4))
        with pytest.raises(PlacementRankError):
            Placement.parse("PR").validate(MESH_1D, (4,))
        with pytest.raises(IndivisibleShardError):
            Placement.parse("PS[1]").validate(MESH_2X2, (4, 3))


# ---------------------------------------------------------------------------- TensorSharding


class TestTensorSharding:
    def test_checked_at_construction(self):
        with pytest.raises(PlacementRankError) as info:
            TensorSharding(MESH_2X2, Placement.parse("S[0]"))
        assert info.value.placement == "S[0]"
        with pytest.raises(UnsupportedValueError, match="needs a DeviceMesh"):
            TensorSharding("mesh[0]", Placement.parse("S[0]"))
        with pytest.raises(PlacementSyntaxError):
            TensorSharding(MESH_1D, "S[")

    def test_text_is_parsed(self):
        assert TensorSharding(MESH_2X2, "S[0]P") == TensorSharding(MESH_2X2,
                                                                  Placement.parse("S[0]P"))

    def test_local_shape(self):
        assert TensorSharding(MESH_2X3, "S[0]S[1]").local_shape((4, 9)) == (2, 3)
        assert TensorSharding(MESH_2X2, "S[1]S[1]").local_shape((3, 8)) == (3, 2)
        assert TensorSharding(MESH_2X2, "PR").local_shape((3, 8)) == (3, 8)
        assert TensorSharding(MESH_1D, "S[0]").local_shape((None, 8)) == (None, 8)

    def test_local_shape_of_a_symbolic_extent(self):
        import tvm

        n = tvm.tirx.Var("n", "int64")
        [local, rest] = TensorSharding(MESH_1D, "S[0]").local_shape((n, 8))
        assert rest == 8
        tvm.ir.assert_structural_equal(local, n // 2)
