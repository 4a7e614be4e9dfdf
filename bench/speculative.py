"""Speculative decoding against plain decoding, in one run: n-gram and draft-model proposers at several
batch sizes, one JSON line per case (plain included), each with the plain engine's tok/s of the same run.

    python bench/speculative.py --device cuda --preset llama-3.2-1b            # about 90 s on an H100
    python bench/speculative.py --device cpu --preset tiny --batch-sizes 1,2 --output-len 8

The target is a random-weight checkpoint of the preset's shape (llama-3.2-1b: the real model's shapes,
bf16) built in a temporary folder, with one change: every layer's output projections (attention's
o_proj and the MLP's down_proj) are zero. The layers still run all their matmuls and KV reads, so a
step costs what the real model's does, but they add nothing to the residual stream: the model maps
its last token's embedding through the final norm to the tied unembedding, whose largest logit is that
same token. Its greedy output is the prompt's last token repeated, a loop that the n-gram proposer
finds from the first output token on: the n-gram rows show what speculation gains when drafts are
nearly always right (the best case), not what a real model's text gives.

The draft model is a smaller random model of the same vocabulary (default initialization, its layers
not zeroed: 2 layers, hidden size 512 on llama-3.2-1b). Nothing makes it agree with the target: it
agrees where it too happens to repeat its last token (the smaller a random model, the more its
embedding outweighs what its layers add; the tiny CPU preset's draft does, all the time). Its
acceptance rate is reported as measured; it says nothing of a trained draft of a trained target.

Prompts are random token ids (--input-len each); every request generates --output-len tokens (EOS
ignored), greedy. Each line: tok/s (output tokens over the generate call's wall time), the plain
engine's tok/s at that batch size and the ratio, acceptance rate (draft tokens accepted / proposed)
and mean accepted length (tokens a sequence gains per verify step, the target's own included).
Speculating steps do not overlap the host's work with the device's (see dataplane/engine/speculative.py),
while plain decoding does: that is part of what is measured. Verify steps and the draft's one-token
forwards replay CUDA graphs; a draft's first forward of each step runs eagerly.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TARGETS: dict[str, dict] = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    ),
}  # fmt: skip
DRAFTS: dict[str, dict] = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16,
    ),
}  # fmt: skip


def build_model(shape: dict, out_dir: Path, device: str, dtype: torch.dtype, *, echo: bool, seed: int) -> str:
    """A random-weight tied-embedding Llama checkpoint; `echo`: output projections zeroed (see above)."""
    import transformers

    config = transformers.LlamaConfig(
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=None, eos_token_id=None, **shape,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    if echo:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return str(out_dir)


def run_case(
    model: str, settings: dict, prompts: list[list[int]], batch_sizes: list[int], output_len: int
) -> list[dict]:
    """One engine, each batch size in turn: tok/s and the speculation counters of that batch's run."""
    from modelfleet.dataplane import LLM, SamplingParams

    llm = LLM(model, **settings)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4))  # warm-up
    rows = []
    for batch in batch_sizes:
        before = llm.stats()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts[:batch], params)
        elapsed = time.perf_counter() - start
        after = llm.stats()
        assert [len(o.token_ids) for o in outputs] == [output_len] * batch
        drafts = after.spec_num_drafts - before.spec_num_drafts
        proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        rows.append(
            {
                "batch": batch,
                "tok_s": round(batch * output_len / elapsed, 1),
                "seconds": round(elapsed, 3),
                "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
                "mean_accepted_length": round((accepted + drafts) / drafts, 3) if drafts else None,
                "draft_tokens": proposed,
            }
        )
    llm.engine.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="llama-3.2-1b", choices=sorted(TARGETS))
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--proposers", default="ngram,draft")
    parser.add_argument("--work-dir", default=None, help="where the checkpoints go (default: a temp dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-spec-"))
    target = build_model(TARGETS[args.preset], work / "target", args.device, dtype, echo=True, seed=0)
    draft = build_model(DRAFTS[args.preset], work / "draft", args.device, dtype, echo=False, seed=1)

    vocab = TARGETS[args.preset]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=args.input_len).tolist() for _ in range(max(batch_sizes))]
    k = args.num_speculative_tokens
    base = dict(
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_num_seqs=max(batch_sizes),
        max_model_len=args.input_len + args.output_len + k + 16,
        kv_cache_memory_fraction=0.3,
        kv_cache_bytes=1 << 26,
    )
    cases = {"none": {}}
    for proposer in args.proposers.split(","):
        cases[proposer] = dict(speculative_proposer=proposer, num_speculative_tokens=k)
        if proposer == "draft":
            cases[proposer]["speculative_draft_model"] = draft
    results = {
        name: run_case(target, base | extra, prompts, batch_sizes, args.output_len)
        for name, extra in cases.items()
    }
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for name, rows in results.items():
        for row, plain in zip(rows, results["none"], strict=True):
            line = {
                "bench": "speculative",
                "preset": args.preset,
                "device": device_name,
                "proposer": name,
                "num_speculative_tokens": 0 if name == "none" else k,
                "input_len": args.input_len,
                "output_len": args.output_len,
                **row,
                "plain_tok_s": plain["tok_s"],
                "speedup": round(row["tok_s"] / plain["tok_s"], 3),
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
