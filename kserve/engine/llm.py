"""Offline batch inference: `LLM(model_dir).generate(prompts, params)` and `LLM.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import fields
from pathlib import Path
from typing import Any

from kserve.config import EngineConfig
from kserve.engine.llm_engine import LLMEngine
from kserve.engine.outputs import RequestOutput
from kserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Loads a model (the embedded tiny one when `model` is None) and runs prompts to completion.

    Keyword arguments are `EngineConfig` fields (`max_num_seqs`, `num_kv_blocks`, `block_size`...).
    """

    def __init__(
        self, model: str | Path | None = None, dtype: str = "auto", device: str = "auto", **knobs: Any
    ) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(knobs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; expected EngineConfig fields")
        config = EngineConfig(
            model=str(model) if model is not None else None, dtype=dtype, device=device, **knobs
        )
        self._init(LLMEngine.from_config(config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm._init(engine)
        return llm

    def _init(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()
        self._chat_template: Any = None

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (a no-op for a single process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:  # noqa: PYI034 -- subclasses are not expected
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")

        request_ids = []
        try:
            for prompt, p in zip(prompts, param_list):
                text, ids = self._tokenize(prompt)
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, ids, p, prompt=text)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render one conversation or a list of them with the model's chat template, then generate."""
        from kserve.chat import ChatTemplate, normalize_tool_call_ids

        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer")
        if self._chat_template is None:
            self._chat_template = ChatTemplate.load(self.engine.model_dir,
                                                    dialect=self.engine.model_config.chat_dialect)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self._chat_template.encode(self.tokenizer, normalize_tool_call_ids(list(conv)), tools=tools)
            for conv in conversations  # type: ignore[arg-type]
        ]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ internals
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt, allow_special_tokens=True)
        return None, [int(t) for t in prompt]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        generated = 0
        try:
            while pending:
                for request in self.engine.step():
                    if request.request_id in pending and request.finished:
                        if request.error is not None:
                            raise RuntimeError(f"request failed: {request.error}") from request.error
                        done[request.request_id] = request.output()
                        pending.discard(request.request_id)
                        generated += sum(len(c.token_ids) for c in done[request.request_id].outputs)
                        bar.update(1)
                        bar.set_postfix(out_tokens=generated, refresh=False)
        finally:
            bar.close()
        return [done[r] for r in request_ids]
