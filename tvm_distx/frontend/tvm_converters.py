"""TVM's own PyTorch converters, for our converters that wrap them.

Our converters (:mod:`tvm_distx.frontend.torch_ops`, :mod:`tvm_distx.frontend.torch_complex`)
replace some of TVM's in the importer's ``custom_convert_map``; a replacement that
handles only some cases hands the others to TVM's original, which
:func:`original_converter` finds.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["original_converter"]


def original_converter(importer, name: str) -> Callable:
    """TVM's own converter of the ATen overload ``name`` (before ours replaced it).

    The importer's original map is made once per importer and kept on it.
    """
    originals = importer.__dict__.get("_tvm_distx_original_converters")
    if originals is None:
        originals = importer.create_convert_map()
        importer.__dict__["_tvm_distx_original_converters"] = originals
    return originals[name]
