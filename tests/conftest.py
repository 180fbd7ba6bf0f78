"""Fixtures that every test may use.

``test_hosts``: three hosts in namespaces on this machine for the whole session
(``tests/testhosts.py``, ``docs/testhosts.md``).
"""

from testhosts import test_hosts_fixture  # noqa: F401  (registers the fixture)
