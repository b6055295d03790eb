"""scripts/make_gguf.py: random-weight GGUF files at a model's shape that load with the built-in tokenizer."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvinfer.config import EngineConfig
from kvinfer.loaders.gguf_loader import read_gguf, read_metadata
from kvinfer.loaders.model_loader import load_model
from kvinfer.utils import builtin_model_path
from tests.reference_helpers import step_logits

_spec = importlib.util.spec_from_file_location("make_gguf",
                                               Path(__file__).resolve().parents[2] / "scripts/make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)


@pytest.mark.parametrize("shape,qtype", [("tiny", "Q4_0"), ("tiny", "F16"), ("tiny-qwen3", "Q8_0")])
def test_tiny_file_loads_and_runs(tmp_path, shape, qtype):
    path = make_gguf.make(tmp_path / "m.gguf", shape, qtype)
    arch, h, n, heads, kv, hd, ffn, tied, _, _ = make_gguf.SHAPES[shape]
    meta = read_metadata(path)
    built_in = read_metadata(builtin_model_path())
    assert meta["tokenizer.ggml.tokens"] == built_in["tokenizer.ggml.tokens"]
    assert meta["tokenizer.chat_template"] == built_in["tokenizer.chat_template"]
    ck = read_gguf(path)
    assert (ck.config.architecture, ck.config.hidden_size, ck.config.num_layers, ck.config.head_dim) == (arch, h, n, hd)
    assert ck.config.tie_word_embeddings == tied
    kinds = {t for name, t in ck.tensor_types.items() if name.endswith("proj.weight")}
    assert kinds == {qtype}
    w = ck.tensors["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std().item() < 0.025  # normal * 0.02, through the quantizer
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    ids = loaded.tokenizer.encode("Hello there")
    logits = step_logits(loaded, ids, [5, 6], "paged")
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_seed_changes_weights_and_repeats(tmp_path):
    a = make_gguf.make(tmp_path / "a.gguf", "tiny", "Q8_0", seed=1).read_bytes()
    b = make_gguf.make(tmp_path / "b.gguf", "tiny", "Q8_0", seed=1).read_bytes()
    c = make_gguf.make(tmp_path / "c.gguf", "tiny", "Q8_0", seed=2).read_bytes()
    assert a == b and a != c


def test_missing_llama_quantize_is_named(tmp_path, capsys):
    rc = make_gguf.main(["--shape", "tiny", "--type", "Q4_K_M", "--out", str(tmp_path / "k.gguf"),
                         "--llama-quantize", str(tmp_path / "no-such-llama-quantize")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "no-such-llama-quantize" in err and "does not exist" in err


@pytest.mark.skipif(not Path(make_gguf.DEFAULT_QUANTIZE).is_file(), reason=f"{make_gguf.DEFAULT_QUANTIZE} is not built")
def test_k_quant_mix_through_llama_quantize(tmp_path):
    path = make_gguf.make(tmp_path / "k.gguf", "tiny-256", "Q4_K_M")
    ck = read_gguf(path)
    assert {"Q4_K", "Q6_K"} <= set(ck.tensor_types.values())
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    assert torch.isfinite(step_logits(loaded, [1, 2, 3], [4], "paged")).all()


def _moe_step_is_row_invariant(moe, hidden: int) -> None:
    """The loaded MoE layer over a step of rows gives each row the bits it gets alone, in any row order."""
    x = torch.randn(19, hidden, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        together = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(len(x))])
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(8))
        shuffled = moe(x[perm])
    assert torch.equal(together, alone)
    assert torch.equal(shuffled, together[perm])


@pytest.mark.parametrize("shape, qtype", [("tiny-qwen3moe", "F16"), ("tiny-qwen3moe", "Q8_0"),
                                          ("tiny-qwen2moe", "F16"), ("tiny-qwen2moe", "Q8_0")])
def test_tiny_moe_file_loads_and_runs(tmp_path, shape, qtype):
    from kvinfer.layers.moe import MoE
    from kvinfer.layers.quant_linear import KernelLinear, QuantLinear

    path = make_gguf.make(tmp_path / "m.gguf", shape, qtype)
    arch, h, n, heads, kv, hd, ffn, tied, _, _ = make_gguf.SHAPES[shape]
    experts, top_k = make_gguf.MOE[shape]
    shared = make_gguf.SHARED.get(shape, 0)
    meta = read_metadata(path)
    assert meta["general.architecture"] == arch
    assert (meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]) == (experts, top_k)
    ck = read_gguf(path)
    c = ck.config
    family = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}[arch]
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size) == (family, experts, top_k, ffn, shared)
    # llama.cpp renormalises qwen3moe's top-k weights and takes qwen2moe's as they are.
    assert c.norm_topk_prob == (arch == "qwen3moe") and c.qkv_bias == (arch == "qwen2moe")
    assert ck.tensor_types["model.layers.0.mlp.gate.weight"] == "F32"  # the router, as llama.cpp's converter
    kinds = {t for name, t in ck.tensor_types.items() if ".experts." in name}
    assert kinds == {qtype}
    assert len([k for k in ck.tensors if k.startswith("model.layers.1.mlp.experts.")]) == 3 * experts
    w = ck.tensors[f"model.layers.1.mlp.experts.{experts - 1}.down_proj.weight"]
    assert tuple(w.shape) == (h, ffn) and 0.015 < w.float().std().item() < 0.025
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    moe = loaded.model.layers[1].mlp
    assert isinstance(moe, MoE) and len(moe.experts) == experts and moe.top_k == top_k
    assert isinstance(moe.experts[0].down, QuantLinear) == (qtype == "Q8_0")
    logits = step_logits(loaded, loaded.tokenizer.encode("Hello there"), [5, 6], "paged")
    assert torch.isfinite(logits).all() and logits.std() > 0
    if shared:  # the shared expert kept quantized as the routed ones are, its gate a float row
        assert ck.tensor_types["model.layers.1.mlp.shared_expert_gate.weight"] == "F32"
        assert tuple(ck.tensors["model.layers.1.mlp.shared_expert_gate.weight"].shape) == (1, h)
        assert (moe.shared.down.out_features, moe.shared.down.in_features) == (h, shared)
        assert isinstance(moe.shared.down, QuantLinear) == isinstance(moe.shared.gate_up, QuantLinear) == \
            (qtype == "Q8_0")
        assert isinstance(moe.shared_gate, KernelLinear) and tuple(moe.shared_gate.weight.shape) == (1, h)
    else:
        assert moe.shared is None
    _moe_step_is_row_invariant(moe, h)


@pytest.mark.skipif(not Path(make_gguf.DEFAULT_QUANTIZE).is_file(), reason=f"{make_gguf.DEFAULT_QUANTIZE} is not built")
@pytest.mark.parametrize("shape", ["tiny-256-qwen3moe", "tiny-256-qwen2moe"])
def test_moe_k_quant_mix_through_llama_quantize(tmp_path, shape):
    """llama-quantize takes the file (its reader is llama.cpp's) and keeps the router (and Qwen2-MoE's shared-expert
    gate, which it rewrites 1-D) float; the experts (and the shared one) stay in their K-quant types in kvinfer, and
    the grouped step is row-invariant on them."""
    from kvinfer.layers.quant_linear import QuantLinear

    path = make_gguf.make(tmp_path / "k.gguf", shape, "Q4_K_M")
    ck = read_gguf(path)
    kinds = {t for name, t in ck.tensor_types.items() if ".experts." in name or ".shared_expert." in name}
    assert kinds <= {"Q4_K", "Q6_K"} and "Q4_K" in kinds
    assert ck.tensor_types["model.layers.0.mlp.gate.weight"] == "F32"
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    assert torch.isfinite(step_logits(loaded, [1, 2, 3], [4], "paged")).all()
    moe = loaded.model.layers[0].mlp
    if shape in make_gguf.SHARED:
        assert read_gguf(path).tensors["model.layers.0.mlp.shared_expert_gate.weight"].dim() == 1  # as written
        assert isinstance(moe.shared.gate_up, QuantLinear) and isinstance(moe.shared.down, QuantLinear)
        assert tuple(moe.shared_gate.weight.shape) == (1, 256)
    _moe_step_is_row_invariant(moe, 256)


def _moe_reference(moe, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer as first written: each expert's rows gathered and run through the module, scaled by their
    weights, written to their (row, rank) slots, a row's experts summed in rank order."""
    from kvinfer.layers.moe import route

    n, h = x.shape
    weights, experts = route(moe.router(x), moe.top_k, moe.renormalise)
    weights = weights.reshape(-1, 1)
    flat = experts.reshape(-1)
    picked = x.new_empty(n * moe.top_k, h)
    for e in range(moe.num_experts):
        idx = (flat == e).nonzero().flatten()
        if len(idx):
            picked[idx] = moe.experts[e](x[idx // moe.top_k]) * weights[idx]
    picked = picked.view(n, moe.top_k, h)
    out = picked[:, 0]
    for r in range(1, moe.top_k):
        out = out + picked[:, r]
    return out


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_moe_step_equals_the_reference_layer_and_keeps_prompt_roles(tmp_path, qtype):
    """The grouped step (kernel calls made directly, outputs written in place) gives the module-by-module
    reference's bits, for one row and for many; under prompt spans (the runner's prompt rows) each expert sees
    its own rows' roles, and the bits stay those of the step without spans where the prompt route is off."""
    from kvinfer.layers.forward_context import ForwardContext, set_forward_context
    from kvinfer.layers.quant_linear import prompt_route_on

    path = make_gguf.make(tmp_path / "m.gguf", "tiny-qwen3moe", qtype)
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    moe = loaded.model.layers[0].mlp
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        for rows in (x[:1], x[3:4], x):
            assert torch.equal(moe(rows), _moe_reference(moe, rows))
        with set_forward_context(ForwardContext(prompt_spans=[(0, 7), (12, 21)])):
            spanned = moe(x)
        plain = moe(x)
    if not prompt_route_on():
        assert torch.equal(spanned, plain)
    assert torch.isfinite(spanned).all()


def test_prompt_spans_map_to_each_experts_rows():
    from kvinfer.layers.moe import _row_roles, _spans_of

    roles = _row_roles([(1, 3), (5, 6)], 7)
    assert roles == [False, True, True, False, False, True, False]
    assert _spans_of([roles[i] for i in (0, 2, 5, 6)]) == [(1, 3)]
    assert _spans_of([True, True]) == [(0, 2)] and _spans_of([False]) == []
