"""`--reasoning-parser qwen3|deepseek_r1`: a thinking model's `<think>...</think>` split from its answer, whole or
streamed, into the chat API's `reasoning_content` (vLLM's and llama.cpp's field) and the Responses API's
`reasoning` items. Tool calls are parsed from the answer only.

qwen3: the model opens `<think>` itself; an output that does not begin with it is all answer (thinking off).
deepseek_r1: the template opens `<think>` in the prompt, so the output starts inside the reasoning; an output
without `</think>` is all reasoning (it was cut short).
"""
from __future__ import annotations

from typing import Optional

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many of text's last characters could be the start of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, kind: str):
        if kind not in PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r} (one of {', '.join(PARSERS)})")
        self.kind = kind

    def split(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning or None, answer) of a whole output."""
        body = text.lstrip()
        opened = body.startswith(OPEN)
        if opened:
            body = body[len(OPEN):]
        elif self.kind == "qwen3":
            return None, text
        else:
            body = text
        end = body.find(CLOSE)
        if end == -1:
            return body, ""
        return body[:end], body[end + len(CLOSE):].lstrip("\n")

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class ReasoningStream:
    """Splits one choice's streamed text: step(delta) -> (reasoning delta, answer delta)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.state = "start"  # start (may open <think>), reasoning, answer
        self.pos = 0  # characters of text consumed

    def step(self, delta: str) -> tuple[str, str]:
        self.text += delta
        reasoning, answer = "", ""
        while True:
            rest = self.text[self.pos:]
            if self.state == "start":
                head = rest.lstrip()
                if head.startswith(OPEN):
                    self.pos += len(rest) - len(head) + len(OPEN)
                    self.state = "reasoning"
                    continue
                if not head or OPEN.startswith(head):
                    return reasoning, answer  # could still be <think>
                self.state = "reasoning" if self.parser.kind == "deepseek_r1" else "answer"
                continue
            if self.state == "reasoning":
                end = rest.find(CLOSE)
                if end != -1:
                    reasoning += rest[:end]
                    self.pos += end + len(CLOSE)
                    self.state = "after"
                    continue
                keep = _held(rest, CLOSE)
                reasoning += rest[:len(rest) - keep]
                self.pos += len(rest) - keep
                return reasoning, answer
            if self.state == "after":  # the newlines between </think> and the answer are not part of it
                head = rest.lstrip("\n")
                self.pos += len(rest) - len(head)
                if not head:
                    return reasoning, answer
                self.state = "answer"
                continue
            answer += rest
            self.pos = len(self.text)
            return reasoning, answer

    def end(self) -> tuple[str, str]:
        """What is still held when the choice finishes."""
        rest = self.text[self.pos:]
        self.pos = len(self.text)
        if self.state == "start":
            return (rest, "") if self.parser.kind == "deepseek_r1" else ("", rest)
        if self.state == "reasoning":
            return rest, ""
        return "", "" if self.state == "after" else rest


def reasoning_parser(app, params) -> Optional[ReasoningParser]:
    """The server's parser (`kvinfer serve --reasoning-parser`, kept in app.state), or None. None too for a request
    under a grammar (response_format, a forced tool call): the grammar holds from the first token, so the model
    cannot think first, and its whole output is the answer."""
    kind = getattr(app.state, "reasoning_parser", None)
    return ReasoningParser(kind) if kind and params.structured_output is None else None


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A Responses API `reasoning` output item holding the model's reasoning text."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}
