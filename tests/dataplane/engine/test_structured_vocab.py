"""Grammars work in the tokenizer's ids, not in a model's vocabulary padded past them (a 128k-id
checkpoint around a 2k-token tokenizer made xgrammar's fills and accepts ~30x slower): a stop id past the
tokenizer's ids is moved to just after them, and every other padded id of a constrained row is masked
apart, never an unconstrained row's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.engine.structured import GrammarVocab, _PaddingMask

BENCH = Path(__file__).parents[3] / "bench"
# The tiny demo tokenizer (512 ids) padded to 4096 rows, bos/eos at 3840/3841 (bench/structured_overhead.py)
MODEL_VOCAB, TOKENIZER_VOCAB, EOS = 4096, 512, 3841
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
)
LONG_ARRAY = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 1000})
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


class Tokenizer:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in self.ids}


def test_the_grammar_ids_are_the_tokenizers_then_its_far_stops():
    vocab = GrammarVocab.of(Tokenizer([0, 1, 2, 5, 9]), 64, {3, 40, 100})
    # Ids up to the tokenizer's highest, gaps included; stop 3 is its own, 100 is past the model.
    assert vocab == GrammarVocab(64, 10, (40,))
    assert (vocab.size, vocab.padded) == (11, True)
    assert [vocab.grammar_id(t) for t in (0, 9, 40, 10, 63)] == [0, 9, 10, 11, 11]


def test_an_unpadded_model_keeps_its_ids():
    assert GrammarVocab.of(Tokenizer(list(range(12))), 8, {7}) == GrammarVocab(8, 8, ())
    # The one id past the tokenizer's is its stop: the same ids in the same order.
    vocab = GrammarVocab.of(Tokenizer(list(range(10))), 11, {10})
    assert (vocab.size, vocab.padded, vocab.grammar_id(10)) == (11, False, 10)


def test_the_sampling_kernel_reads_the_grammar_ids_as_laid_out():
    """A padded vocabulary: its tokenizer's ids direct, its far stops after them; an unpadded one: every
    id direct (its far stops are already its last ids). One bit a grammar id, in int32 words."""
    from modelfleet.dataplane.engine.structured import bitmask_layout

    assert bitmask_layout(GrammarVocab(64, 10, (40,))) == (1, 10, (40,))
    assert bitmask_layout(GrammarVocab(4096, 512, (3841,))) == (17, 512, (3841,))
    assert bitmask_layout(GrammarVocab(11, 10, (10,))) == (1, 11, ())


def test_the_padded_ids_are_masked_but_an_allowed_far_stop():
    vocab = GrammarVocab(64, 10, (40,))
    bitmask = torch.tensor([[(1 << 1) | (1 << 10)], [1 << 2], [-1]], dtype=torch.int32)

    def masked(indices: list[int] | None) -> torch.Tensor:
        logits = torch.zeros(3, 64)
        _PaddingMask(vocab, logits.device).apply(logits, bitmask, bitmask, indices)
        return torch.isinf(logits)

    rows = masked([0, 1])
    assert rows[0, 10:].sum() == 53 and not rows[0, 40] and not rows[0, :10].any()
    assert rows[1, 10:].all() and not rows[1, :10].any()
    assert not rows[2].any()  # not a constrained row
    # Every row constrained: no indices.
    assert masked(None)[:, 10:].sum(dim=1).tolist() == [53, 54, 53]
    # No constrained row allows its far stop: the padded columns of those rows alone.
    rows = masked([1])
    assert rows[1, 10:].all() and not rows[0].any() and not rows[2].any()


@pytest.fixture(scope="module")
def padded_model_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCH))
        from structured_overhead import padded_demo_model

    out = tmp_path_factory.mktemp("padded") / "model"
    out.mkdir()
    return padded_demo_model(out, MODEL_VOCAB, tokenizer_vocab=TOKENIZER_VOCAB)


@pytest.mark.parametrize("device", [*DEVICES, "cpu-fused"])
def test_a_padded_model_ends_its_json_on_its_far_eos(padded_model_dir, device, monkeypatch):
    """cpu-fused: the GPU's way on the CPU, the bitmask read by the fused sampler (its kernel replaced
    by the torch reference, which reads the bitmask the same way) rather than applied to the logits."""
    fused = device == "cpu-fused"
    device = "cpu" if fused else device
    llm = LLM(padded_model_dir, max_model_len=256, kv_cache_bytes=1 << 22, dtype="float32", device=device)
    if fused:
        from modelfleet.dataplane.kernels import sampling

        from tests.dataplane.kernels.reference import sample_tokens_native

        monkeypatch.setattr(sampling, "sample_tokens", sample_tokens_native)
        monkeypatch.setattr(llm.engine.runner.sampler, "fused", True)
    structured = ("json_schema", SCHEMA)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, structured=structured),
        SamplingParams(max_tokens=30, temperature=0.9, seed=5, structured=structured),
        plain,
        # Constrained as long as the plain row runs: the batch masks some rows, not all, throughout.
        SamplingParams(max_tokens=24, temperature=0.0, structured=("json_schema", LONG_ARRAY)),
    ]
    outs = llm.generate(["one", "two two", "three", "four"], params)
    vocab = llm.engine._grammars.vocab
    assert vocab == GrammarVocab(MODEL_VOCAB, TOKENIZER_VOCAB, (EOS,))
    assert llm.engine.eos_token_ids == {EOS}
    # The bitmask covers the grammar's 513 ids, not the model's 4096.
    assert llm.engine.runner.sampler._grammar_masks._host.shape[1] == 17
    for out in outs[:2]:
        assert out.finish_reason == "stop"
        assert json.loads(out.text)["a"] in ("x", "y")
        assert all(t < TOKENIZER_VOCAB for t in out.token_ids if t != EOS)
    assert outs[3].finish_reason == "length"
    assert all(t < TOKENIZER_VOCAB for t in outs[3].token_ids)
    # The unconstrained row is not masked: most of its tokens are padded ids, as 7 in 8 of the model's.
    padded = sum(t >= TOKENIZER_VOCAB and t != EOS for t in outs[2].token_ids)
    assert padded >= len(outs[2].token_ids) // 2
    if device == "cpu" and not fused:  # and they are those it samples alone (a GPU's may differ by batch)
        assert outs[2].token_ids == llm.generate("three", plain)[0].token_ids
