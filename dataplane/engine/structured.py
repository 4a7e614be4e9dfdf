"""Structured output: a request's JSON schema (or "any JSON object") compiled by xgrammar into a grammar
whose matcher, one per sequence, masks the logits of every step to the tokens that keep the output
valid. The matcher follows the sampled tokens (LLMEngine._process), so a constrained sequence's next
step waits for its previous token (as penalties do); once the JSON is complete only end-of-sequence
tokens remain allowed.

xgrammar is imported on first use: an engine that never sees a constrained request never loads it."""

from __future__ import annotations

from typing import Any

KINDS = ("json_object", "json_schema")


class Grammars:
    """Compiles (and caches, by xgrammar's compiler) the grammars of one engine's tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None

    def matcher(self, structured: tuple[str, str]) -> Any:
        """A fresh matcher for one sequence; ValueError naming what is wrong."""
        kind, schema = structured
        compiler = self._compiler or self._make_compiler()
        try:
            # json_object is OpenAI's "any JSON object" (not an array or a bare value). Compact JSON:
            # free whitespace would let a model spend its tokens on spaces.
            text = '{"type": "object"}' if kind == "json_object" else schema
            grammar = compiler.compile_json_schema(text, any_whitespace=False)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its own message
            raise ValueError(f"response_format: the JSON schema cannot be compiled: {exc}") from None
        import xgrammar

        return xgrammar.GrammarMatcher(grammar)

    def _make_compiler(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("response_format: structured output needs the model's tokenizer")
        try:
            import xgrammar
        except ImportError:
            raise ValueError(
                "response_format: structured output needs xgrammar, which is not installed"
            ) from None
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler


def apply_grammars(logits: Any, seqs: list) -> Any:
    """Masks, in place, each constrained row's logits to what its grammar allows next."""
    import xgrammar

    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    bitmask = xgrammar.allocate_token_bitmask(len(seqs), logits.shape[-1])
    for i in rows:
        seqs[i].grammar.fill_next_token_bitmask(bitmask, i)
    logits = logits.contiguous()
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits
