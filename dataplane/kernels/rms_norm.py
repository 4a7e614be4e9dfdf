"""Fused RMSNorm, optionally with the residual add in the same pass (one read, one or two writes).

With programmatic dependent launch (Hopper and newer) the kernel is scheduled while its predecessor
drains: it loads its weight (never written by a previous kernel) first, then waits for the predecessor
before touching x or the residual, and lets its own successor launch once it has read its row.
"""

import torch
import triton
import triton.language as tl
from modelfleet.dataplane.kernels.availability import next_power_of_2, pdl_supported


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:  # x and the residual may come from the previous kernel
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_RESIDUAL:
        # round the sum to the model dtype first, as an unfused `x + residual` would
        summed = (x.to(tl.float32) + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / hidden_size + eps)
    normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., H]; with `residual`, of x + residual, returning (out, sum).

    `out` may be x and `residual_out` may be residual (each program reads its row before writing it).
    """
    hidden_size = x.shape[-1]
    x2 = x.reshape(-1, hidden_size)
    if x2.stride(-1) != 1:
        raise ValueError("rms_norm: x needs a contiguous last dimension")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    out2 = out.view(-1, hidden_size)
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        r2, ro2 = residual.reshape(-1, hidden_size), residual_out.view(-1, hidden_size)
    else:
        r2 = ro2 = x2  # unused
    rows = x2.shape[0]
    if rows:
        block = next_power_of_2(hidden_size)
        use_pdl = pdl_supported(x.device)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out2,
            ro2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            ro2.stride(0),
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            USE_PDL=use_pdl,
            num_warps=min(16, max(1, block // 512)),
            launch_pdl=use_pdl,
        )
    return out if residual is None else (out, residual_out)
