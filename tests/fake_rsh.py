#!/usr/bin/env python3
"""A remote shell for tests, called as ssh is: ``fake_rsh.py [options] HOST COMMAND...``.

Each host is a directory ``$FAKE_RSH_HOSTS/<host>``. The command runs here, with ``sh -c``,
in a private mount namespace in which ``$FAKE_RSH_DEST`` is ``$FAKE_RSH_HOSTS/<host>/dest``
(a bind mount): every host has its own deploy directory at the same path, as real hosts do.

- a host with no directory does not answer: ssh's message, exit 255;
- a host whose directory holds a file ``hang`` never answers (it sleeps);
- every call's argv is appended to ``$FAKE_RSH_LOG`` (one JSON list a line), when set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import sys
import time

#: ssh's options that take an argument.
WITH_ARGUMENT = set("BbcDEeFIiJLlmOopQRSWw")


def main(argv: list[str]) -> int:
    if os.environ.get("FAKE_RSH_LOG"):
        with open(os.environ["FAKE_RSH_LOG"], "a") as log:
            log.write(json.dumps(argv) + "\n")
    at = 0
    while at < len(argv) and argv[at].startswith("-"):
        option = argv[at]
        at += 2 if len(option) == 2 and option[1] in WITH_ARGUMENT else 1
    host, command = argv[at], " ".join(argv[at + 1:])
    home = Path(os.environ["FAKE_RSH_HOSTS"]) / host
    if not home.is_dir():
        sys.stderr.write(f"ssh: Could not resolve hostname {host}: Name or service not known\n")
        return 255
    if (home / "hang").exists():
        time.sleep(120)
        return 0
    dest = os.environ["FAKE_RSH_DEST"]
    os.makedirs(dest, exist_ok=True)
    os.makedirs(home / "dest", exist_ok=True)
    os.execvp("unshare", ["unshare", "--mount", "sh", "-c",
                          'mount --bind "$1" "$2" && exec sh -c "$3"', "sh", str(home / "dest"),
                          dest, command])
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
