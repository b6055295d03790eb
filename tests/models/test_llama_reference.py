"""Llama-family reference tests: MHA/GQA/MQA, tied heads, RoPE scaling, caches, batching, shards, load errors."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvinfer import LLM, SamplingParams
from kvinfer.models.families import FAMILIES
from kvinfer.errors import ModelLoadError, UnsupportedError
from tests.reference_helpers import (TINY_LLAMA_LIKE, engine_greedy, hf_greedy, hf_logits, load_decoder, prompts,
                                     save_tiny, step_logits)

BACKENDS = ("none", "contiguous", "paged")

# original_max_position_embeddings=32 puts head_dim 16's wavelengths (6 to ~20000) in all three llama3 bands.
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
# YaRN over a short original length and narrow beta band: head_dim 16's frequencies fall on both sides of the ramp
# and inside it; the attention factor (1 + 0.1 ln 4) is derived, as transformers derives it.
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, beta_fast=8.0,
            beta_slow=0.5)
VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "mqa": dict(num_key_value_heads=1),
    "rope-llama3": dict(num_key_value_heads=2, rope_parameters=LLAMA3),
    "rope-linear": dict(num_key_value_heads=2, rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                    factor=2.0)),
    "rope-yarn": dict(num_key_value_heads=2, rope_parameters=YARN),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny shapes: a second OpenMP thread only adds hand-off latency (badly so on a busy machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_CACHE: dict = {}


@pytest.fixture(scope="module")
def ref_of(tmp_path_factory):
    """name -> (dir, transformers model, our loaded decoder, prompt, HF greedy tokens, HF logits)."""
    def get(name):
        if name not in _CACHE:
            path = tmp_path_factory.mktemp(name)
            hf = save_tiny("LlamaConfig", "LlamaForCausalLM", path, seed=2, **dict(TINY_LLAMA_LIKE, **VARIANTS[name]))
            prompt = prompts(1, seed=5, lo=14, hi=14)[0]
            tokens = hf_greedy(hf, prompt, 32)
            _CACHE[name] = (str(path), hf, load_decoder(path), prompt, tokens, hf_logits(hf, prompt + tokens))
        return _CACHE[name]

    yield get
    _CACHE.clear()


def test_variants_are_what_they_claim(ref_of):
    kv = {name: ref_of(name)[2].config.num_kv_heads for name in VARIANTS}
    assert (kv["mha"], kv["gqa-tied"], kv["mqa"]) == (4, 2, 1)
    tied = ref_of("gqa-tied")[2]
    assert tied.config.tie_word_embeddings
    # tied: no head of its own, or (on the kernel path) a KernelLinear over the embedding's very tensor
    assert tied.model.lm_head is None or tied.model.lm_head.weight.data_ptr() == tied.model.embed.weight.data_ptr()
    assert not ref_of("mha")[2].config.tie_word_embeddings
    assert ref_of("rope-llama3")[2].config.rope_scaling.type == "llama3"
    assert ref_of("rope-linear")[2].config.rope_scaling.factor == 2.0
    yarn = ref_of("rope-yarn")[2].config.rope_scaling
    assert (yarn.type, yarn.factor, yarn.beta_fast, yarn.beta_slow) == ("yarn", 4.0, 8.0, 0.5)
    assert yarn.attention_factor == pytest.approx(1 + 0.1 * math.log(4.0))


@pytest.mark.parametrize("name", ["rope-llama3", "rope-linear", "rope-yarn"])
def test_rope_scaling_matters(name, ref_of):
    """Guard against a vacuous pass: the same weights with plain RoPE give different logits."""
    import transformers

    path, hf, loaded, prompt, tokens, want = ref_of(name)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(TINY_LLAMA_LIKE, num_key_value_heads=2)))
    plain.load_state_dict(hf.state_dict())
    assert (hf_logits(plain.eval(), prompt + tokens) - want).abs().max() > 1e-2


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_transformers(name, kind, ref_of):
    path, hf, loaded, prompt, tokens, want = ref_of(name)
    ours = step_logits(loaded, prompt, tokens[:16], kind, block_size=4)
    diff = (ours - want[:len(prompt) + 16]).abs().max().item()
    assert diff <= 1e-4, f"{name}/{kind}: max abs logits diff {diff:.2e}"


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_matches_transformers(name, kind, ref_of):
    path, hf, loaded, prompt, tokens, _ = ref_of(name)
    assert engine_greedy(path, [prompt], 32, kind=kind, block_size=4)[0] == tokens


@pytest.mark.parametrize("name", VARIANTS)
def test_none_and_contiguous_agree(name, ref_of):
    path, hf, loaded, prompt, tokens, _ = ref_of(name)
    recompute = step_logits(loaded, prompt, tokens[:16], "none")
    cached = step_logits(loaded, prompt, tokens[:16], "contiguous")
    diff = (recompute - cached).abs().max().item()
    assert diff <= 1e-5, f"none vs contiguous: {diff:.2e}"
    assert engine_greedy(path, [prompt], 32, kind="none") == engine_greedy(path, [prompt], 32, kind="contiguous")


def test_contiguous_cache_grows_one_position_per_step(ref_of):
    path, hf, loaded, prompt, tokens, _ = ref_of("gqa-tied")
    seen = []
    prev = {}

    def check(kv, n):
        # n tokens cached: positions [0, n) written, [n, max_len) still zero, earlier positions untouched.
        for layer in range(kv.num_layers):
            for which, cache in (("k", kv.k[layer]), ("v", kv.v[layer])):
                rows = cache[0]  # slot 0: [kv_heads, max_len, dim]
                written = rows[:, :n].abs().amax(dim=(0, 2))  # [n]
                assert (written > 0).all(), f"layer {layer} {which}: a position below {n} is empty"
                assert not rows[:, n:].any(), f"layer {layer} {which}: written beyond position {n - 1}"
                key = (layer, which)
                if key in prev:
                    assert torch.equal(rows[:, :prev[key].shape[1]], prev[key]), "an earlier position changed"
                    assert prev[key].shape[1] == n - 1
                prev[key] = rows[:, :n].clone()
        seen.append(n)

    step_logits(loaded, prompt, tokens[:16], "contiguous", on_step=check)
    assert seen == list(range(len(prompt), len(prompt) + 17))


@pytest.mark.parametrize("kind", ("paged", "contiguous"))
@pytest.mark.parametrize("name", ["gqa-tied", "mqa", "rope-llama3"])
def test_batch_of_8_equals_each_alone(name, kind, ref_of):
    path = ref_of(name)[0]
    ps = prompts(8, seed=9, lo=1, hi=30)
    assert len({len(p) for p in ps}) >= 6
    together = engine_greedy(path, ps, 24, kind=kind, block_size=4)
    llm = LLM(path, dtype="float32", device="cpu", kv_cache=kind, kv_cache_memory=4 << 20, block_size=4,
              max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in ps]
    assert together == alone


def test_sharded_checkpoint_equals_unsharded(tmp_path):
    kw = dict(TINY_LLAMA_LIKE, num_key_value_heads=2)
    save_tiny("LlamaConfig", "LlamaForCausalLM", tmp_path / "one", seed=3, **kw)
    save_tiny("LlamaConfig", "LlamaForCausalLM", tmp_path / "sharded", seed=3, max_shard_size="40KB", **kw)
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_decoder(tmp_path / "one"), load_decoder(tmp_path / "sharded")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    p = prompts(1, seed=1, lo=9, hi=9)[0]
    feed = [5, 6, 7]
    assert torch.equal(step_logits(a, p, feed, "paged"), step_logits(b, p, feed, "paged"))


def test_missing_shard_is_a_load_error(tmp_path):
    save_tiny("LlamaConfig", "LlamaForCausalLM", tmp_path, seed=3, max_shard_size="40KB", **TINY_LLAMA_LIKE)
    sorted(tmp_path.glob("*.safetensors"))[-1].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_decoder(tmp_path)


def test_missing_path_is_a_load_error(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        LLM(str(missing), dtype="float32")
    assert str(missing) in str(e.value)


def test_directory_without_config_is_a_load_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json") as e:
        LLM(str(tmp_path), dtype="float32")
    assert str(tmp_path) in str(e.value)


def test_unsupported_model_type_is_unsupported_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="falcon", vocab_size=256)))
    with pytest.raises(UnsupportedError) as e:
        LLM(str(tmp_path), dtype="float32")
    assert "'falcon'" in str(e.value)
    assert all(f in str(e.value) for f in FAMILIES)


@pytest.mark.parametrize("params", [YARN, dict(YARN, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=32),
                                    dict(YARN, attention_factor=0.9, truncate=False),
                                    dict(YARN, mscale=1.0, mscale_all_dim=0.5)])
def test_yarn_frequencies_and_attention_factor_are_transformers_bits(params):
    """inv_freq bit for bit and the attention factor as transformers computes them, for each way of giving them."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvinfer.models.families import model_config_from_hf
    from kvinfer.layers.rotary import rope_inv_freq

    hf_cfg = transformers.LlamaConfig(**dict(TINY_LLAMA_LIKE, num_key_value_heads=2, rope_parameters=dict(params)))
    want, want_attention = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = model_config_from_hf(hf_cfg.to_dict())
    got = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(got, want.float())
    assert cfg.rope_scaling.attention_factor == pytest.approx(want_attention, rel=1e-12)
