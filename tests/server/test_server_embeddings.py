"""/v1/embeddings through the official openai SDK, and LLM.embed: shapes, formats, exactness across batches."""
from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest

from server_helpers import assert_error_shape, engine_config, kv_blocks_used, start_server

TEXTS = ["The cat sat on the mat.", "A dog ran across the park chasing a ball.", "Hi",
         "Quantum chromodynamics describes the strong interaction between quarks and gluons, "
         "mediated by gluons, in the framework of quantum field theory. " * 3]


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config(max_num_seqs=16, max_num_batched_tokens=256))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_create_shapes_usage_and_formats(client, srv):
    r = client.embeddings.create(model=srv.model_name, input=TEXTS[:2], encoding_format="float")
    assert [d.index for d in r.data] == [0, 1] and r.model == srv.model_name
    assert len(r.data[0].embedding) == 576 and r.data[0].embedding != r.data[1].embedding
    tok = srv.engine.tokenizer
    n = sum(len(tok.encode(t)) for t in TEXTS[:2])
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    # the SDK asks for base64 by default and decodes it: the same float32 values
    b = client.embeddings.create(model=srv.model_name, input=TEXTS[:2])
    assert [d.embedding for d in b.data] == [d.embedding for d in r.data]
    raw = httpx.post(srv.url + "/v1/embeddings", json={"input": "Hi", "encoding_format": "base64"}).json()
    vec = struct.unpack(f"<{576}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(vec) == client.embeddings.create(model=srv.model_name, input="Hi",
                                                 encoding_format="float").data[0].embedding


def test_token_id_inputs_equal_text(client, srv):
    tok = srv.engine.tokenizer
    ids = [tok.encode(t) for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=srv.model_name, input=TEXTS[:2], encoding_format="float")
    by_ids = client.embeddings.create(model=srv.model_name, input=ids, encoding_format="float")
    one = client.embeddings.create(model=srv.model_name, input=ids[0], encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in by_text.data]
    assert one.data[0].embedding == by_text.data[0].embedding


def test_dimensions_truncate_and_renormalise(client, srv):
    full = client.embeddings.create(model=srv.model_name, input="Hi", encoding_format="float").data[0].embedding
    cut = client.embeddings.create(model=srv.model_name, input="Hi", dimensions=64,
                                   encoding_format="float").data[0].embedding
    assert len(cut) == 64 and abs(math.fsum(x * x for x in cut) - 1) < 1e-9
    assert _cos(cut, full[:64]) > 0.999999


def test_alone_equals_inside_a_batch_of_32_bitwise(client, srv):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    batch = [" ".join(words[:1 + (i * 7) % 12]) * (1 + i % 5) for i in range(31)] + [TEXTS[3]]
    alone = [client.embeddings.create(model=srv.model_name, input=t, encoding_format="float").data[0].embedding
             for t in (batch[0], batch[13], TEXTS[3])]
    together = client.embeddings.create(model=srv.model_name, input=batch, encoding_format="float").data
    assert len(together) == 32
    assert [together[0].embedding, together[13].embedding, together[31].embedding] == alone
    assert kv_blocks_used(httpx.get(srv.url + "/metrics").text) == 0  # nothing held once answered


def test_paraphrases_closer_than_unrelated(client, srv):
    texts = ["The weather is lovely today.", "It is a beautiful sunny day.",
             "The stock market crashed after the announcement."]
    a, b, c = (d.embedding for d in client.embeddings.create(model=srv.model_name, input=texts,
                                                             encoding_format="float").data)
    assert _cos(a, b) > _cos(a, c) and _cos(a, b) > _cos(b, c)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"), ({"input": 3}, "input"),
    ({"input": [1, "a"]}, "input"), ({"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "Hi", "dimensions": 0}, "dimensions"), ({"input": "Hi", "dimensions": 100000}, "dimensions"),
    ({"input": [10 ** 9]}, None), ({"input": "Hi", "model": "nope"}, "model"), ({}, "input"),
])
def test_bad_bodies_are_openai_4xx(srv, body, param):
    r = httpx.post(srv.url + "/v1/embeddings", json=body)
    assert 400 <= r.status_code < 500
    err = assert_error_shape(r, r.status_code)
    if param is not None:
        assert (err["param"] or "").startswith(param), err


def test_llm_embed_pooling_and_normalize():
    from kvinfer.engine.llm import LLM

    llm = LLM(kv_cache_memory=64 << 20, max_model_len=256)
    last = llm.embed(TEXTS[:3])
    assert llm.embed(TEXTS[0]) == [last[0]]
    mean = llm.embed(TEXTS[:3], pooling="mean")
    cls = llm.embed(TEXTS[:3], pooling="cls")
    assert mean[0] != last[0] and cls[0] != mean[0]
    # cls is the first token's state: the same for texts that begin with the same token
    assert llm.embed(["The dog", "The cat"], pooling="cls")[0] == llm.embed(["The moon"], pooling="cls")[0]
    # mean over a chunked prompt equals mean over one chunk
    chunked = LLM(kv_cache_memory=64 << 20, max_model_len=256, max_num_batched_tokens=16)
    assert chunked.embed(TEXTS[3], pooling="mean") == llm.embed(TEXTS[3], pooling="mean")
    unit = llm.embed(TEXTS[:1], normalize=True)[0]
    assert abs(math.fsum(x * x for x in unit) - 1) < 1e-9
    assert llm.engine.kv_usage()["blocks_used"] == 0
