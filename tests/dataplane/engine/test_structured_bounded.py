"""Strings of bounded length (maxLength) are compiled as one rule per character written, not as xgrammar's
counted repetition, whose masks its cache cannot hold (every token of a 128k vocabulary checked at every
step inside the string). The language and every mask stay the same: checked here against xgrammar's own
grammar, character by character and token by token over vocabularies whose tokens cross the string's end."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import xgrammar
from modelfleet.dataplane.engine.structured import (
    MAX_CHAINED_LENGTH,
    Grammars,
    _compile_bounded_strings,
    bounded_strings_as_chains,
)


def string(**bounds: int) -> dict:
    return {"type": "string", **bounds}


def array_of(items: dict, **bounds: int) -> dict:
    return {"type": "array", "items": items, **bounds}


def obj(**properties: dict) -> dict:
    required = list(properties)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SCHEMAS = {
    "root": string(maxLength=3),
    "root_min": string(minLength=2, maxLength=4),
    "array": obj(items=array_of(string(maxLength=2), minItems=1, maxItems=3)),
    "record": obj(
        name=string(minLength=1, maxLength=3),
        tag=string(maxLength=2),
        kind={"enum": ["a", "b"]},
        n={"type": "integer"},
    ),
}
# Tokens that end a string inside them, cross into what follows it, or escape.
VOCAB = ['"', "a", "b", "ab", "aa", "abc", 'a"', '",', '"]', '"}', '", "', '"a', ", ", ",", "]", "}",
         "{", "[", '{"', '["', ": ", ":", '\\', '\\"', "1", "12", "-", "name", '"name', '": "', "tag",
         "kind", "items", "n", '"n', '"tag', '"kind', '"items', '": ', '": ["', " ", "<eos>"]  # fmt: skip
EOS = len(VOCAB) - 1


def compiled_pair(schema: dict) -> tuple[xgrammar.CompiledGrammar, xgrammar.CompiledGrammar]:
    """xgrammar's own grammar of the schema and ours (asserted to differ: a bounded string was chained)."""
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    text = json.dumps(schema)
    chained = _compile_bounded_strings(compiler, text)
    assert chained is not None and "_len_" in str(chained.grammar)
    return compiler.compile_json_schema(text, any_whitespace=False), chained


def outcome(grammar: xgrammar.CompiledGrammar, text: str) -> tuple[bool, bool]:
    """Whether the grammar accepts `text` as a prefix, and whether it is then complete."""
    matcher = xgrammar.GrammarMatcher(grammar)
    accepted = matcher.accept_string(text)
    return accepted, accepted and matcher.is_completed()


def candidate_texts(schema_name: str) -> list[str]:
    pieces = ["a", '"', "\\", "\\n", "é"]
    bodies = ["".join(p) for n in range(6) for p in itertools.product(pieces, repeat=n)]
    if schema_name.startswith("root"):
        return ['"' + b for b in bodies] + ['"' + b + '"' for b in bodies]
    if schema_name == "array":
        return [f'{{"items": ["{b}"]}}' for b in bodies] + [f'{{"items": ["{b}", "{b[:2]}"' for b in bodies]
    return [f'{{"name": "{b}", "tag": "{b[-2:]}", "kind": "a", "n": 1}}' for b in bodies]


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_chained_grammar_accepts_the_same_texts(name):
    original, chained = compiled_pair(SCHEMAS[name])
    texts = candidate_texts(name)
    complete = 0
    for text in texts:
        expected = outcome(original, text)
        assert outcome(chained, text) == expected, text
        complete += expected[1]
    assert complete > 0  # the texts reach complete answers, not only rejections


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_chained_grammar_gives_the_same_masks(name):
    """Random walks over VOCAB, each step's token drawn from the mask: both grammars' masks are equal."""
    original, chained = compiled_pair(SCHEMAS[name])
    rng = random.Random(0)
    steps = 0
    for _ in range(40):
        matchers = [xgrammar.GrammarMatcher(original), xgrammar.GrammarMatcher(chained)]
        for _ in range(30):
            masks = [xgrammar.allocate_token_bitmask(1, len(VOCAB)) for _ in matchers]
            for matcher, mask in zip(matchers, masks, strict=True):
                matcher.fill_next_token_bitmask(mask)
            assert torch.equal(masks[0], masks[1])
            allowed = [t for t in range(len(VOCAB)) if (masks[0][0, t // 32] >> (t % 32)) & 1]
            if not allowed:  # a dead end of this small vocabulary, for both
                break
            token = rng.choice(allowed)
            assert all(m.accept_token(token) for m in matchers)
            steps += 1
            if token == EOS:
                break
    assert steps > 100  # the walks go past the strings' ends, not only into them


def test_only_bounded_strings_change():
    unbounded = json.dumps(obj(a=string(), b=string(minLength=2), c=array_of(string())))
    ebnf = str(xgrammar.Grammar.from_json_schema(unbounded, any_whitespace=False))
    assert bounded_strings_as_chains(ebnf) == ebnf
    too_long = json.dumps(string(maxLength=MAX_CHAINED_LENGTH + 1))
    ebnf = str(xgrammar.Grammar.from_json_schema(too_long, any_whitespace=False))
    assert bounded_strings_as_chains(ebnf) == ebnf


def test_one_chain_per_bound_shared_by_its_uses():
    ebnf = str(
        xgrammar.Grammar.from_json_schema(
            json.dumps(obj(a=array_of(string(maxLength=4)), b=string(maxLength=4))), any_whitespace=False
        )
    )
    chained = bounded_strings_as_chains(ebnf)
    rules = [line.split(" ::= ")[0] for line in chained.splitlines()]
    assert len(rules) == len(set(rules))
    # Each string rule of xgrammar's gets its own chain of maxLength + 1 rules.
    assert sum("_len_0_4_" in r for r in rules) == 5 * ebnf.count("{0, 4}")
    xgrammar.Grammar.from_ebnf(chained)  # parses


def test_the_engine_compiles_bounded_strings_as_chains():
    from modelfleet.dataplane.demo.tokenizer import build_tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(600))
    grammars = Grammars(tokenizer, 640, frozenset({1}))
    try:
        bounded = grammars.compile(("json_schema", json.dumps(SCHEMAS["array"]))).result(timeout=60)
        plain = grammars.compile(("json_object", "")).result(timeout=60)
    finally:
        grammars.close()
    assert "_len_0_2_" in str(bounded.grammar.grammar)
    assert "_len_" not in str(plain.grammar.grammar)
    matcher = Grammars.matcher(bounded).matcher
    assert matcher.accept_string('{"items": ["ab"]}')
    assert matcher.is_completed()


def test_the_same_masks_with_a_byte_level_bpe_tokenizer():
    """bench/serve.py's two schemas over the demo's byte-level BPE tokenizer: 64 rows walk 40 steps."""
    import sys
    from pathlib import Path

    from modelfleet.dataplane.demo.tokenizer import build_tokenizer
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).parents[3] / "bench"))
    try:
        from serve import SCHEMAS as BENCH_SCHEMAS
    finally:
        sys.path.pop(0)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(2048))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[1])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    filler = xgrammar.BatchGrammarMatcher(max_threads=1)
    rng = torch.Generator().manual_seed(0)
    for name, schema in BENCH_SCHEMAS.items():
        text = json.dumps(schema)
        grammars = (
            compiler.compile_json_schema(text, any_whitespace=False),
            _compile_bounded_strings(compiler, text),
        )
        rows = [[xgrammar.GrammarMatcher(g) for _ in range(64)] for g in grammars]
        masks = [xgrammar.allocate_token_bitmask(64, info.vocab_size) for _ in grammars]
        for _ in range(40):
            for matchers, mask in zip(rows, masks, strict=True):
                filler.batch_fill_next_token_bitmask(matchers, mask)
            assert torch.equal(masks[0], masks[1]), name
            logits = torch.rand(64, info.vocab_size, generator=rng)
            xgrammar.apply_token_bitmask_inplace(logits, masks[0])
            for token, *matchers in zip(logits.argmax(dim=1).tolist(), *rows, strict=True):
                assert all(m.accept_token(token) for m in matchers), name
        assert not any(m.is_terminated() for m in rows[0])  # the answers never ended: every step masked


def test_chains_xgrammar_cannot_read_leave_the_schema_as_it_is(monkeypatch, caplog):
    from modelfleet.dataplane.engine import structured

    monkeypatch.setattr(structured, "bounded_strings_as_chains", lambda ebnf: ebnf + "broken ::= (\n")
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    with caplog.at_level("WARNING"):
        assert _compile_bounded_strings(compiler, json.dumps(SCHEMAS["array"])) is None
    assert "compiled without chains" in caplog.text
    assert "RuntimeError" in caplog.text  # xgrammar's reason comes along
