"""``python -m tvm_distx``: the ``tvm-distx`` command line."""

from tvm_distx.cli.main import console

if __name__ == "__main__":  # importing the module (as the architecture tests do) runs nothing
    console()
