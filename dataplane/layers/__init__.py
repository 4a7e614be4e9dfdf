"""Building blocks of the models; each op has a torch reference (`forward_native`), which
`register_builtins()` (modelfleet.dataplane.registration) makes the op's implementation on every device."""

from modelfleet.dataplane.layers.activation import SiluAndMul
from modelfleet.dataplane.layers.linear import Linear, MergedLinear, make_linear
from modelfleet.dataplane.layers.norm import RMSNorm
from modelfleet.dataplane.layers.rotary import RotaryEmbedding, compute_inv_freq

__all__ = [
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "compute_inv_freq",
    "make_linear",
]
