"""SiLU-and-mul: x [..., 2I] -> silu(gate) * up in one pass (the gated MLP's activation).

With programmatic dependent launch (Hopper and newer) the kernel is scheduled while its predecessor (the
gate/up projection) drains and waits for it before reading x.
"""

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.kernels.availability import pdl_supported

BLOCK = 1024


@triton.jit
def silu_and_mul_f32(gate, up):
    """silu(gate) * up in float32 from model-dtype gate and up; silu is rounded to the model dtype before
    the product, as silu(gate) * up does unfused. Shared with the GEMV that fuses it (kernels/gemv.py), so
    both round alike."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return act * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter_size, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = silu_and_mul_f32(gate, up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    inter_size = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        raise ValueError("silu_and_mul: x needs a contiguous last dimension")
    out = x.new_empty(*x.shape[:-1], inter_size) if out is None else out
    out2 = out.view(-1, inter_size)
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(inter_size, BLOCK))
        use_pdl = pdl_supported(x.device)
        _silu_and_mul_kernel[grid](
            x2,
            out2,
            x2.stride(0),
            out2.stride(0),
            inter_size,
            BLOCK=BLOCK,
            USE_PDL=use_pdl,
            num_warps=4,
            launch_pdl=use_pdl,
        )
    return out
