"""Weight quantization shared by the converters (which write it) and the engine (which runs it).

Checkpoint format (config.json `quantization_config = {"quant_method": "modelfleet", "format": "int8"|"fp8",
"group": "per-channel"}`): each quantized Linear weight `X.weight` [out, in] is stored as int8 or
float8_e4m3fn, with `X.weight_scale` float32 [out] such that weight ~= X.weight * X.weight_scale[:, None].
Scales are symmetric per output channel: int8 maps max|row| to 127, fp8 maps it to 448 (e4m3's largest).
`"lm_head": true` (opt-in) adds `lm_head.weight` (per vocabulary row), also for tied embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANT_FORMATS = ("int8", "fp8")
INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_TINY = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero
FP8_MIN_CAPABILITY = (8, 9)
_ALIGN = 64  # bytes  # Ada (L4) and Hopper (H100, H200) compute in e4m3
# Up to this many tokens (decode) a CUDA QuantizedLinear runs the GEMV that reads the 1-byte weight and its
# scales directly (modelfleet.dataplane.kernels.gemv): one program multiplies up to 4 rows of x, so the
# weight is still read once; more tokens (prefill, large decode batches) take the matmul paths below.
GEMV_MAX_TOKENS = 4


class QuantizationError(RuntimeError):
    """A quantized format cannot run here (e.g. fp8 without a capable GPU)."""


def _row_absmax(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D [out, in] to quantize per channel, got shape {tuple(weight.shape)}"
        )
    return weight.detach().float().abs().amax(dim=1).clamp_min(_TINY)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8: (int8 [out, in], float32 scale [out])."""
    scale = _row_absmax(weight) / INT8_MAX
    q = torch.round(weight.detach().float() / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel float8 e4m3: (float8_e4m3fn [out, in], float32 scale [out])."""
    scale = _row_absmax(weight) / FP8_MAX
    q = (weight.detach().float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "int8":
        return quantize_int8(weight)
    if fmt == "fp8":
        return quantize_fp8(weight)
    raise ValueError(f"quantization format {fmt!r} is unknown; use one of: {', '.join(QUANT_FORMATS)}")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The floating weight a quantized one stands for: q * scale per output channel, in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def dequantize_to(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize() in two kernels on the tensor's device (no float32 copy of the whole matrix)."""
    return q.to(dtype) * scale.to(dtype)[:, None]


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3 of activations [M, K]: (fp8 [M, K], float32 scale [M, 1]). One Triton kernel on
    CUDA (the torch ops are seven launches, which cost more than the matmul when decoding)."""
    kernel = _triton_fp8_rows_kernel() if x.is_cuda else None
    if kernel is None or x.shape[1] > 32768:
        scale = x.detach().float().abs().amax(dim=1, keepdim=True).clamp_min(_TINY) / FP8_MAX
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    import triton

    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    kernel[(m,)](x, out, scale, k, x.stride(0), FP8_MAX, _TINY, BLOCK=triton.next_power_of_2(k))
    return out, scale


def fp8_supported(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY and hasattr(torch, "_scaled_mm")


def check_fp8_supported(device: torch.device | str) -> None:
    """Raise QuantizationError (one line) unless fp8 matmuls run on `device`; call it when loading a model."""
    if fp8_supported(device):
        return
    where = str(device)
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    raise QuantizationError(
        f"fp8 weights need a CUDA GPU with compute capability >= 8.9 (L4, H100, H200); {where} has none: "
        "serve the int8 or bf16 artifact instead"
    )


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T + b for a per-channel quantized weight, without materializing dequant(W).

    Decode on CUDA (up to GEMV_MAX_TOKENS bf16/fp16 rows): a Triton GEMV reads the int8 or e4m3 weight and
    its scales in its inner loop, activations unquantized. Otherwise int8: weight-only; a Triton matmul on
    CUDA, torch._weight_int8pack_mm on the CPU, with a dequantize-then-matmul fallback. fp8: activations
    are scaled to e4m3 per token and torch._scaled_mm multiplies on fp8 tensor cores. fp8 anywhere without
    fp8 refuses with QuantizationError.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fmt: str = "int8") -> None:
        super().__init__()
        if fmt not in QUANT_FORMATS:
            raise ValueError(
                f"quantization format {fmt!r} is unknown; use one of: {', '.join(QUANT_FORMATS)}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        qdtype = torch.int8 if fmt == "int8" else FP8_DTYPE
        # Buffers, not parameters: quantized weights are never trained, and load_state_dict(assign=True)
        # keeps their dtype.
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=qdtype))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._use_int8pack = True
        self._rowwise_fp8 = True
        self._fp8_checked = False

    @classmethod
    def from_float(cls, linear: nn.Linear, fmt: str) -> QuantizedLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt)
        q, scale = quantize(linear.weight, fmt)
        module.weight = q.to(linear.weight.device)
        module.weight_scale = scale.to(linear.weight.device)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self._gemv_applies(x2):
            from modelfleet.dataplane.kernels import gemv

            y = gemv.gemv(x2, self.weight, self.bias, scale=self.weight_scale)
            return y.reshape(*shape[:-1], self.out_features)
        y = self._int8(x2) if self.fmt == "int8" else self._fp8(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _gemv_applies(self, x: torch.Tensor) -> bool:
        if not (x.is_cuda and x.shape[0] <= GEMV_MAX_TOKENS and x.dtype in (torch.bfloat16, torch.float16)):
            return False
        if self.fmt == "fp8" and not self._fp8_checked:
            check_fp8_supported(x.device)  # Triton converts e4m3 only where the GPU has it
            self._fp8_checked = True
        if _triton_int8_kernel() is None:  # no Triton
            return False
        scale = self.weight_scale
        return self.weight.stride(1) == 1 and scale.dtype == torch.float32 and scale.is_contiguous()

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            # The Triton kernel reads the int8 weight once and converts it in registers; without Triton,
            # dequantize once per call and let cuBLAS multiply (correct, but it reads more bytes than bf16).
            if _triton_int8_kernel() is not None:
                return int8_weight_only_matmul(x, self.weight, self.weight_scale)
            return F.linear(x, dequantize_to(self.weight, self.weight_scale, x.dtype))
        if self._use_int8pack and not x.is_cuda:  # torch's CUDA int8pack kernel is far slower than bf16
            # The CPU kernel reads the weight with aligned vector loads and crashes on an unaligned one,
            # which is what an mmap-loaded safetensors tensor often is: copy it once into aligned memory.
            if self.weight.data_ptr() % _ALIGN:
                self.weight = self.weight.clone()
            try:
                return torch._weight_int8pack_mm(x.contiguous(), self.weight, self.weight_scale.to(x.dtype))
            except (RuntimeError, NotImplementedError):
                self._use_int8pack = False  # this device/dtype lacks the kernel: fall back for good
        return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype))

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fp8_checked:
            check_fp8_supported(x.device)
            self._fp8_checked = True
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        # Per-token activation scales (dynamic): e4m3 has little precision, so each row uses its full range.
        x_fp8, x_scale = quantize_rows_fp8(x)
        w_t = self.weight.t()  # [in, out], column-major as _scaled_mm wants
        if self._rowwise_fp8:
            try:
                y = torch._scaled_mm(
                    x_fp8, w_t, scale_a=x_scale, scale_b=self.weight_scale[None, :], out_dtype=out_dtype
                )
                return y.to(x.dtype)
            except RuntimeError:
                self._rowwise_fp8 = False  # row-wise scaling needs Hopper; Ada takes the tensor-wise path
        # Tensor-wise scales inside the matmul, the per-row and per-channel ones applied to the output.
        one = torch.ones((), device=x.device, dtype=torch.float32)
        y = torch._scaled_mm(x_fp8, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (y * x_scale * self.weight_scale[None, :]).to(x.dtype)


# ---- CUDA: weight-only int8 matmul in Triton (int8 weights converted to bf16/fp16 in registers) ----
# torch has no fast weight-only int8 GEMM on CUDA; reading int8 instead of bf16 halves the bytes that
# bound decode, so the kernel streams the int8 weight once and scales each output channel at the end.
#
# Autotuned once per (bucket of M, N, K). Up to INT8_SMALL_M_BUCKET rows (decode batches) the candidates
# are the ones these buckets always had (16-row tiles, and four of 64 or 128 rows), the weight the dot's
# right operand. From 128 rows on (large decode batches, prefill) the matmul is compute-bound, so the
# candidates are Hopper-sized tiles in two orders: the weight on the right, or on the left
# (y.T = W @ x.T). On the left, Triton's wgmma takes the converted weight tile from registers ("RS"),
# after a pipelined copy of the int8 bytes into shared memory; on the right, the converted tile must be
# written back to shared memory every step before the MMA can read it.
# Programs go in groups of GROUP_M row tiles, so that a wave shares its weight and x tiles in L2.

INT8_SMALL_M_BUCKET = 64
_INT8_M_BUCKETS = (16, 64, 128, 256, 512)  # then 1024: every larger M (prefill chunks)

_KERNEL: list = []  # [kernel or None], built on first use
_FP8_ROWS_KERNEL: list = []


def int8_m_bucket(m: int) -> int:
    """The autotune key's M: one tuning per bucket, never one per batch size."""
    return next((b for b in _INT8_M_BUCKETS if m <= b), 1024)


# BLOCK_M 16: (BLOCK_N, BLOCK_K, num_warps, num_stages)
_INT8_SMALL_M_TILES = ((32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 4, 5), (128, 128, 4, 4), (128, 64, 8, 4))


def _int8_configs(triton) -> list:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, WEIGHT_LHS) candidates; see int8_configs_for."""
    small_m = [(16, bn, bk, w, st, False) for bn, bk, w, st in _INT8_SMALL_M_TILES]
    large_m = [
        (64, 64, 128, 4, 4, False),
        (64, 128, 64, 4, 4, False),
        (128, 128, 64, 8, 3, False),
        (128, 256, 64, 8, 3, False),
        # the weight on the left: BLOCK_N is the wgmma's M (a multiple of 64 per warpgroup); the
        # narrower tiles keep all SMs busy when M is a few hundred rows and N is 4096
        (32, 128, 128, 4, 4, True),
        (64, 64, 128, 4, 4, True),
        (64, 128, 128, 4, 4, True),
        (128, 128, 64, 8, 4, True),
        (128, 128, 128, 8, 3, True),
        (128, 256, 64, 8, 3, True),
        (256, 128, 64, 8, 3, True),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "WEIGHT_LHS": lhs},
            num_warps=w,
            num_stages=st,
        )
        for bm, bn, bk, w, st, lhs in small_m + large_m
    ]


def int8_configs_for(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's candidates for one M bucket: small buckets keep every weight-on-the-right config
    (what they have always been tuned over); from 128 rows on, the weight on the left or tiles of 64+ rows."""
    if named_args["M_BUCKET"] <= INT8_SMALL_M_BUCKET:
        return [c for c in configs if not c.kwargs["WEIGHT_LHS"]]
    return [c for c in configs if c.kwargs["WEIGHT_LHS"] or c.kwargs["BLOCK_M"] >= 64]


def _triton_int8_kernel():
    if _KERNEL:
        return _KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNEL.append(None)
        return None

    @triton.autotune(
        configs=_int8_configs(triton),
        key=["M_BUCKET", "N", "K"],
        prune_configs_by={"early_config_prune": int8_configs_for},
    )
    @triton.jit  # named: a profile of an int8 model lists this kernel per linear layer
    def int8_matmul_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, M_BUCKET, stride_xm, stride_wn, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, WEIGHT_LHS: tl.constexpr):  # fmt: skip
        # Grouped order: GROUP_M row tiles share each column of weight tiles while it is in L2.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // tiles_in_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % tiles_in_group) % group_rows
        pid_n = (pid % tiles_in_group) // group_rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if WEIGHT_LHS:  # constexpr: each config compiles one order; both end in acc [BLOCK_M, BLOCK_N]
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                w = tl.load(
                    w_ptr + rn[:, None] * stride_wn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0,
                )
                x = tl.load(
                    x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0,
                )
                acc_t += tl.dot(w.to(x.dtype), tl.trans(x))  # y.T tile = W tile @ x tile.T
            acc = tl.trans(acc_t)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                x = tl.load(
                    x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0,
                )
                w = tl.load(  # [BLOCK_K, BLOCK_N] view of the [N, K] weight
                    w_ptr + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0,
                )
                acc += tl.dot(x, w.to(x.dtype))
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        acc = acc * scale[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    _KERNEL.append(int8_matmul_kernel)
    return int8_matmul_kernel


def int8_matmul_grid(m: int, n: int):
    """The launch grid for a config's meta-parameters: one program per output tile."""

    def grid(meta):
        tiles_m = (m + meta["BLOCK_M"] - 1) // meta["BLOCK_M"]
        return (tiles_m * ((n + meta["BLOCK_N"] - 1) // meta["BLOCK_N"]),)

    return grid


def int8_weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (weight [N, K] int8 * scale [N]).T on CUDA, in x's dtype."""
    kernel = _triton_int8_kernel()
    x = x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    kernel[int8_matmul_grid(m, n)](
        x, weight, scale, y, m, n, k, int8_m_bucket(m), x.stride(0), weight.stride(0), y.stride(0)
    )
    return y


def _triton_fp8_rows_kernel():
    if _FP8_ROWS_KERNEL:
        return _FP8_ROWS_KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _FP8_ROWS_KERNEL.append(None)
        return None

    @triton.jit  # named: a profile of an fp8 model lists this kernel per linear layer
    def fp8_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, fp8_max, tiny, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), tiny) / fp8_max
        q = tl.clamp(x / scale, -fp8_max, fp8_max)
        tl.store(out_ptr + row * K + cols, q.to(out_ptr.dtype.element_ty), mask=cols < K)
        tl.store(scale_ptr + row, scale)

    _FP8_ROWS_KERNEL.append(fp8_rows_kernel)
    return fp8_rows_kernel
