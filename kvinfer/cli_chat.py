"""`kvinfer chat`: an interactive conversation in the terminal, through the model's chat template."""
from __future__ import annotations

import dataclasses
import sys

from kvinfer.cli import (add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args,
                         stream_request)

CHAT_HELP = ("/reset clears the conversation, /help shows this, /exit or Ctrl-D quits; Ctrl-C stops an answer; "
             "start a message with // to send a leading /")


def _chat_prompt(engine, messages: list[dict], want: int) -> tuple[list[int], list[dict]]:
    """Token ids of the conversation and the messages they hold: the oldest turns (never the system message or
    the last user message) are left out while fewer than `want` new tokens fit."""
    tok = engine.tokenizer
    first = 1 if messages and messages[0]["role"] == "system" else 0
    kept = list(messages)
    while True:
        text = tok.apply_chat_template(kept, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        if engine.max_new_tokens(len(ids)) >= want or len(kept) - first <= 1:
            return ids, kept
        del kept[first]
        if len(kept) - first > 1 and kept[first]["role"] == "assistant":  # whole turns go
            del kept[first]


def cmd_chat(args) -> int:
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.errors import KvinferError, ValidationError

    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    if engine.tokenizer is None:
        raise ValidationError("model", args.model, "has no tokenizer; chat needs one (--tokenizer DIR)")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        say(f"kvinfer chat — {CHAT_HELP}.")
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):
            command = line.split()[0]
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                messages = list(system)
                say("(conversation cleared)")
            elif command == "/help":
                say(CHAT_HELP)
            else:
                say(f"unknown command {command}: {CHAT_HELP}")
            continue
        user = {"role": "user", "content": line[1:] if line.startswith("//") else line}
        ids, kept = _chat_prompt(engine, messages + [user], params.max_tokens)
        room = engine.max_new_tokens(len(ids))
        if room < 1:  # the conversation so far is kept: only this message is refused
            say(f"(that message needs {len(ids)} tokens; the context window holds {engine.max_model_len}: "
                f"send something shorter)")
            continue
        dropped = len(messages) + 1 - len(kept)
        if dropped:
            say(f"(the oldest {dropped} message{'s' if dropped > 1 else ''} no longer fit in the context window "
                f"of {engine.max_model_len} tokens and were dropped; /reset starts over)")
        messages = kept
        turn = dataclasses.replace(params, max_tokens=min(params.max_tokens, room),
                                   min_tokens=min(params.min_tokens, room))
        try:
            final, text = stream_request(engine, ids, turn)
        except KvinferError as e:  # this turn cannot run; the conversation can go on
            messages.pop()
            print()
            say(f"kvinfer: error: {e}")
            continue
        print()
        if final is None:
            say("(answer stopped)")
        messages.append({"role": "assistant", "content": text if final is None else final.outputs[0].text})
    return 0


def register(sub) -> None:
    c = sub.add_parser("chat", help="interactive chat with the model's chat template",
                       description="Interactive chat: each line you type is a user turn; answers stream back.")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c, temperature=0.7)
    c.set_defaults(func=cmd_chat)
