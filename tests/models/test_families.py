"""Qwen2, Qwen3, Mistral, GPT-2 and BLOOM through the one decoder: logits and greedy tokens equal transformers'."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from kvinfer import LLM, SamplingParams
from kvinfer.errors import UnsupportedError
from kvinfer.layers.alibi import alibi_slopes
from kvinfer.models.families import FAMILIES, model_config_from_hf
from tests.family_helpers import FAMS, WINDOW
from tests.reference_helpers import engine_greedy, hf_greedy, hf_logits, load_decoder, prompts, save_tiny, step_logits

BACKENDS = ("none", "contiguous", "paged")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny shapes: a second OpenMP thread only adds hand-off latency (badly so on a busy machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class Ref:
    name: str
    path: str
    hf: object
    loaded: object
    prompt: list
    tokens: list  # transformers' greedy continuation, 32 tokens
    logits: torch.Tensor  # transformers' logits over prompt + tokens


_CACHE: dict[str, Ref] = {}


@pytest.fixture(scope="module")
def ref_of(tmp_path_factory):
    def get(name: str) -> Ref:
        if name not in _CACHE:
            fam = FAMS[name]
            path = tmp_path_factory.mktemp(name)
            hf = save_tiny(fam.config_cls, fam.model_cls, path, seed=1, **fam.init, **fam.config)
            prompt = prompts(1, seed=11, lo=13, hi=13)[0]  # crosses 4-token blocks and the window
            tokens = hf_greedy(hf, prompt, 32)
            _CACHE[name] = Ref(name, str(path), hf, load_decoder(path), prompt, tokens, hf_logits(hf, prompt + tokens))
        return _CACHE[name]

    yield get
    _CACHE.clear()


@pytest.mark.parametrize("name", FAMS)
def test_config_flags(name, ref_of):
    r = ref_of(name)
    cfg = r.loaded.config
    assert cfg.architecture == name
    for key, want in FAMS[name].expect.items():
        assert getattr(cfg, key) == want, key


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", FAMS)
def test_logits_match_transformers(name, kind, ref_of):
    """Prefill logits at every prompt position, then 16 decode steps fed transformers' own tokens."""
    r = ref_of(name)
    ours = step_logits(r.loaded, r.prompt, r.tokens[:16], kind, block_size=4)
    want = r.logits[:len(r.prompt) + 16]
    assert ours.shape == want.shape
    diff = (ours - want).abs().max().item()
    assert diff <= 1e-4, f"{name}/{kind}: max abs logits diff {diff:.2e}"


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", FAMS)
def test_greedy_matches_transformers(name, kind, ref_of):
    r = ref_of(name)
    assert engine_greedy(r.path, [r.prompt], 32, kind=kind, block_size=4)[0] == r.tokens


@pytest.mark.parametrize("kind", ("paged", "contiguous"))
@pytest.mark.parametrize("name", FAMS)
def test_batched_equals_alone(name, kind, ref_of):
    r = ref_of(name)
    ps = prompts(5, seed=7, lo=2, hi=19)
    llm = LLM(r.path, dtype="float32", device="cpu", kv_cache=kind, kv_cache_memory=4 << 20, block_size=4,
              max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in ps]
    assert together == alone


def test_mistral_window_is_applied_by_transformers_and_matters(ref_of):
    """Guard against a vacuous pass: the same weights without a window give different logits."""
    import transformers

    r = ref_of("mistral")
    cfg = transformers.MistralConfig(**dict(FAMS["mistral"].config, sliding_window=None))
    full = transformers.MistralForCausalLM(cfg).eval()
    full.load_state_dict(r.hf.state_dict())
    ids = r.prompt + r.tokens
    full_logits = hf_logits(full, ids)
    assert torch.allclose(full_logits[:WINDOW], r.logits[:WINDOW], atol=1e-5)
    assert (full_logits[WINDOW:] - r.logits[WINDOW:]).abs().max() > 1e-2


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 40])
def test_alibi_slopes_match_bloom(n):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    torch.testing.assert_close(alibi_slopes(n), _get_alibi_slopes(n, torch.device("cpu")), rtol=1e-6, atol=0)


def test_bloom_fused_qkv_is_deinterleaved(ref_of):
    """Our q/k/v rows equal the per-head slices transformers takes from query_key_value."""
    r = ref_of("bloom")
    w = r.hf.transformer.h[0].self_attention.query_key_value.weight  # [heads * 3 * dim, hidden]
    heads, dim = 6, 16
    per_head = w.view(heads, 3, dim, -1)
    ours = r.loaded.model.layers[0].attn.qkv.weight
    q, k, v = ours.split(heads * dim)
    for j, part in enumerate((q, k, v)):
        torch.testing.assert_close(part, per_head[:, j].reshape(heads * dim, -1), rtol=0, atol=0)


def test_gpt2_conv1d_is_transposed(ref_of):
    r = ref_of("gpt2")
    c_fc = r.hf.transformer.h[1].mlp.c_fc.weight  # Conv1D: [in, out]
    torch.testing.assert_close(r.loaded.model.layers[1].mlp.up.weight, c_fc.t(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt2", "bloom"])
def test_hub_style_names_load_the_same(name, ref_of, tmp_path):
    """The original hub files lack the 'transformer.' prefix; old GPT-2 ones also carry the mask buffers."""
    from safetensors.torch import load_file, save_file

    r = ref_of(name)
    src = load_file(f"{r.path}/model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in src.items()}
    if name == "gpt2":
        renamed["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
        renamed["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{r.path}/config.json").read())
    other = load_decoder(tmp_path).model.state_dict()
    for k, v in r.loaded.model.state_dict().items():
        assert torch.equal(v, other[k]), k


# ---- config normalisation: what transformers does with each family's keys -------------------------------


def _qwen2(**kw):
    d = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    d.update(kw)
    return d


def test_qwen_window_needs_use_sliding_window():
    import transformers

    # transformers drops sliding_window unless use_sliding_window is set; so do we.
    assert transformers.Qwen2Config(**_qwen2()).sliding_window is None
    assert model_config_from_hf(_qwen2()).sliding_window is None
    assert model_config_from_hf(_qwen2(use_sliding_window=False)).sliding_window is None
    # Windowed from layer max_window_layers on: none of 4 layers, or all of them.
    assert model_config_from_hf(_qwen2(use_sliding_window=True, max_window_layers=4)).sliding_window is None
    assert model_config_from_hf(_qwen2(use_sliding_window=True, max_window_layers=0)).sliding_window == 16
    q3 = dict(_qwen2(use_sliding_window=True, max_window_layers=0), model_type="qwen3")
    assert model_config_from_hf(q3).sliding_window == 16


def test_qwen_window_on_some_layers_is_unsupported():
    with pytest.raises(UnsupportedError, match="sliding-window attention on only some layers"):
        model_config_from_hf(_qwen2(use_sliding_window=True, max_window_layers=2))
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(UnsupportedError, match="2 of 4"):
        model_config_from_hf(_qwen2(use_sliding_window=True, layer_types=types))


def test_mistral_window_default_and_null():
    d = dict(model_type="mistral", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, attention_bias=True)
    # transformers' MistralConfig defaults sliding_window to 4096 and never adds biases.
    cfg = model_config_from_hf(d)
    assert cfg.sliding_window == 4096 and not cfg.qkv_bias and not cfg.o_bias
    assert model_config_from_hf(dict(d, sliding_window=None)).sliding_window is None


@pytest.mark.parametrize("act,want", [("gelu_new", "gelu_tanh"), ("gelu_pytorch_tanh", "gelu_tanh"),
                                      ("gelu", "gelu")])
def test_gpt2_activations(act, want):
    d = dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, activation_function=act)
    assert model_config_from_hf(d).activation == want


@pytest.mark.parametrize("d,what", [
    (dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, activation_function="relu"), "relu"),
    (dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, scale_attn_by_inverse_layer_idx=True),
     "scale_attn_by_inverse_layer_idx"),
    (dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, scale_attn_weights=False),
     "scale_attn_weights"),
    (dict(model_type="bloom", vocab_size=256, hidden_size=64, n_layer=2, n_head=4,
          apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm"),
])
def test_unsupported_variants_are_named(d, what):
    with pytest.raises(UnsupportedError, match=what):
        model_config_from_hf(d)


def test_unsupported_model_type_names_it_and_lists_supported(tmp_path):
    with pytest.raises(UnsupportedError) as e:
        model_config_from_hf(dict(model_type="mamba", vocab_size=256))
    msg = str(e.value)
    assert "'mamba'" in msg
    for fam in FAMILIES:
        assert fam in msg
    # Through the front door too: a directory whose config.json names an unknown family.
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gpt_neox", vocab_size=256)))
    with pytest.raises(UnsupportedError, match="'gpt_neox'.*supported: .*bloom.*gpt2.*llama.*mistral.*qwen2.*qwen3"):
        LLM(str(tmp_path), dtype="float32")


def test_every_family_is_registered_once_with_its_knowledge():
    from kvinfer.loaders.gguf_loader import SUPPORTED_ARCHITECTURES
    from kvinfer.models.families import GGUF_FAMILIES, by_architecture

    assert len({f.architecture for f in FAMILIES.values()}) == len(FAMILIES)
    for model_type, fam in FAMILIES.items():
        assert fam.model_type == model_type and by_architecture(fam.architecture) is fam
    assert SUPPORTED_ARCHITECTURES == tuple(GGUF_FAMILIES) == ("llama", "qwen2", "qwen3", "gemma3", "phi3",
                                                                 "qwen3moe", "qwen2moe")
    assert all(fam.gguf.architecture == arch for arch, fam in GGUF_FAMILIES.items())


def test_a_family_registered_from_one_file_loads(tmp_path):
    """What a new family's file does (register a normaliser and a weight map) is all loading a checkpoint needs."""
    from kvinfer.models.families import registry
    from kvinfer.models.families.llama import llama_like, map_llama
    from tests.conftest import save_tiny_llama

    save_tiny_llama(tmp_path / "llama")
    d = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "config.json").write_text(json.dumps(dict(d, model_type="toy_llama")))
    (tmp_path / "toy" / "model.safetensors").symlink_to(tmp_path / "llama" / "model.safetensors")
    with pytest.raises(UnsupportedError, match="'toy_llama'"):
        load_decoder(tmp_path / "toy")
    fam = registry.register(registry.Family("toy_llama", "toy", lambda d: llama_like(d, "toy"), map_llama))
    try:
        with pytest.raises(ValueError, match="registered twice"):
            registry.register(fam)
        toy, llama = load_decoder(tmp_path / "toy"), load_decoder(tmp_path / "llama")
        assert toy.config.architecture == "toy"
        want = dict(llama.model.named_parameters())
        assert all(torch.equal(p, want[n]) for n, p in toy.model.named_parameters())
    finally:
        del registry.FAMILIES["toy_llama"], registry._BY_ARCHITECTURE["toy"]
