# The bad-input corpus puts this directory first on PYTHONPATH: TVM's FFI imports torch
# eagerly when it can (about 3 s of CPU per process) and tolerates an ImportError. No case
# needs torch. See README.md.
raise ImportError("torch is disabled for the bad-input corpus")
