"""LLM: the offline API — `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from kvinfer.config import EngineConfig
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.engine.outputs import RequestOutput
from kvinfer.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching."""

    def __init__(self, model: Optional[str] = None, **engine_kwargs):
        """engine_kwargs: EngineConfig fields, or config=EngineConfig; loaded=LoadedModel reuses loaded weights."""
        loaded = engine_kwargs.pop("loaded", None)
        cfg = engine_kwargs.pop("config", None) or EngineConfig(model=model, **engine_kwargs)
        self.engine = LLMEngine(cfg, loaded)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A single prompt (str or list of ids) is a batch of one."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                         and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm or (use_tqdm is None and len(prompts) >= 8):
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def close(self) -> None:
        """End the tensor-parallel workers now rather than at exit (a no-op without them)."""
        self.engine.close()

    def chat(self, messages, params: Optional[SamplingParams] = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]
