"""OpenAI-compatible request bodies (pydantic, so the OpenAPI document describes them) and the error shape."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvinfer.sampling_params import MAX_LOGPROBS, MAX_N

# Strict: a string where a number belongs, or true where a token id belongs, is a client bug worth a 400,
# not something to coerce. Extra fields are ignored, as OpenAI clients send fields we do not implement.
_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

MAX_STOP = 16  # stop strings per request; each one is searched for after every token
MAX_SEED = (1 << 64) - 1

Prompt = Union[str, list[str], list[int], list[list[int]]]
Stop = Union[None, str, list[str]]


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: Optional[bool] = Field(False, description="send a last chunk with the token usage")


class _SamplingFields(BaseModel):
    """Fields common to completions and chat completions (OpenAI's, then vLLM-style extras)."""

    model_config = _CONFIG
    model: Optional[str] = Field(None, description="must be the served model name (see GET /v1/models)")
    temperature: Optional[float] = Field(1.0, ge=0.0, le=100.0, description="0 is greedy")
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    n: Optional[int] = Field(1, ge=1, le=MAX_N, description="samples per prompt")
    stop: Stop = Field(None, description=f"up to {MAX_STOP} stop strings")
    seed: Optional[int] = Field(None, ge=-(1 << 63), le=MAX_SEED)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM-style extras
    top_k: Optional[int] = Field(None, ge=-1, description="0 or -1 disables")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    # Far below 1 it multiplies logits past float range (inf, then NaN probabilities).
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=10.0)
    min_tokens: Optional[int] = Field(None, ge=0)
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_STOP)
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit before sampling")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Prompt = Field(..., description="text, token ids, or a list of either (one choice group per prompt)")
    max_tokens: Optional[int] = Field(16, ge=1, description="new tokens per sample (default 16)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="top-k log probabilities per token")
    echo: Optional[bool] = Field(False, description="prepend the prompt to the completion text")
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N, description="accepted for compatibility; must equal n")
    suffix: Optional[str] = Field(None, description="not supported; must be null")


class TextPart(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = _CONFIG
    role: Role
    content: Union[None, str, list[TextPart]] = None
    name: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        # Checked before the union is tried, so the answer says what is unsupported instead of listing the
        # union's branches.
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "image", "input_image"):
                raise PydanticCustomError("unsupported_content",
                                          "images are not supported (this model reads text only)")
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError("unsupported_content",
                                          "content parts of type '{kind}' are not supported (only 'text')",
                                          {"kind": kind})
        return content

    @model_validator(mode="before")
    @classmethod
    def _needs_content(cls, data):
        # OpenAI lets only an assistant message that carries tool_calls leave content out.
        if isinstance(data, dict) and data.get("content") is None and not data.get("tool_calls"):
            raise PydanticCustomError("missing", "a {role} message needs content", {"role": data.get("role", "")})
        return data


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="default: the rest of the context window")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    add_generation_prompt: Optional[bool] = True


class TokenizeRequest(BaseModel):
    """POST /tokenize: give either `prompt` or `messages`."""

    model_config = _CONFIG
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = None  # default: true for prompt, false for messages (the template has them)
    add_generation_prompt: Optional[bool] = True
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = _CONFIG
    model: Optional[str] = None
    tokens: list[int]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Any] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text for p in m.content)


def messages_for_template(messages: list[ChatMessage]) -> list[dict]:
    # "developer" is OpenAI's newer name for the system role; chat templates only know "system".
    return [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m)} for m in messages]
