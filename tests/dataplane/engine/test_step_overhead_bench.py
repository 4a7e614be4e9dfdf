"""bench/step_overhead.py --relayed: both runs in one line, each with the engine process's routing timed,
the text decoded in the engine first, then in the relay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[3] / "bench" / "step_overhead.py"


def test_the_relayed_bench_times_both_places_of_the_text(tiny_model_dir):
    command = [sys.executable, str(BENCH), "--relayed", "--num-seqs", "8", "--steps", "5", "--warmup", "2"]
    done = subprocess.run(
        [*command, "--model", str(tiny_model_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["relayed"] and result["num_seqs"] == 8
    for run in (result["text_in_engine"], result["text_in_relay"]):
        assert run["host_cpu_ms"] >= run["route_cpu_ms"] > 0 and run["host_cpu_ms"] >= run["total_cpu_ms"]
    assert result["host_cpu_ratio"] > 0
