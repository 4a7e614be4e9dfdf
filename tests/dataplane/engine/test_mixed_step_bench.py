"""bench/mixed_step.py on the CPU (a smoke run of the GPU bench): the pure-decode baseline and a case that
admits prompts, with the admitting steps counted apart; and the device-copy helper the eager steps use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from modelfleet.dataplane.engine.device_copy import to_device

BENCH = Path(__file__).parents[3] / "bench" / "mixed_step.py"


def test_the_bench_times_admitting_steps_against_pure_decodes(tiny_model_dir):
    command = [sys.executable, str(BENCH), "--model", str(tiny_model_dir), "--num-seqs", "8"]
    command += ["--admit", "0", "2", "--every", "4", "--steps", "12", "--prompt-len", "16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pure, admitting = result["cases"]
    assert (pure["admitted_per_step"], pure["admitting_steps"], pure["launch_ms_admitting"]) == (0, 0, None)
    assert admitting["admitting_steps"] == 3  # steps 0, 4 and 8 of 12
    assert admitting["launch_ms_admitting"] > 0 and result["vs_pure_decode"][0] == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --drain runs there")
def test_drain_without_a_gpu_is_refused_clearly(tiny_model_dir):
    command = [sys.executable, str(BENCH), "--model", str(tiny_model_dir), "--drain"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode != 0 and "--drain: needs a CUDA device" in done.stderr


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_data_reaches_the_device_unchanged(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    array = np.arange(1000, dtype=np.int64)[::2]  # not contiguous
    tensor = torch.arange(7, dtype=torch.int32)
    moved = [to_device(array, torch.device(device)), to_device(tensor, torch.device(device))]
    assert all(m.device.type == device for m in moved)
    assert moved[0].cpu().tolist() == array.tolist() and moved[1].cpu().tolist() == tensor.tolist()
