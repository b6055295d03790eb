"""LLM: the offline API — `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from kvinfer.config import EngineConfig
from kvinfer.engine.generation_defaults import generation_defaults
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.engine.outputs import RequestOutput
from kvinfer.errors import ValidationError
from kvinfer.sampling_params import SamplingParams

# A text, token ids, or vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}.
Prompt = Union[str, Sequence[int], Mapping[str, Any]]
Conversation = list[dict]


def _single(prompts) -> bool:
    return isinstance(prompts, (str, Mapping)) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                                   and isinstance(prompts[0], int))


def _unwrap(i: int, prompt):
    """A prompt dict's text or ids; anything else as it is (the input processor checks it)."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"}:
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    raise ValidationError(f"prompts[{i}]", sorted(keys), "a prompt dict holds exactly one of prompt (text) or "
                          "prompt_token_ids (ids)")


class LLM:
    """Load a model once, then generate for many prompts with continuous batching."""

    def __init__(self, model: Optional[str] = None, **engine_kwargs):
        """engine_kwargs: EngineConfig fields, or config=EngineConfig; loaded=LoadedModel reuses loaded weights."""
        loaded = engine_kwargs.pop("loaded", None)
        cfg = engine_kwargs.pop("config", None) or EngineConfig(model=model, **engine_kwargs)
        self.engine = LLMEngine(cfg, loaded)
        self.tokenizer = self.engine.tokenizer
        # The model's own sampling (generation_config.json; the built-in model's published values) for calls
        # that pass no SamplingParams, as vLLM's --generation-config auto.
        self.default_sampling = generation_defaults(cfg.model)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams used when none are given: the model's sampling defaults, vLLM's name for it."""
        return SamplingParams(**self.default_sampling)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A single prompt (text, ids or prompt dict) is a batch of one;
        sampling_params: one for all prompts or one per prompt."""
        if _single(prompts):
            prompts = [prompts]
        prompts = [_unwrap(i, p) for i, p in enumerate(prompts)]
        params = sampling_params
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.get_default_sampling_params()] * len(prompts)
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

    def embed(self, prompts: Union[Prompt, Sequence[Prompt]], pooling: Optional[str] = None,
              normalize: Optional[bool] = None) -> list[list[float]]:
        """One vector per prompt (vLLM's name): the prompt's final hidden states pooled `last`, `mean` or `cls`
        (default: the model's sentence-transformers setting, else last), L2-normalised if `normalize` (default:
        the model's setting, else no). Batched as generation is; the same prompt gives the same bits in any batch."""
        from kvinfer.engine.pooling import embed_params, finish, model_pooling

        own_pooling, own_normalize = model_pooling(self.engine.config.model)
        params = embed_params(pooling or own_pooling or "last")
        outs = self.generate(prompts if not _single(prompts) else [prompts], params, use_tqdm=False)
        norm = own_normalize if normalize is None else normalize
        return [finish(o.embedding, norm) for o in outs]

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under vLLM's name for it."""
        return self.engine

    def reset_prefix_cache(self) -> bool:
        """Forget the prefixes cached in free KV blocks (blocks a request holds keep theirs), as vLLM's does."""
        self.engine.kv_manager.reset_prefix_cache()
        return True

    def get_tokenizer(self):
        """The engine's tokenizer (None for a model loaded without one), as vLLM's LLM.get_tokenizer()."""
        return self.tokenizer

    def close(self) -> None:
        """End the tensor-parallel workers now rather than at exit (a no-op without them)."""
        self.engine.close()

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: Optional[bool] = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list[dict]] = None,
             chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> list[RequestOutput]:
        """Answer one conversation (a list of {role, content} dicts) or several, each through the model's chat
        template: one RequestOutput per conversation, in order (as vLLM's LLM.chat). tools (OpenAI's list of
        functions) are rendered as the server renders them; chat_template_kwargs reach the template;
        continue_final_message (with add_generation_prompt=False) continues the last message instead of starting a
        new one."""
        if self.tokenizer is None:
            raise ValidationError("tokenizer", None, "the model has no tokenizer, so no chat template (load one "
                                  "with LLM(..., tokenizer=DIR))")
        batch = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
        prompts = [self.tokenizer.encode(self._render(list(conv), tools, add_generation_prompt, continue_final_message,
                                                      chat_template_kwargs), add_special_tokens=False)
                   for conv in (messages if batch else [messages])]
        if sampling_params is None:  # an answer runs to its end (EOS or the context window), as chat servers do
            sampling_params = SamplingParams(max_tokens=None, **self.default_sampling)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _render(self, conv: list, tools, add_generation_prompt: bool, continue_final_message: bool,
                chat_template_kwargs) -> str:
        """One conversation's prompt text; tools (and assistant tool_calls, tool results) as the server's chat
        endpoint renders them: the template's own way when it has a place for tools, else Hermes-style text."""
        tok, extra = self.tokenizer, {}
        if tools is not None or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                    for m in conv):
            from kvinfer.loaders.chat_tools import template_messages

            plain = [{"role": m.get("role"), "content": m.get("content") or ""} if isinstance(m, dict) and
                     m.get("tool_calls") and m.get("content") is None else m for m in conv]
            tok.check_messages(plain)
            conv, extra = template_messages(plain, conv, tools, tok.chat_template)
        return tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs, **extra)
