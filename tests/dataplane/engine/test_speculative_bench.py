"""bench/speculative.py on the CPU with its tiny preset: one JSON line per proposer and batch size, each
with the plain engine's figure of the same run; on the echoing target the n-gram drafts are right."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_benchmark_prints_a_line_per_case(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[3] / "bench"))
    import speculative

    argv = ["--device", "cpu", "--preset", "tiny", "--batch-sizes", "1,3", "--input-len", "24"]
    assert speculative.main([*argv, "--output-len", "12", "--work-dir", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    cases = {(line["proposer"], line["batch"]): line for line in lines}
    assert sorted(cases) == [(p, b) for p in ("draft", "ngram", "none") for b in (1, 3)]
    for (proposer, batch), line in cases.items():
        assert line["plain_tok_s"] == cases["none", batch]["tok_s"] > 0
        assert line["speedup"] == round(line["tok_s"] / line["plain_tok_s"], 3)
        if proposer == "none":
            assert line["acceptance_rate"] is None and line["draft_tokens"] == 0
        else:
            assert line["draft_tokens"] > 0 and 0 <= line["acceptance_rate"] <= 1
            assert 1 <= line["mean_accepted_length"] <= 1 + line["num_speculative_tokens"]
    # The target repeats its last token: the n-gram proposer drafts that loop, and it is accepted.
    assert cases["ngram", 3]["acceptance_rate"] > 0.9
    assert cases["ngram", 3]["mean_accepted_length"] > 3
