"""The data plane's own implementations, registered by one explicit call when a model is loaded (engine
start), so that importing a module registers nothing.

`register_builtins()`: the torch attention backend; the Triton one where Triton is installed; and where
Triton can run (Triton and a GPU), the Triton kernels as the "cuda" model ops. A name registered already
(a user's own backend or op) keeps its implementation. On the CPU nothing of Triton is imported.
"""

from __future__ import annotations

import importlib.util


def register_builtins() -> None:
    from modelfleet.dataplane.attention.backend import available_backends, register_backend
    from modelfleet.dataplane.attention.torch_paged import TorchPagedAttention
    from modelfleet.dataplane.kernels.registry import register_triton_ops

    backends = available_backends()
    if "torch" not in backends:
        register_backend("torch")(TorchPagedAttention)
    if "triton" not in backends and importlib.util.find_spec("triton") is not None:
        # The backend's module loads its kernels (and Triton) on first use only.
        from modelfleet.dataplane.attention.triton_paged import TritonPagedAttention

        register_backend("triton")(TritonPagedAttention)
    register_triton_ops(keep=True)
