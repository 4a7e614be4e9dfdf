"""Small cases of every Triton kernel, run on the CPU under Triton's interpreter (TRITON_INTERPRET=1), so
that CI runs the kernels' code and not only their references. One pytest runs them all: the small ops'
cases listed here and each GEMV module's INTERPRETER_CASES (starting it costs ~7 s of imports).

The interpreter must be on before the kernel modules are imported (`triton.jit` reads it then), and no
GPU may be visible, so the cases run in a pytest of their own. float32 only: the interpreter rounds
float32 -> bfloat16 by truncation, not to nearest as a GPU does, so exact bf16 comparisons would fail
for reasons of the interpreter's own. The full matrix runs on a GPU:
`.venv/bin/python -m pytest -q tests/dataplane/kernels`.
"""

from __future__ import annotations

from pathlib import Path

from tests.dataplane.kernels import (
    test_kernel_gemv_norm,
    test_kernel_gemv_silu,
    test_kernel_int8_matmul,
    test_kernel_quant_gemv,
)
from tests.dataplane.kernels.interpreter import InterpreterRun, assert_passed, skip_under_the_interpreter

SMALL_OPS_CASES = [
    "test_kernel_small_ops.py::test_rms_norm_matches_reference[False-1-64-dtype2]",
    "test_kernel_small_ops.py::test_rms_norm_matches_reference[True-83-64-dtype2]",
    "test_kernel_small_ops.py::test_rotary_matches_reference[False-12-4-80-dtype2]",
    "test_kernel_small_ops.py::test_silu_and_mul_matches_reference[shape2-dtype2]",
    "test_kernel_kv_write.py::test_write_kv_matches_reference[3-80-16-dtype2]",
    "test_kernel_rotary_kv_write.py::test_matches_rotary_then_write_kv[7-14-2-64-dtype2]",
    "test_kernel_decode_attention.py::test_decode_matches_reference[short-64-12-2-dtype2]",
    # a batch of rows with cached prefixes and a decode row, and one of prompts alone (the "mixed"
    # workload's 4,500-token context took ~23 s there)
    "test_kernel_extend_attention.py::test_extend_matches_reference[cached_prefix-64-12-2-dtype2]",
    "test_kernel_extend_attention.py::test_extend_matches_reference[prefill-64-12-2-dtype2]",
    # fp8 KV cache reads only: Triton 3.7's interpreter rounds float32 -> e4m3 without carrying a mantissa
    # overflow into the exponent (1.98 -> 1.0), so the fp8 writes are checked on a GPU and the CPU's
    # quantize (attention/kv_quant.py) in tests/dataplane/engine/test_fp8_kv_cache.py.
    "test_kernel_fp8_kv.py::test_decode_reads_the_dequantized_cache[12-2-64-4-0.004-0.0075-dtype1]",
    "test_kernel_fp8_kv.py::test_extend_reads_the_dequantized_cache[12-2-64-0.004-0.0075-dtype1]",
    "test_kernel_fp8_kv.py::test_bad_scales_are_refused",
    "test_kernel_sampling.py::test_greedy_is_torch_argmax[False-1000-3-dtype2]",
    "test_kernel_sampling.py::test_nan_rows_are_flagged_and_others_not[1000-dtype2]",
    "test_kernel_sampling.py::test_a_bitmask_limits_each_row_to_its_allowed_tokens[1000]",
    "test_kernel_sampling.py::test_a_bad_bitmask_is_refused",
    "test_kernel_host_signal.py::test_a_wait_goes_on_once_its_number_is_released",
]


GEMV_MODULES = [test_kernel_quant_gemv, test_kernel_gemv_silu, test_kernel_gemv_norm, test_kernel_int8_matmul]


def interpreter_cases() -> tuple[list[str], int]:
    """The node ids to run and how many cases they pass."""
    cases = list(SMALL_OPS_CASES)
    passed = len(SMALL_OPS_CASES)
    for module in GEMV_MODULES:
        name = Path(module.__file__).name
        cases += [f"{name}::{case}" for case in module.INTERPRETER_CASES]
        # a case naming a parametrized test as a whole expands to its parameters
        passed += getattr(module, "INTERPRETER_PASSED", len(module.INTERPRETER_CASES))
    return cases, passed


def test_kernel_cases_pass_under_the_triton_interpreter(interpreter_run):
    import triton  # noqa: F401  (a dev dependency: `pip install -e '.[dev]'`)

    skip_under_the_interpreter()
    run = interpreter_run or InterpreterRun(interpreter_cases()[0])
    assert_passed(run, interpreter_cases()[1])
