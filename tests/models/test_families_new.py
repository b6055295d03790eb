"""Gemma 3, Phi-3 and the mixture-of-experts families against transformers: logits, greedy tokens, exactness."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from kvinfer import LLM, SamplingParams
from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.models.families import model_config_from_hf
from tests.exactness_helpers import HYPOTHESIS_SETTINGS, check_served, sample_requests, serve_alone, ways
from tests.family_helpers import GEMMA3, NEW_FAMS as FAMS
from tests.reference_helpers import (TINY_LLAMA_LIKE, hf_greedy, hf_logits, load_decoder, prompts, save_tiny,
                                     step_logits)

BACKENDS = ("none", "contiguous", "paged")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_CACHE: dict = {}


@pytest.fixture(scope="module")
def ref_of(tmp_path_factory):
    def get(name):
        if name not in _CACHE:
            fam = FAMS[name]
            path = tmp_path_factory.mktemp(name)
            hf = save_tiny(fam.config_cls, fam.model_cls, path, seed=1, **fam.init, **fam.config)
            prompt = prompts(1, seed=11, lo=13, hi=13)[0]
            tokens = hf_greedy(hf, prompt, 32)
            _CACHE[name] = (str(path), hf, load_decoder(path), prompt, tokens, hf_logits(hf, prompt + tokens))
        return _CACHE[name]

    yield get
    _CACHE.clear()


@pytest.mark.parametrize("name", FAMS)
def test_config_flags(name, ref_of):
    cfg = ref_of(name)[2].config
    for key, want in FAMS[name].expect.items():
        assert getattr(cfg, key) == want, key


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", FAMS)
def test_logits_match_transformers(name, kind, ref_of):
    path, hf, loaded, prompt, tokens, logits = ref_of(name)
    ours = step_logits(loaded, prompt, tokens[:16], kind, block_size=4)
    diff = (ours - logits[:len(prompt) + 16]).abs().max().item()
    assert diff <= 1e-4, f"{name}/{kind}: max abs logits diff {diff:.2e}"


@pytest.mark.parametrize("prefix", (False, True))
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", FAMS)
def test_greedy_matches_transformers(name, kind, prefix, ref_of):
    """The engine's greedy tokens equal transformers', with prompts chunked 5 tokens a step and, second time
    round, the prompt's blocks served from the prefix cache."""
    path, hf, loaded, prompt, tokens, logits = ref_of(name)
    assert len(set(tokens)) > 4, "a degenerate reference: the model repeats itself"
    llm = LLM(path, dtype="float32", device="cpu", kv_cache=kind, kv_cache_memory=4 << 20, block_size=4,
              max_model_len=64, max_num_batched_tokens=5, enable_prefix_caching=prefix)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for _ in range(2 if prefix else 1):
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == tokens


@pytest.mark.parametrize("name", FAMS)
def test_every_new_family_is_exact_however_served(name, ref_of):
    path, hf, loaded, *_ = ref_of(name)
    reqs = sample_requests(loaded.config.vocab_size, 3)
    alone = serve_alone(loaded, path, reqs)

    @settings(max_examples=4, **HYPOTHESIS_SETTINGS)
    @given(way=ways)
    def prop(way):
        check_served(loaded, path, reqs, alone, way)

    prop()


def test_gemma3_windows_and_local_rope_matter(ref_of):
    """Guard against a vacuous pass: without the window, or with the global RoPE base everywhere, transformers'
    own logits change."""
    import transformers

    path, hf, loaded, prompt, tokens, logits = ref_of("gemma3")
    for change in (dict(sliding_window=1000),
                   dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": GEMMA3["rope_parameters"]["full_attention"]})):
        other = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**dict(GEMMA3, **change))).eval()
        other.load_state_dict(hf.state_dict())
        assert (hf_logits(other, prompt + tokens) - logits).abs().max() > 1e-2, change


def test_longrope_takes_the_long_factors_past_the_original_length(ref_of):
    rot = ref_of("phi3")[2].model.rotary
    inv_short = 1.0 / (torch.tensor([1.0, 1.5, 2.0, 3.0]) * 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    inv_long = inv_short * torch.tensor([1.0, 1.5, 2.0, 3.0]) / torch.tensor([2.0, 3.0, 4.0, 5.0])
    att = (1 + torch.log(torch.tensor(256 / 64)) / torch.log(torch.tensor(64.0))).sqrt()
    torch.testing.assert_close(rot.cos[63], (63 * inv_short).cos() * att)
    torch.testing.assert_close(rot.cos[64], (64 * inv_long).cos() * att)


@pytest.mark.parametrize("renormalise", (False, True))
def test_router_topk_matches_a_float64_reference(renormalise):
    from kvinfer.layers.moe import route

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 16, generator=g) * 3
    weights, experts = route(logits, 4, renormalise)
    p = torch.softmax(logits.double(), dim=-1)
    want_w, want_e = torch.topk(p, 4, dim=-1)
    if renormalise:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(experts, want_e)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-6, atol=1e-7)
    assert weights.dtype == torch.float32 and bool((weights[:, :-1] >= weights[:, 1:]).all())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_expert_grouped_step_equals_rows_one_at_a_time(name, ref_of):
    """The loaded layer (kernel matmuls, as served): a step of 23 rows, grouped by expert, gives each row the
    very bits it gets alone, and in any order of the rows."""
    moe = ref_of(name)[2].model.layers[1].mlp
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        together = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(23)])
        perm = torch.randperm(23, generator=torch.Generator().manual_seed(6))
        shuffled = moe(x[perm])
    assert torch.equal(together, alone)
    assert torch.equal(shuffled, together[perm])
    # The step really shared experts among rows (else grouping was never exercised).
    from kvinfer.layers.moe import route
    _, experts = route(moe.router(x), moe.top_k, moe.renormalise)
    assert torch.bincount(experts.flatten()).max() > 3


def test_moe_total_and_active_parameters(ref_of):
    cfg = ref_of("mixtral")[2].config
    model = ref_of("mixtral")[2].model
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    assert cfg.num_parameters() - cfg.num_active_parameters() == 2 * 2 * 3 * 64 * 64  # 2 layers, 2 idle experts


@pytest.mark.parametrize("d, msg", [
    (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(model_type="phi3", rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling type 'dynamic'"),
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(model_type="gemma3_text", hidden_activation="relu"), "hidden_activation 'relu'"),
])
def test_bad_configs_are_one_line_errors(d, msg):
    base = dict(TINY_LLAMA_LIKE)
    base.update(d)
    with pytest.raises((UnsupportedError, ModelLoadError), match=msg) as e:
        model_config_from_hf(base)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset, total, active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9),
                                                   ("gemma-3-1b", 1.0e9, 1.0e9), ("phi-4-mini", 3.8e9, 3.8e9)])
def test_plan_shows_total_and_active_parameters(preset, total, active):
    """The released models' published sizes; weight memory is planned for every expert."""
    from kvinfer.models.families import preset_config
    from kvinfer.lab.plan import format_plan, make_plan

    cfg = preset_config(preset)
    p = make_plan(cfg, 64 << 30, 4096, "bfloat16")
    assert abs(p["num_parameters"] - total) < 0.06e9 and abs(p["num_active_parameters"] - active) < 0.06e9
    assert p["weight_bytes"] == p["num_parameters"] * 2
    assert ("active per token" in format_plan(p)) == (cfg.num_experts > 0)


def test_models_lists_every_family(capsys):
    from kvinfer.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("gemma3_text", "phi3", "qwen3_moe", "qwen2_moe", "mixtral", "llama", "qwen3"):
        assert name in out
