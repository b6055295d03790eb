"""The official `openai` client (sync, async, streaming, strict response validation) against `kvinfer serve`."""
from __future__ import annotations

import asyncio

import openai
import pytest

from kvinfer.layers.quant_linear import prompt_route_on

from server_helpers import engine_config, start_server

KEY = "sk-kvinfer-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config(), api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, _strict_response_validation=True)


@pytest.fixture(scope="module")
def lax_client(srv):
    # The SDK types a legacy completion's finish_reason as non-null, yet streamed chunks carry null until the
    # last one (as OpenAI's own API sends them), so strict validation rejects every streamed completion chunk.
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(srv):
    return srv.model_name


def test_models_list(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert client.models.retrieve(model).id == model


def test_chat_greedy_knows_paris(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    c = r.choices[0]
    assert "Paris" in c.message.content
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == model


def test_chat_stream_joined_equals_non_streamed(client, model):
    full = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_completion_tokens=24)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                                 max_completion_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completion_stream_joined_equals_non_streamed(client, lax_client, model):
    prompt = "The capital of France is"
    full = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16)
    assert full.object == "text_completion" and full.usage.completion_tokens >= 1
    chunks = list(lax_client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16,
                                                stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    for ch in chunks:
        assert ch.object == "text_completion" and ch.id == chunks[0].id
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_async_client_concurrent_and_streaming(client, srv, model):
    expected = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                              max_tokens=16).choices[0].message.content

    async def run():
        ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                                _strict_response_validation=True)
        async with ac:
            rs = await asyncio.gather(*[ac.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                                                   max_tokens=16) for _ in range(4)])
            stream = await ac.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                                      max_tokens=16, stream=True)
            parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
            return [r.choices[0].message.content for r in rs], "".join(parts)

    texts, streamed = asyncio.run(run())
    assert texts == [expected] * 4
    assert streamed == expected


def test_n_and_seed(client, model):
    kw = dict(model=model, prompt="My favourite colour is", max_tokens=8, temperature=0.9, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 24


def test_multiple_prompts_index_choices(client, model):
    prompts = ["One, two,", "Red, green,"]
    singles = [client.completions.create(model=model, prompt=p, temperature=0, max_tokens=5).choices[0].text
               for p in prompts]
    r = client.completions.create(model=model, prompt=prompts, temperature=0, max_tokens=5, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]


def test_token_id_prompts(client, srv, model):
    import httpx

    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "The capital of France is"},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=6)
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = client.completions.create(model=model, prompt=[ids, ids[:3]], temperature=0, max_tokens=3)
    assert len(two.choices) == 2 and two.choices[0].text == by_ids.choices[0].text[:len(two.choices[0].text)]
    assert two.usage.prompt_tokens == len(ids) + 3


def test_completion_logprobs_and_echo(client, model):
    r = client.completions.create(model=model, prompt="Hello, my name is", temperature=0, max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and top[tok] == v  # greedy: the chosen token is the most likely
        assert max(top.values()) == pytest.approx(v)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    e = client.completions.create(model=model, prompt="Hello, my name is", temperature=0, max_tokens=5, echo=True)
    assert e.choices[0].text == "Hello, my name is" + r.choices[0].text


def test_completion_echo_with_logprobs_scores_the_prompt(client, lax_client, model):
    # What evaluation harnesses send to score a text: echo + logprobs. The prompt's tokens come first, the
    # first with null logprob and alternatives (as OpenAI's legacy API and vLLM send it; the SDK's strict types
    # have no null there, hence the lax client), then the completion's, offsets into the echoed text.
    prompt = "Hello, my name is"
    plain = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=4, logprobs=2)
    e = lax_client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=4, logprobs=2, echo=True)
    c, lp = e.choices[0], e.choices[0].logprobs
    p, n = e.usage.prompt_tokens, e.usage.completion_tokens
    assert c.text == prompt + plain.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == p + n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:p]) == prompt
    assert lp.text_offset[:p] == [sum(len(t) for t in lp.tokens[:i]) for i in range(p)]
    assert lp.text_offset[p] == len(prompt) and lp.text_offset == sorted(lp.text_offset)
    for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert v <= 0 and top[tok] == v and len(top) in (2, 3)  # the token itself, and the 2 most likely
    # the completion's part is exactly what the same request without echo reports
    assert lp.tokens[p:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[p:] == plain.choices[0].logprobs.token_logprobs
    # scoring prompt + completion: the completion's tokens get the logprobs they were generated with
    whole = lax_client.completions.create(model=model, prompt=c.text, temperature=0, max_tokens=1, logprobs=0,
                                         echo=True)
    wl = whole.choices[0].logprobs
    assert wl.tokens[p:p + n] == lp.tokens[p:]
    if prompt_route_on():  # scored tokens are prompt rows there (bfloat16 tiles): within a few hundredths
        assert max(abs(a - b) for a, b in zip(wl.token_logprobs[p:p + n], lp.token_logprobs[p:])) < 0.1
    else:
        assert wl.token_logprobs[p:p + n] == lp.token_logprobs[p:]
    # streamed: the first chunk carries the prompt and its logprobs, the joined stream equals the whole reply
    chunks = list(lax_client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=4,
                                                logprobs=2, echo=True, stream=True))
    toks = [t for ch in chunks for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    vals = [v for ch in chunks for v in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    offs = [v for ch in chunks for v in (ch.choices[0].logprobs.text_offset if ch.choices[0].logprobs else [])]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert toks == lp.tokens and vals == lp.token_logprobs and offs == lp.text_offset


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.bytes is not None
    if r.choices[0].finish_reason == "length":  # no end-of-turn token, whose text is not in the content
        assert bytes(b for t in content for b in t.bytes).decode("utf-8") == r.choices[0].message.content
    streamed = list(client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=6,
                                                   logprobs=True, top_logprobs=2, stream=True))
    tokens = [t.token for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_stop_strings_and_lengths(client, model):
    full = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]
    one = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1, temperature=0)
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1


def test_penalties_accepted(client, model):
    r = client.completions.create(model=model, prompt="la la la la", max_tokens=6, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=1.0, top_p=0.9)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_errors_through_the_client(client, srv, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi")
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert client.models.list().data[0].id == model


def test_vllm_prompt_logprobs_extra(client, lax_client, model):
    # vLLM's extra parameter: null for the first prompt token, then {token id: {logprob, rank, decoded_token}} for
    # the token itself and its alternatives; per choice on completions, on the reply for chat; not with stream.
    prompt = "The capital of France is"
    c = lax_client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=2, echo=True, logprobs=0,
                                      extra_body={"prompt_logprobs": 2})
    pl, echo = c.choices[0].model_extra["prompt_logprobs"], c.choices[0].logprobs
    p = c.usage.prompt_tokens
    assert len(pl) == p and pl[0] is None
    for entry, tok, v in zip(pl[1:], echo.tokens[1:p], echo.token_logprobs[1:p]):
        assert 2 <= len(entry) <= 3  # the 2 most likely, and the token itself if it is not one of them
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
        mine = [e for e in entry.values() if e["decoded_token"] == tok and e["logprob"] == v]
        assert mine and mine[0]["rank"] >= 1 and all(e["logprob"] <= v for e in entry.values()
                                                      if e["rank"] > mine[0]["rank"])
    assert len(echo.top_logprobs[1]) == 1  # echo's alternatives follow logprobs (0), not prompt_logprobs (2)
    ch = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=2,
                                        extra_body={"prompt_logprobs": 0})
    cpl = ch.model_extra["prompt_logprobs"]
    assert len(cpl) == ch.usage.prompt_tokens and cpl[0] is None and all(len(e) == 1 for e in cpl[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, stream=True,
                                       extra_body={"prompt_logprobs": 0})


def test_vllm_chat_template_extras(client, model):
    # continue_final_message: the answer goes on from a started assistant message (vLLM's extra, for prefilled
    # answers); its prompt is the conversation cut after that message's text, so it counts fewer tokens than the
    # same conversation closed and answered anew.
    started = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=model, messages=started, temperature=0, max_tokens=8,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    closed = client.chat.completions.create(model=model, messages=started, temperature=0, max_tokens=8)
    assert "Paris" in r.choices[0].message.content and not r.choices[0].message.content.startswith("The capital")
    assert r.usage.prompt_tokens < closed.usage.prompt_tokens
    # chat_template_kwargs reach the template (this one ignores an unknown variable) and cannot set its inputs
    same = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8)
    assert same.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_vllm_sampling_extras(client, lax_client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16,
                                       extra_body={"bad_words": ["Paris", "paris"]})
    assert "Paris" not in r.choices[0].message.content and r.choices[0].message.content
    long = "one two three four five six seven eight nine ten " * 300  # over the context window whole
    c = lax_client.completions.create(model=model, prompt=long, temperature=0, max_tokens=2, echo=True,
                                      extra_body={"truncate_prompt_tokens": 5})
    assert c.usage.prompt_tokens == 5 and c.choices[0].text.startswith(" seven eight nine ten ")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"allowed_token_ids": [-3]})
    assert e.value.body["param"] == "allowed_token_ids"
