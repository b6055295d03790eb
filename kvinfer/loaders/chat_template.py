"""Chat templates: reading one given on the command line, compiling it in a sandbox the way Hugging Face
templates expect, and checking the messages it is rendered with (Tokenizer.apply_chat_template renders)."""
from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from kvinfer.errors import ModelLoadError, ValidationError

ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no template; ChatML is what most small instruct models were tuned on.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateRaised(Exception):
    """A template called raise_exception(): the messages break a rule of the model's chat format."""


def read_chat_template(value: str) -> tuple[str, str]:
    """(template text, where it came from) for vLLM's --chat-template: a file's path, or the template itself
    (text with a Jinja brace or a newline)."""
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # a name too long or with a NUL byte: not a path
        is_file = False
    if is_file:
        try:
            return Path(value).read_text(encoding="utf-8"), value
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"--chat-template: cannot read the file {value!r}: {e}") from None
    if any(c in value for c in "{}\n"):
        return value, "--chat-template"
    raise ModelLoadError(f"--chat-template {value!r} is neither a file nor a template (Jinja text)")


def compile_template(source: str, where: str):
    # jinja2 is imported lazily: encode/decode callers should not pay for it.
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(Extension):
        """Some HF templates wrap assistant text in {% generation %} for loss masks; render the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateRaised(str(message))

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes <, > and &; templates expect plain JSON in the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"{where}: the chat template does not compile: {e}") from e


CUT = "\x00kvinfer:continue\x00"  # marks where a continued final message ends; never in real text


def preview(value: Any, limit: int = 8) -> Any:
    if isinstance(value, (list, tuple)) and len(value) > limit:
        return f"[{', '.join(map(repr, value[:limit]))}, ... ({len(value)} items)]"
    return value


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValidationError("messages", preview(messages), "must be a list of {role, content} dicts")
    if not messages:
        raise ValidationError("messages", messages, "must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValidationError(f"messages[{i}]", preview(m), "must be a dict with role and content")
        if "role" not in m:
            raise ValidationError(f"messages[{i}].role", None, "is missing")
        if m["role"] not in ROLES:
            raise ValidationError(f"messages[{i}].role", m["role"], "must be one of " + ", ".join(ROLES))
        if "content" not in m:
            raise ValidationError(f"messages[{i}].content", None, "is missing")
        if not isinstance(m["content"], str):
            raise ValidationError(f"messages[{i}].content", preview(m["content"]), "must be a string")
