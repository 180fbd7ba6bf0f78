"""Where the tests' files are: test modules sit in subfolders, so they ask here (support module)."""

from pathlib import Path

#: The ``tests`` folder: ``data/``, ``models/``, ``mpi/`` and the support modules.
TESTS_DIR = Path(__file__).resolve().parent
#: The repository's root.
REPO_ROOT = TESTS_DIR.parent
