"""bench/gemv_sass.py reads the GEMV's machine code without a GPU: Triton compiles for a named target and
its own nvdisasm disassembles. Checked on the int8 decode launch the 1B qkv projection takes."""

from __future__ import annotations

import json


def test_the_k_loop_of_a_hopper_build_is_found_and_counted(bench_scripts, capsys):
    import gemv_sass

    assert gemv_sass.main(["--weights", "int8", "--config", "4,512,4", "--config", "16,1024,8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["block_n"], r["block_k"], r["num_warps"]) for r in lines] == [(4, 512, 4), (16, 1024, 8)]
    for line in lines:
        assert line["arch"] == "sm_90" and line["spill_stores"] == 0
        # every weight costs at least its multiply-add; a loop that is not the K loop would be far off
        assert 1 <= line["instructions_per_weight"] < 20, line
        assert line["top_opcodes"].get("FFMA", 0) > 0
    # more rows a program share each load and decode of x: fewer instructions a weight
    assert lines[1]["instructions_per_weight"] < lines[0]["instructions_per_weight"]


def test_a_fused_norm_is_compiled_in(bench_scripts, capsys):
    import gemv_sass

    gemv_sass.main(["--weights", "int8", "--config", "4,1024,4"])
    gemv_sass.main(["--weights", "int8", "--config", "4,1024,4", "--fusion", "norm"])
    plain, norm = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert norm["fusion"] == "norm" and norm["loop_instructions"] > plain["loop_instructions"]
