"""README's server chat example, sent as it is (no max_tokens, no temperature), answers to the end (issue 46,
item 12): the endpoint's defaults run to EOS and sample as the model's authors publish (greedy for the built-in
model), where they used to cut the answer at 16 tokens of temperature-1.0 noise."""
from __future__ import annotations

import openai
import pytest

from server_helpers import engine_config, start_server

README_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config())
    yield s
    s.stop()


def test_readme_chat_example_answers_to_the_end(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    answers = []
    for _ in range(2):
        r = client.chat.completions.create(model=model, messages=README_MESSAGES)
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        assert "Paris" in c.message.content
        answers.append(c.message.content)
    # The default sampling is the model's own (greedy here), so the pasted example gives one answer every time.
    assert answers[0] == answers[1]
