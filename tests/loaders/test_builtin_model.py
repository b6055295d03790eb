"""The built-in SmolLM2-135M-Instruct GGUF against transformers loading the same file, and real text behaviour."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvinfer import SamplingParams
from kvinfer.kv.cache import NoCache, SeqSlice
from tests.conftest import assert_engine_clean

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "我爱学习，因为"]


@pytest.fixture(scope="module")
def hf_model(builtin_model_path):
    transformers = pytest.importorskip("transformers")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    p = Path(builtin_model_path)
    return transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                             dtype=torch.float32).eval()


def hf_greedy(model, ids, n):
    """Plain argmax with full recompute: generate()'s min_new_tokens would mask EOS, ignore_eos does not."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_logits_match_transformers_and_greedy_continuations(builtin_llm, hf_model):
    tok = builtin_llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = builtin_llm.generate([tok.encode(p) for p in PROMPTS], params)
    model = builtin_llm.engine.loaded.model
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 32), prompt
        # Logits at every position of prompt + continuation (the decode steps, teacher-forced).
        full = ids + out.outputs[0].token_ids[:16]
        with torch.inference_mode():
            ref = hf_model(torch.tensor([full])).logits[0].float()
            kv = NoCache(model.cfg.num_layers, "cpu")
            md = kv.prepare([SeqSlice(0, len(full))])
            n = len(full)
            ours = model.compute_logits(model(torch.tensor(full), torch.arange(n), md, kv))
        # The quantised matmuls round each 32-element block of activations to 16 bits (one arithmetic for every
        # batch size): logits within ~2e-2 of transformers' float32 (observed 0.021 on logits of magnitude ~15;
        # a wrong scale or element gives errors of order 1), 2.3e-3 on average over 12 prompts, up to 3.2e-3 for
        # one (any change in the float summation order moves each prompt's figure by 10-20% either way).
        diff = (ours - ref).abs()
        assert diff.max().item() <= 0.05 and diff.mean().item() <= 4e-3, prompt
    assert_engine_clean(builtin_llm.engine)


def test_stop_string_spanning_tokens(builtin_llm):
    tok = builtin_llm.tokenizer
    prompt = tok.encode("The capital of France is")
    base = builtin_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    pieces = [tok.decode([t]) for t in base.token_ids]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    start = base.text.index(stop)
    out = builtin_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                        stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:start]
    out = builtin_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                        include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == base.text[:start + len(stop)]


def test_streamed_deltas_join_to_text_and_hold_back_stop_prefixes(builtin_llm):
    eng = builtin_llm.engine
    tok = builtin_llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say 我爱学习 and 👍 twice."}]),
                        add_special_tokens=False)
    eng.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=40, stop=["zzzz"]))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            deltas.append(o.outputs[0].delta_text)
            final = o
    assert "".join(deltas) == final.outputs[0].text
    assert all("\ufffd" not in d for d in deltas)  # a character cut off by max_tokens is dropped, not replaced
    ids = [t for t in final.outputs[0].token_ids if t not in tok.eos_token_ids]
    assert final.outputs[0].text == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_chat_answer_mentions_paris(builtin_llm):
    [out] = builtin_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                             SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_reset_prefix_cache_and_llm_engine(builtin_llm):
    llm = builtin_llm
    assert llm.llm_engine is llm.engine
    prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens: " + "one two three four " * 8
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, sp)[0]
    again = llm.generate(prompt, sp)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    cold = llm.generate(prompt, sp)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    assert_engine_clean(llm.engine)


def test_offline_api_takes_vllms_forms(builtin_llm):
    """vLLM's LLM.generate / LLM.chat call forms: prompt dicts, the sampling_params keyword, a batch of
    conversations, a continued final message; each the same tokens as the plain form."""
    from kvinfer.errors import ValidationError

    llm, tok = builtin_llm, builtin_llm.get_tokenizer()
    assert tok is builtin_llm.engine.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=8)
    text, ids = "The capital of France is", tok.encode("def fib(n):")
    plain = [o.outputs[0].token_ids for o in llm.generate([text, ids], sp)]
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], sampling_params=sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == plain
    assert llm.generate({"prompt": text}, sp)[0].outputs[0].token_ids == plain[0]

    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
    batch = llm.chat(convs, sampling_params=sp)
    assert [o.outputs[0].token_ids for o in batch] == [llm.chat(c, sp)[0].outputs[0].token_ids for c in convs]
    assert batch[0].prompt_token_ids == tok.encode(tok.apply_chat_template(convs[0]), add_special_tokens=False)

    started = convs[0] + [{"role": "assistant", "content": "The capital of France is"}]
    [cont] = llm.chat(started, sp, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(cont.prompt_token_ids).endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in cont.outputs[0].text

    for call, param in [(lambda: llm.generate({"text": text}), "prompts[0]"),
                        (lambda: llm.generate([{"prompt": text, "prompt_token_ids": ids}]), "prompts[0]"),
                        (lambda: llm.chat(started, continue_final_message=True), "continue_final_message"),
                        (lambda: llm.chat(convs[0], chat_template_kwargs={"messages": []}), "chat_template_kwargs")]:
        with pytest.raises(ValidationError) as e:
            call()
        assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()
