"""The offline API: `LLM(model_dir, **engine_config).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelfleet.dataplane.engine.llm_engine import LLMEngine, Prompt
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path | LLMEngine, **engine_config: Any) -> None:
        """model: a checkpoint folder, or an engine already built (e.g. onnx_engine.graph_engine's)."""
        self.engine = model if isinstance(model, LLMEngine) else LLMEngine.from_kwargs(model, **engine_config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts to completion; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"params: {len(param_list)} given for {len(prompt_list)} prompts")
        # Every request is checked before any runs: a bad one refuses the whole call.
        checked = [self.engine.validate(p, sp) for p, sp in zip(prompt_list, param_list, strict=True)]
        request_ids = [f"generate-{next(self._ids)}" for _ in prompt_list]
        for request_id, prompt, valid in zip(request_ids, prompt_list, checked, strict=True):
            self.engine.add_request(request_id, prompt, validated=valid, stream=False)
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return [finished[r] for r in request_ids]

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        self.engine.add_request(request_id, prompt, params, priority)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise ValueError(
            f"prompts: expected a string, a list of strings or of token-id lists, got {prompts!r}"
        )
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    return list(prompts)
