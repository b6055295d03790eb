"""OpenAI-compatible request bodies (pydantic, so the OpenAPI document describes them) and the error shape."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvinfer.engine.async_engine import EngineDeadError, EngineStepError, QueueFullError
from kvinfer.errors import KvinferError, RequestTooLargeError, ValidationError
from kvinfer.sampling_params import MAX_BAD_WORDS, MAX_LOGPROBS, MAX_N

# Strict: a string where a number belongs, or true where a token id belongs, is a client bug worth a 400,
# not something to coerce. Extra fields are ignored, as OpenAI clients send fields we do not implement.
_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

MAX_STOP = 16  # stop strings per request; each one is searched for after every token
MAX_SEED = (1 << 64) - 1

Prompt = Union[str, list[str], list[int], list[list[int]]]
Stop = Union[None, str, list[str]]


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _lone_surrogate_path(value: Any, path: str = "body") -> Optional[str]:
    """Where a string holds a lone surrogate (a valid JSON escape such as \\udcff, but not Unicode)."""
    if isinstance(value, str):
        return None if _is_unicode(value) else path
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and not _is_unicode(k):  # a key: name the object that holds it
                return "a field name" if path == "body" else f"a key in {path}"
            bad = _lone_surrogate_path(v, str(k) if path == "body" else f"{path}.{k}")
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = _lone_surrogate_path(v, f"{path}[{i}]")
            if bad:
                return bad
    return None


class _Body(BaseModel):
    """A request body: its strings must be valid Unicode (the tokenizer cannot take lone surrogates)."""

    model_config = _CONFIG

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        bad = _lone_surrogate_path(data)
        if bad:
            where = bad.split(" in ", 1)[1] if bad.startswith("a key in ") else None if bad == "a field name" \
                else bad
            raise PydanticCustomError("unicode_surrogate", "{what} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF "
                                      "escape without its pair), which is not valid Unicode",
                                      {"param": where, "what": bad})
        return data


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: Optional[bool] = Field(False, description="send a last chunk with the token usage")


class _SamplingFields(_Body):
    """Fields common to completions and chat completions (OpenAI's, then vLLM-style extras)."""

    model_config = _CONFIG
    model: Optional[str] = Field(None, description="must be the served model name (see GET /v1/models)")
    # None: the model's own (generation_config.json, or the built-in model's published sampling), else 1.0
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0, description="0 is greedy")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
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
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "top-k log probabilities of each prompt token, as vLLM reports them (not with stream)"))
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit before sampling")
    allowed_token_ids: Optional[list[int]] = Field(None, min_length=1, description="only these tokens are sampled")
    bad_words: Optional[list[str]] = Field(None, max_length=MAX_BAD_WORDS, description="words the output never ends")
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, description=(
        "keep only the prompt's last k tokens (-1: the context window's worth)"))


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="the JSON Schema of the output")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """`text` (the default), `json_object` (any JSON object) or `json_schema` (a JSON Schema the output follows)."""

    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _StructuredFields(BaseModel):
    model_config = _CONFIG
    response_format: Optional[ResponseFormat] = Field(None, description="constrain the output to JSON")


class CompletionRequest(_SamplingFields, _StructuredFields):
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


class FunctionCall(BaseModel):
    model_config = _CONFIG
    name: str
    arguments: str = Field(..., description="the arguments as JSON text")


class ToolCall(BaseModel):
    model_config = _CONFIG
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _CONFIG
    role: Role
    content: Union[None, str, list[TextPart]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="calls an assistant message made")
    tool_call_id: Optional[str] = Field(None, description="the call a tool message answers")

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


class FunctionDefinition(BaseModel):
    model_config = _CONFIG
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON Schema of the arguments object")
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


class ChatCompletionRequest(_SamplingFields, _StructuredFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="default: the rest of the context window")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = Field(False, description="continue the last message (vLLM's extra); "
                                                   "needs add_generation_prompt false")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="extra chat template variables")
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedToolChoice] = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: Optional[bool] = Field(True, description="allow several calls in one answer")


class TokenizeRequest(_Body):
    """POST /tokenize: give either `prompt` or `messages`."""

    model_config = _CONFIG
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS)  # rendered as the chat endpoint does
    add_special_tokens: Optional[bool] = None  # default: true for prompt, false for messages (the template has them)
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(_Body):
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


class APIError(Exception):
    """An error answered in the OpenAI shape with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def from_engine_error(e: KvinferError) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", None, "server_busy")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", None, "engine_unavailable")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", None, "internal_error")
    if isinstance(e, RequestTooLargeError):
        return APIError(400, str(e), "invalid_request_error", e.param, "context_length_exceeded")
    if isinstance(e, ValidationError):
        # A schema's error names where the schema is, not the grammar kind ("invalid response_format='json'").
        msg = f"{e.param}: {e.reason}" if e.value == "json" and e.param.startswith(("response_format", "tools")) \
            else str(e)
        return APIError(400, msg, "invalid_request_error", e.param, "invalid_value")
    return APIError(400, str(e), "invalid_request_error", getattr(e, "param", None), None)


def message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text for p in m.content)


def messages_for_template(messages: list[ChatMessage]) -> list[dict]:
    # "developer" is OpenAI's newer name for the system role; chat templates only know "system".
    return [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m)} for m in messages]
