"""Tokenizer: text <-> ids and chat-template rendering (the template itself: chat_template.py), built from an HF
directory or from GGUF metadata."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from kvinfer.errors import ModelLoadError, UnsupportedError, ValidationError
from kvinfer.loaders.chat_template import (CHATML_TEMPLATE, CUT, TemplateRaised, compile_template, preview,
                                           validate_messages)

# Tokens that close an assistant turn in common template families. Generation must stop on them even
# when the file's eos is another token (e.g. <|endoftext|>), or the model runs on into a fake next turn.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|return|>", "<|call|>")

# GGUF token_type values (llama.cpp's llama_token_type).
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer split regexes, keyed by GGUF tokenizer.ggml.pre (names as llama.cpp spells them) ---
# Each entry is applied in order as an "isolated" split, the way llama.cpp chains its regex list.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _family(names: Iterable[str], splits: tuple[str, ...], ignore_merges: bool = False) -> dict:
    return {n: (splits, ignore_merges) for n in names}


_PRE_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    **_family(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion", "poro-chat", "viking",
               "bloom", "gpt3-finnish"), (_GPT2_SPLIT,)),
    # These vocabularies were trained with every digit split off first (HF's Digits(individual_digits)).
    **_family(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
              (r"\p{N}", _GPT2_SPLIT)),
    # Llama-3's tokenizer.json sets ignore_merges: a whole word that is in the vocab wins over its merges.
    **_family(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
               "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,), ignore_merges=True),
    **_family(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez", "kormo"), (_QWEN2_SPLIT,)),
    **_family(("gpt-4o", "llama4", "kanana2", "minimax-m2"), (_GPT4O_SPLIT,)),
    **_family(("tekken",), (_TEKKEN_SPLIT,)),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by every byte-level BPE vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_BYTE_TO_CHAR = _byte_alphabet()
_BYTE_CHARS = frozenset(_BYTE_TO_CHAR.values())


def _as_texts(items: Sequence[Any]) -> list[str]:
    """_as_text of every item; one check of the whole list in the usual case (all clean str)."""
    items = list(items)
    if all(type(t) is str for t in items):
        try:
            "".join(items).encode("utf-8")
            return items
        except UnicodeEncodeError:
            pass
    return [_as_text(t) for t in items]


def _as_text(token: Any) -> str:
    """A GGUF string as a str the Rust side accepts (no lone surrogates)."""
    if isinstance(token, (bytes, bytearray)):
        return bytes(token).decode("utf-8", "replace")
    token = str(token)
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:
        # A parser may keep undecodable bytes as surrogate escapes; tokenizers cannot take those.
        token = token.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return token


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config stores special tokens either as a string or as a serialised AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


_LONG_TEXT = 1 << 16  # characters; longer texts are encoded without holding the GIL (a server's other threads run)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model-level facts around it: BOS/EOS handling and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: Optional[str] = None,
        eos_token: Optional[str] = None,
        unk_token: Optional[str] = None,
        pad_token: Optional[str] = None,
        extra_eos_ids: Sequence[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: Optional[str] = None,
        source: str = "<tokenizer>",
    ):
        self._backend = backend
        self.source = source
        self._special_tokens = {name: tok for name, tok in (("bos_token", bos_token), ("eos_token", eos_token),
                                                             ("unk_token", unk_token), ("pad_token", pad_token))
                                if tok is not None and backend.token_to_id(tok) is not None}
        self._bos_id = self.token_to_id(bos_token) if bos_token is not None else None
        self._add_bos = bool(add_bos) and self._bos_id is not None
        eos_id = self.token_to_id(eos_token) if eos_token is not None else None
        self._add_eos = bool(add_eos) and eos_id is not None
        self._base_eos = tuple(dict.fromkeys(([eos_id] if eos_id is not None else [])
                                             + [int(i) for i in extra_eos_ids]))
        self._set_template(chat_template, source)

    def _set_template(self, chat_template: Optional[str], source: str) -> None:
        """The chat template (None: ChatML, has_chat_template False) and what follows from it: the end-of-turn
        tokens it uses stop generation too."""
        self.has_chat_template = chat_template is not None
        self.chat_template = chat_template if chat_template is not None else CHATML_TEMPLATE
        self._template = compile_template(self.chat_template, source)
        self._eos_ids = tuple(dict.fromkeys(list(self._base_eos) + self._end_of_turn_ids()))
        special = {i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (self.token_to_id(t) for t in self._special_tokens.values()) if i is not None)
        special.update(self._eos_ids)
        self._special_ids = tuple(sorted(special))

    def set_chat_template(self, template: str, source: str = "--chat-template") -> None:
        """Use `template` (Jinja text) instead of the model's own (vLLM's --chat-template)."""
        self._set_template(template, source)

    def _end_of_turn_ids(self) -> list[int]:
        found = [t for t in _END_OF_TURN_TOKENS if t in self.chat_template]
        if "<|return|>" in found and "<|end|>" in found:
            # Harmony (gpt-oss) ends each channel message with <|end|> and keeps going; only
            # <|return|>/<|call|> end the turn there.
            found.remove("<|end|>")
        added = {tok.content: i for i, tok in self._backend.get_added_tokens_decoder().items()}
        return [added[t] for t in found if t in added]

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_hf_dir(cls, path: Union[str, Path]) -> "Tokenizer":
        """Load tokenizer.json with tokenizer_config.json, chat_template.jinja and generation/config eos ids."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{root}: no tokenizer.json there (a SentencePiece tokenizer.model alone "
                                 "is not supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception for malformed files
            raise ModelLoadError(f"cannot load {tok_file}: {e}") from e

        cfg = _read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
        model_cfg = _read_json(root / "config.json") if (root / "config.json").is_file() else {}
        gen_cfg = (_read_json(root / "generation_config.json")
                   if (root / "generation_config.json").is_file() else {})

        template = cfg.get("chat_template")
        if isinstance(template, list):
            # Older multi-template form: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        if (root / "chat_template.json").is_file():
            template = _read_json(root / "chat_template.json").get("chat_template", template)
        if (root / "chat_template.jinja").is_file():
            # transformers writes the template here since v4.43 and prefers it over the config copy.
            try:
                template = (root / "chat_template.jinja").read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"cannot read {root / 'chat_template.jinja'}: {e}") from e
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(f"{root}: chat_template is a {type(template).__name__}, not a string")

        def special(name: str, id_key: str) -> Optional[str]:
            if name in cfg:
                # An explicit null (Qwen's bos_token) means "none", even if config.json names an id.
                return _token_content(cfg[name])
            ids = _int_list(model_cfg.get(id_key))
            return backend.id_to_token(ids[0]) if ids else None

        bos, eos = special("bos_token", "bos_token_id"), special("eos_token", "eos_token_id")

        # Like transformers: explicit add_bos_token/add_eos_token (or no post-processor at all) mean the
        # flags decide; otherwise tokenizer.json's post-processor already inserts what the model wants.
        explicit = "add_bos_token" in cfg or "add_eos_token" in cfg
        if explicit or backend.post_processor is None:
            backend.post_processor = None
            add_bos, add_eos = bool(cfg.get("add_bos_token", False)), bool(cfg.get("add_eos_token", False))
        else:
            add_bos = add_eos = False

        extra = _int_list(gen_cfg.get("eos_token_id")) + _int_list(model_cfg.get("eos_token_id"))
        return cls(backend, bos_token=bos, eos_token=eos, unk_token=_token_content(cfg.get("unk_token")),
                   pad_token=_token_content(cfg.get("pad_token")), extra_eos_ids=extra,
                   add_bos=add_bos, add_eos=add_eos, chat_template=template, source=str(root))

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], source: str = "GGUF metadata") -> "Tokenizer":
        """Build the tokenizer a GGUF file describes from its metadata (a plain dict of GGUF keys)."""
        raw_tokens = md.get("tokenizer.ggml.tokens")
        if not raw_tokens:
            raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens, so there is no tokenizer to build")
        tokens = _as_texts(raw_tokens)
        types = [int(t) for t in md.get("tokenizer.ggml.token_type") or [_TYPE_NORMAL] * len(tokens)]
        if len(types) != len(tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for "
                                 f"{len(tokens)} tokens")
        kind = md.get("tokenizer.ggml.model", "gpt2")

        def token_at(key: str) -> Optional[str]:
            i = md.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        try:
            if kind == "gpt2":
                backend = _byte_level_backend(tokens, types, md)
                add_bos_default = False
            elif kind == "llama":
                backend = _sentencepiece_backend(tokens, types, md)
                # llama.cpp adds BOS to a SentencePiece vocab unless the file says otherwise.
                add_bos_default = True
            else:
                raise UnsupportedError(f"{source}: tokenizer.ggml.model={kind!r} is not supported "
                                       "(supported: gpt2, llama)")
        except (UnsupportedError, ModelLoadError):
            raise
        except Exception as e:
            raise ModelLoadError(f"{source}: cannot build the {kind!r} tokenizer: {e}") from e

        extra_eos = [int(md[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                     if md.get(k) is not None and 0 <= int(md[k]) < len(tokens)]
        template = md.get("tokenizer.chat_template")
        return cls(backend,
                   bos_token=token_at("tokenizer.ggml.bos_token_id"),
                   eos_token=token_at("tokenizer.ggml.eos_token_id"),
                   unk_token=token_at("tokenizer.ggml.unknown_token_id"),
                   pad_token=token_at("tokenizer.ggml.padding_token_id"),
                   extra_eos_ids=extra_eos,
                   add_bos=bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=_as_text(template) if template is not None else None,
                   source=source)

    # ------------------------------------------------------------------ ids <-> text

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos_id

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return self._special_ids

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token/eos_token/unk_token/pad_token strings that exist in the vocab."""
        return dict(self._special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Union[int, Sequence[int]]):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValidationError("text", type(text).__name__, "must be a str")
        if len(text) > _LONG_TEXT:  # the batch call releases the GIL while it works (the single one holds it)
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self._bos_id)
            if self._add_eos:
                ids.append(self._eos_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        try:
            return self._backend.decode(ids if isinstance(ids, list) else list(ids),
                                        skip_special_tokens=skip_special_tokens)
        except TypeError:
            pass  # e.g. numpy or torch integers, which the Rust binding does not take; convert and retry
        except OverflowError as e:
            raise ValidationError("ids", preview(ids), "must be non-negative token ids") from e
        try:
            return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValidationError("ids", preview(ids), "must be a list of non-negative int token ids") from e

    # ------------------------------------------------------------------ chat

    @staticmethod
    def check_messages(messages: Any) -> None:
        """ValidationError naming the first message that is not a {role, content} dict with a known role."""
        validate_messages(messages)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: Optional[Mapping[str, Any]] = None, **template_kwargs: Any) -> str:
        """Render a conversation to the prompt text; template variables (tools, documents, ...) come from
        chat_template_kwargs (a user's) and then template_kwargs (the caller's, which win).

        continue_final_message: end the text inside the last message (after its content, without the
        end-of-turn the template would write), so that the model continues that message (a prefilled answer)."""
        validate_messages(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValidationError("chat_template_kwargs", preview(chat_template_kwargs), "must be a dict")
        template_kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        for key in ("messages", "add_generation_prompt", "continue_final_message"):
            if key in template_kwargs:
                raise ValidationError("chat_template_kwargs", key, "is set by the request itself, not a template "
                                      "variable")
        if continue_final_message and add_generation_prompt:
            raise ValidationError("continue_final_message", True, "cannot be combined with add_generation_prompt "
                                  "(set add_generation_prompt to false)")
        if continue_final_message:  # render with a marker after the content, then cut the text there
            messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + CUT}]
        context: dict[str, Any] = {"tools": None, "documents": None, **self._special_tokens, **template_kwargs,
                                   "messages": messages, "add_generation_prompt": bool(add_generation_prompt)}
        import jinja2

        try:
            text = self._template.render(**context)
        except TemplateRaised as e:
            raise ValidationError("messages", [m["role"] for m in messages],
                                  f"rejected by the model's chat template: {e}") from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ValidationError("messages", [m["role"] for m in messages],
                                  f"the chat template failed to render them: {type(e).__name__}: {e}") from e
        if continue_final_message:
            cut = text.rfind(CUT)
            if cut < 0:
                raise ValidationError("continue_final_message", True, "the chat template does not write the last "
                                      "message's content, so there is nothing to continue")
            text = text[:cut]
        return text

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self._bos_id}, "
                f"eos={self._eos_ids}, add_bos={self._add_bos})")


# ---------------------------------------------------------------------- GGUF backends


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[AddedToken], list[AddedToken]]:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so both are
    matched whole in input text (as llama.cpp does) instead of being split by the model."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _TYPE_CONTROL]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
             if k == _TYPE_USER_DEFINED]
    return special, plain


def _first_index_vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


def _byte_level_backend(tokens: list[str], types: list[int], md: Mapping[str, Any]) -> tokenizers.Tokenizer:
    # A normal token should already be spelled in the byte alphabet; a few converters store raw text
    # instead, so respell it or the BPE could never produce it.
    if set("".join(tokens)) <= _BYTE_CHARS:  # the usual case, checked at once
        spelled = tokens
    else:
        spelled = [t if k != _TYPE_NORMAL or set(t) <= _BYTE_CHARS
                   else "".join(_BYTE_TO_CHAR[b] for b in t.encode("utf-8"))
                   for t, k in zip(tokens, types)]
    merges = []
    for m in _as_texts(md.get("tokenizer.ggml.merges") or []):
        left, sep, right = m.partition(" ")
        if sep:
            merges.append((left, right))
    pre = md.get("tokenizer.ggml.pre") or "default"
    splits, ignore_merges = _PRE_SPLITS.get(pre, _PRE_SPLITS["default"])
    backend = tokenizers.Tokenizer(models.BPE(_first_index_vocab(spelled), merges, fuse_unk=False,
                                              byte_fallback=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    special, plain = _added_tokens(spelled, types)
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    return backend


def _sentencepiece_backend(tokens: list[str], types: list[int], md: Mapping[str, Any]) -> tokenizers.Tokenizer:
    vocab = _first_index_vocab(tokens)
    scores = md.get("tokenizer.ggml.scores")
    merges = md.get("tokenizer.ggml.merges")
    if merges:
        pairs = []
        for m in merges:
            left, sep, right = _as_text(m).partition(" ")
            if sep:
                pairs.append((left, right))
    else:
        pairs = _merges_from_scores(tokens, types, vocab,
                                    [float(s) for s in scores] if scores else [-float(i) for i in range(len(tokens))])
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    if unk is None and "<unk>" in vocab:
        unk = "<unk>"
    backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    special, plain = _added_tokens(tokens, types)
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    return backend


def _merges_from_scores(tokens: list[str], types: list[int], vocab: dict[str, int],
                        scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece-BPE merges the highest-scoring adjacent pair first; listing every split of each
    token ordered by that token's score gives a BPE rank order that reproduces it."""
    ranked = []
    for tid, (tok, kind) in enumerate(zip(tokens, types)):
        if kind not in (_TYPE_NORMAL, _TYPE_USER_DEFINED) or len(tok) < 2 or vocab.get(tok) != tid:
            continue
        score = scores[tid] if tid < len(scores) else 0.0
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                ranked.append((-score, tid, lid, rid, left, right))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]
