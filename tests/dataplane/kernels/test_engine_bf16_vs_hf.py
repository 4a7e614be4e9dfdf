"""On a GPU in bf16, a Llama-3.2-1B-shaped model on the engine (Triton backend) agrees with Hugging Face
transformers by the logprob-closeness criterion: tokens equal until the first difference, and there
each side's token is among the other's top logprobs (bf16 rounding may legitimately flip near-ties:
the logits themselves are bf16, as in Hugging Face, so two of them a single bf16 step apart can swap).
On every step up to and including the first difference (the same prefix on both sides), the logprob
values of our top tokens equal transformers' within a bf16 tolerance.

    .venv/bin/python -m pytest -q -s tests/dataplane/kernels/test_engine_bf16_vs_hf.py   # on a CUDA GPU
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32
TOP = 5
# |our logprob - transformers' bf16 logprob| allowed on a step with the same prefix: a few bf16 steps of
# the logits (~0.004-0.06 for |logit| in 0.5..16), or twice what transformers' own bf16 drifts from its
# float32 on those steps, whichever is larger.
LOGPROB_ATOL_BF16 = 0.1
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)  # fmt: skip


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    long = torch.randint(10, 128000, (400,), generator=g).tolist()
    short = [torch.randint(10, 128000, (n,), generator=g).tolist() for n in (1, 17, 160)]
    return [*short, long, [*long[:300], 5, 6, 7]]  # the last shares 300 tokens (prefix cache)


def hf_generate(model_dir, device, dtype=torch.bfloat16):
    """Greedy tokens, per-step top-TOP token sets and per-step logprobs [steps, vocab] (float32, on the
    host) from transformers, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts():
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device=device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits]).cpu()
        tops = [set(step.topk(TOP).indices.tolist()) for step in logprobs]
        results.append((tokens, tops, logprobs))
    del model
    torch.cuda.empty_cache()
    return results


def test_bf16_engine_matches_hf_by_logprob_closeness(device, tmp_path):
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU")
    import transformers
    from modelfleet.dataplane import LLM, SamplingParams

    model_dir = tmp_path / "llama-3.2-1b-shape"
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**LLAMA_3_2_1B), dtype=torch.bfloat16
        )
    hf.save_pretrained(model_dir)
    del hf
    expected = hf_generate(model_dir, device)
    reference = hf_generate(model_dir, device, torch.float32)  # for the report: how far bf16 drifts

    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=8)
    assert llm.engine.runner.model.attention_backend.name == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts(), params)
    agreed, worst, compared = [], 0.0, 0
    for out, (hf_tokens, hf_tops, hf_logprobs) in zip(outputs, expected, strict=True):
        assert len(out.token_ids) == NEW_TOKENS
        assert len(out.logprobs) == NEW_TOKENS
        agreed.append(0)
        for i, (ours, theirs) in enumerate(zip(out.token_ids, hf_tokens, strict=True)):
            step = out.logprobs[i]
            where = f"prompt of {len(out.prompt_token_ids)} tokens, step {i}: ours {ours}, HF {theirs}"
            # Same prefix up to here on both sides, so the distributions of this step compare.
            assert ours in step and len(step) >= TOP, where
            for token_id, value in step.items():
                worst = max(worst, abs(value - hf_logprobs[i, token_id].item()))
            compared += 1
            if ours == theirs:
                agreed[-1] += 1
                continue
            assert ours in hf_tops[i] and theirs in step, where
            break
    drift = bf16_drift(expected, reference)
    tolerance = max(LOGPROB_ATOL_BF16, 2 * drift)
    print(
        f"max |logprob - HF bf16| over {compared} steps with equal prefixes: {worst:.4f} "
        f"(HF bf16 vs HF float32: {drift:.4f}; allowed {tolerance:.4f})"
    )
    assert worst <= tolerance
    print(f"steps equal before the first difference, per prompt: {agreed} of {NEW_TOKENS}")
    # against float32, our bf16 must hold on about as long as transformers' own bf16 does
    # (H100, seed 0: ours [21, 12, 29, 1, 12], transformers bf16 [15, 12, 29, 21, 6] steps)
    prefixes = {}
    for name, tokens in (("ours", [o.token_ids for o in outputs]), ("HF bf16", [t for t, *_ in expected])):
        prefixes[name] = [
            next((i for i, (a, b) in enumerate(zip(x, r, strict=True)) if a != b), NEW_TOKENS)
            for x, (r, *_) in zip(tokens, reference, strict=True)
        ]
        print(f"{name} vs HF float32, steps equal before the first difference: {prefixes[name]}")
    assert sum(prefixes["ours"]) >= 0.5 * sum(prefixes["HF bf16"])


def bf16_drift(bf16, float32) -> float:
    """Max |logprob| difference between transformers' bf16 and float32 runs over the steps where both
    had generated the same tokens so far (their top-TOP tokens of the bf16 run)."""
    drift = 0.0
    for (tokens, tops, logprobs), (ref_tokens, _, ref_logprobs) in zip(bf16, float32, strict=True):
        for i in range(NEW_TOKENS):
            ids = torch.tensor(sorted(tops[i]))
            drift = max(drift, (logprobs[i, ids] - ref_logprobs[i, ids]).abs().max().item())
            if tokens[i] != ref_tokens[i]:
                break
    return drift
