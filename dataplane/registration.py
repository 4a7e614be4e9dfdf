"""The data plane's own implementations, registered by one explicit call when a model is loaded (engine
start), so that importing a module registers nothing.

`register_builtins()`: the layers' torch references as the ops of every device ("*"); the torch attention
backend; the Triton one where Triton is installed; and where Triton can run (Triton and a GPU), the
Triton kernels as the "cuda" model ops. A name registered already (a user's own backend or op) keeps its
implementation, so calling it again changes nothing. On the CPU nothing of Triton is imported.
"""

from __future__ import annotations

import importlib.util


def register_builtins() -> None:
    from modelfleet.dataplane.attention.backend import available_backends, register_backend
    from modelfleet.dataplane.attention.torch_paged import TorchPagedAttention
    from modelfleet.dataplane.kernels.registry import register_triton_ops

    register_torch_ops()
    backends = available_backends()
    if "torch" not in backends:
        register_backend("torch")(TorchPagedAttention)
    if "triton" not in backends and importlib.util.find_spec("triton") is not None:
        # The backend's module loads its kernels (and Triton) on first use only.
        from modelfleet.dataplane.attention.triton_paged import TritonPagedAttention

        register_backend("triton")(TritonPagedAttention)
    register_triton_ops(keep=True)


def register_torch_ops() -> None:
    """The layers' torch references, each the op's implementation on any device without its own."""
    from modelfleet.dataplane.layers.activation import silu_and_mul_native
    from modelfleet.dataplane.layers.linear import linear_native
    from modelfleet.dataplane.layers.norm import fused_add_rms_norm_native, rms_norm_native
    from modelfleet.dataplane.layers.rotary import rotary_embedding_native
    from modelfleet.dataplane.ops import ANY_DEVICE, register_op, registered_ops

    references = {
        "rms_norm": rms_norm_native,
        "fused_add_rms_norm": fused_add_rms_norm_native,
        "rotary_embedding": rotary_embedding_native,
        "silu_and_mul": silu_and_mul_native,
        "linear": linear_native,
    }
    present = registered_ops()
    for name, fn in references.items():
        if (name, ANY_DEVICE) not in present:
            register_op(name)(fn)
