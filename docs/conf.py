"""Sphinx configuration for the tvm-distx user guide and API reference.

Built by ``tests/test_docs.py`` with warnings as errors (``sphinx-build -W``); by hand::

    .venv/bin/python -m sphinx -W -b html docs /tmp/distx-docs
"""

project = "tvm-distx"
author = "the tvm-distx developers"
copyright = "the tvm-distx developers"  # noqa: A001
release = "0.1.0"

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinxarg.ext",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: ``{eval-rst}`` blocks and directives in fences; `#` anchors for headings up to
# level 3, so that pages can link to a section as ``page.md#a-heading``.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# API reference: numpydoc parses the docstrings; no member tables of its own (autodoc lists
# the members), no stub pages written into the source tree.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
autosummary_generate = False
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "none"  # the docstrings give the types
autodoc_mock_imports: list[str] = []

html_theme = "alabaster"
html_title = "tvm-distx"

# Keep "--flag" as typed: smart quotes would turn the "--" of a flag in a help text into a dash.
smartquotes = False
