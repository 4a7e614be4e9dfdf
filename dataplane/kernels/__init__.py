"""GPU kernels (Triton) for the data plane; each kernel's plain-torch reference, the oracle of its tests,
is in tests/dataplane/kernels/reference.py.

Importing this package never needs Triton or a GPU: the kernel modules import Triton themselves and are
loaded only when asked for, so CPU-only machines (and CI) can import the package and `triton_usable`.
"""

from modelfleet.dataplane.kernels.availability import triton_usable

__all__ = ["triton_usable"]
