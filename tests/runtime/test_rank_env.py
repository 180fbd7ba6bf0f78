"""The environment ranks start with (tvm_distx.runtime.rank_env)."""

from __future__ import annotations

from tvm_distx.runtime.rank_env import HUGEPAGES_TUNABLE, rank_environment


def test_the_huge_page_tunable_is_added_to_the_callers_environment():
    env = rank_environment({"PATH": "/bin"}, {"TVM_NUM_THREADS": "2"})
    assert env == {"PATH": "/bin", "TVM_NUM_THREADS": "2", "GLIBC_TUNABLES": HUGEPAGES_TUNABLE}


def test_tunables_the_user_set_are_kept_and_an_explicit_choice_wins():
    kept = rank_environment({"GLIBC_TUNABLES": "glibc.malloc.check=3"})
    assert kept["GLIBC_TUNABLES"] == f"glibc.malloc.check=3:{HUGEPAGES_TUNABLE}"
    theirs = rank_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert theirs["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    off = rank_environment({}, {"TVM_DISTX_HUGEPAGES": "0"})
    assert "GLIBC_TUNABLES" not in off
