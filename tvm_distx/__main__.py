"""``python -m tvm_distx``: the ``tvm-distx`` command line."""

import sys

from tvm_distx.cli.main import main

if __name__ == "__main__":  # importing the module (as the architecture tests do) runs nothing
    sys.exit(main())
