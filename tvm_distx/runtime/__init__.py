"""Running rank programs: the emulated backend (MPI and disco backends to come)."""

from .emulator import emulate, shard_array

__all__ = ["emulate", "shard_array"]
