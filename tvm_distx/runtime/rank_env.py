"""The environment every rank process starts with (MPI ranks and disco workers alike).

The launcher and the disco session start ranks with the caller's environment
plus ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: glibc's ``malloc`` then asks for
  transparent huge pages (``madvise``) for what it maps. numpy does so for its
  own large buffers, TVM's allocator does not; on hosts where transparent huge
  pages are ``madvise``-only, MPI moves data between 4 KiB pages markedly
  slower (``scripts/bench/collectives.py`` measures both). The tunable is
  appended to any ``GLIBC_TUNABLES`` the user set, never replacing it, and
  ``TVM_DISTX_HUGEPAGES=0`` turns it off. A glibc that does not know the
  tunable ignores it.

(Threads are set elsewhere: the MPI worker shares a host's cores between its
ranks, a disco worker defaults to one thread.)
"""

from __future__ import annotations

import os
from typing import Mapping

#: The glibc tunable that makes ``malloc`` request transparent huge pages.
HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"

#: Set to ``0`` to start ranks without :data:`HUGEPAGES_TUNABLE`.
HUGEPAGES_ENV = "TVM_DISTX_HUGEPAGES"


def rank_environment(base: Mapping[str, str] | None = None,
                     extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a rank process.

    Parameters
    ----------
    base : mapping, optional
        The environment to start from; ``os.environ`` by default.
    extra : mapping, optional
        Variables that override ``base`` (the caller's ``env=``).

    Returns
    -------
    dict
        ``base`` and ``extra`` with :data:`HUGEPAGES_TUNABLE` added to ``GLIBC_TUNABLES`` unless the
        result sets ``TVM_DISTX_HUGEPAGES=0``.
    """
    env = {**(os.environ if base is None else base), **(extra or {})}
    if env.get(HUGEPAGES_ENV, "1") != "0":
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
            tunables.append(HUGEPAGES_TUNABLE)
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env
