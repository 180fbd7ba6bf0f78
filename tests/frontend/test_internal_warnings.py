"""torch's warnings about its own internals are logged with their reason; others still show."""

from __future__ import annotations

import logging
import warnings

import pytest

from tvm_distx.frontend.pytorch import INTERNAL_WARNINGS, _internal_warnings_logged

PYTREE = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`"


def test_torchs_pytree_warning_is_logged_not_shown(caplog):
    caplog.set_level(logging.DEBUG, logger="tvm_distx.frontend.pytorch")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with _internal_warnings_logged():
            warnings.warn(PYTREE, FutureWarning)
    assert shown == []
    (record,) = [r for r in caplog.records if "hidden FutureWarning" in r.getMessage()]
    assert INTERNAL_WARNINGS[0][2] in record.getMessage()


@pytest.mark.parametrize("category, text", [(FutureWarning, "a model's own deprecation"),
                                            (UserWarning, PYTREE)])
def test_any_other_warning_is_shown(category, text):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with _internal_warnings_logged():
            warnings.warn(text, category)
    assert [(w.category, str(w.message)) for w in shown] == [(category, text)]
