"""One step's grammar bitmask fill for N constrained rows: the grammar process's split fill (its rows over
threads of its own, grammar_process._SplitFill) against xgrammar's own thread pool (a BatchGrammarMatcher
of as many threads, the baseline) and one thread, in one run. Prints one JSON line of median ms per fill.

The rows' matchers are walked to random depths of bench/serve.py's records schema with random allowed
tokens, as sampled answers walk them. The default tokenizer is the 1B preset's byte-level BPE for
--structured (~128k ids, trained once, ~1 min); --model takes a checkpoint's own.

    python bench/grammar_fill.py --rows 64 --threads 2 4 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch


def walked_matchers(model_dir: Path, rows: int, seed: int) -> tuple[list, int, dict]:
    """`rows` matchers of the records schema at random depths, the bitmask's words, and the sizes."""
    from modelfleet.dataplane.engine.structured import Grammars, bitmask_layout
    from serve import SCHEMAS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tokenizer, vocab_size, frozenset({tokenizer.eos_token_id or 0}))
    compiled = grammars.compile(("json_schema", json.dumps(SCHEMAS["records"]))).result()
    grammars.close()
    words = bitmask_layout(compiled.vocab).words
    rng = random.Random(seed)
    bits = torch.empty((1, words), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    matchers = []
    for _ in range(rows):
        grammar = Grammars.matcher(compiled)
        for _ in range(rng.randrange(10, 120)):
            grammar.matcher.fill_next_token_bitmask(bits)
            allowed = ((bits[0].unsqueeze(1) >> shifts) & 1).flatten()[: compiled.vocab.size].nonzero()
            if not grammar.matcher.accept_token(rng.choice(allowed.flatten().tolist())):
                break
            if grammar.matcher.is_terminated():
                break
        matchers.append(grammar.matcher)
    return matchers, words, {"model_vocab": vocab_size, "grammar_vocab": compiled.vocab.size}


def median_ms(fill, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def preset_tokenizer_dir(root: Path) -> Path:
    """A folder with the 1B preset's config and bench/serve.py's byte-level BPE tokenizer of its size
    (trained once, then kept under `root`)."""
    from serve import with_bpe_tokenizer

    model = root / "grammar-fill-preset"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 128256, "max_position_embeddings": 4096}))
    return with_bpe_tokenizer(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument(
        "--model", type=Path, help="a checkpoint whose tokenizer to use (default: the preset's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--demo-dir", type=Path, default=Path(".modelfleet/bench"), help="where the tokenizer is kept"
    )
    args = parser.parse_args(argv)
    import xgrammar
    from modelfleet.dataplane.engine.grammar_process import _SplitFill

    model_dir = args.model or preset_tokenizer_dir(args.demo_dir)
    matchers, words, sizes = walked_matchers(model_dir, args.rows, args.seed)
    bitmask = torch.empty((args.rows, words), dtype=torch.int32)
    rows = list(range(args.rows))
    one = xgrammar.BatchGrammarMatcher(max_threads=1)
    line: dict = {"bench": "grammar_fill", "rows": args.rows, **sizes}
    line["one_thread_ms"] = median_ms(
        lambda: one.batch_fill_next_token_bitmask(matchers, bitmask), args.repeats
    )
    for threads in args.threads:
        pool = xgrammar.BatchGrammarMatcher(max_threads=threads)
        split = _SplitFill(xgrammar, threads)
        line[f"xgrammar_pool_{threads}_ms"] = median_ms(
            lambda pool=pool: pool.batch_fill_next_token_bitmask(matchers, bitmask), args.repeats
        )
        line[f"split_{threads}_ms"] = median_ms(
            lambda split=split: split(matchers, bitmask, rows), args.repeats
        )
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve.py's schemas and tokenizer
    sys.exit(main())
