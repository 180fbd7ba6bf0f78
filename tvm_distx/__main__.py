"""``python -m tvm_distx``: the ``tvm-distx`` command line."""

import sys

from .cli import main

sys.exit(main())
