"""Fixtures that every test may use.

``test_hosts``: three hosts in namespaces on this machine for the whole session
(``tests/testhosts.py``, ``docs/testhosts.md``). ``nothing_left``: asserts that a test left
nothing on the test hosts nor here (``tests/host_leftovers.py``). ``board_root`` and
``board_hosts``: the emulated RISC-V boards' root, built once a run, and two boards
(``tests/boards.py``).

The compile cache is off for the suite (``TVM_DISTX_CACHE=off``, inherited by the commands
the tests start): a test that builds a model compiles it, and never reads another test's
build; ``tests/llm/test_compile_cache.py`` turns it on with a directory of its own.
"""

import os

os.environ["TVM_DISTX_CACHE"] = "off"

from boards import board_hosts, board_root  # noqa: F401  (registers the fixtures)
from host_leftovers import nothing_left  # noqa: F401  (registers the fixture)

from testhosts import test_hosts_fixture  # noqa: F401  (registers the fixture)
