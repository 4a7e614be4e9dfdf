"""The validation inputs: the model's tokenizer when it gives varied ids, pseudo-random ids otherwise."""

from __future__ import annotations

import json

from modelfleet.converters import validate
from tokenizers import Tokenizer, models, pre_tokenizers


def word_tokenizer(folder, vocab_size: int) -> None:
    """A vocabulary of words like "t17" (the benchmarks' random-weight presets): English is all unknown."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "t0"}))


def test_a_tokenizer_that_maps_the_texts_to_one_id_is_set_aside(tmp_path):
    word_tokenizer(tmp_path, 1000)
    prompts, text = validate.token_ids(tmp_path, 1000)
    assert len(set(text)) * 2 >= len(text), "the perplexity text must not repeat one id"
    assert all(len(set(p)) > 1 for p in prompts)
    assert (prompts, text) == validate.token_ids(tmp_path / "no-tokenizer-here", 1000)


def test_a_real_tokenizer_is_used_as_it_is(tiny_model_dir):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompts, text = validate.token_ids(tiny_model_dir, tokenizer.get_vocab_size())
    assert text == tokenizer.encode(validate.PERPLEXITY_TEXT).ids
    assert prompts[0] == tokenizer.encode(validate.PROMPTS[0]).ids


def test_the_report_counts_the_distinct_ids_of_the_text():
    import torch

    logits = lambda ids: torch.nn.functional.one_hot(torch.tensor(ids), 8).float()  # noqa: E731
    report = validate.compare(logits, logits, [[1, 2, 3]], [1, 2, 2, 3], "fp32")
    assert report["passed"] and report["numDistinctTextIds"] == 3
