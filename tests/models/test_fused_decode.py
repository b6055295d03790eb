"""FusedDecode (all layers of a decode step in one C call) against the eager per-layer path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvinfer import LLM, SamplingParams, kernels
from kvinfer.models.fused_decode import FusedDecode, unsupported_reason
from tests.conftest import assert_engine_clean
from tests.kernel_helpers import fused_calls, levels_here, run_fused as _run

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable on this machine")
LLAMA_QUANTIZE = "/work/llama/build/bin/llama-quantize"  # (scripts/make_gguf.py's default)




def _compare(builtin_llm, tol):
    eng = builtin_llm.engine
    prompts = [[1000 + (37 * i + j) % 20000 for j in range(3 + 11 * i)] for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True, logprobs=3) for i in range(7)]
    with fused_calls() as calls:
        fused = _run(builtin_llm, prompts, params, True)
    assert calls and max(calls) == 7  # decode-only steps went through the fused path, batched
    eager = _run(builtin_llm, prompts, params, False)
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=tol)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
    assert_engine_clean(eng)


@needs_kernels
def test_builtin_model_fused_matches_eager_bitwise(builtin_llm):
    # The fused step calls the eager path's own kernels in the same order: not close, identical.
    assert unsupported_reason(builtin_llm.engine.loaded.model, builtin_llm.engine.kv_cache) is None
    fd = FusedDecode(builtin_llm.engine.loaded.model, builtin_llm.engine.kv_cache)
    # the embedding lookup, the final norm and the tied Q8_0 head run inside the C step too
    assert fd.embed is not None and fd.final_norm is not None and fd.fuses_head
    # the kept copies travel in the table beside their weights (the tied embedding reads the head's)
    model = builtin_llm.engine.loaded.model
    head = model.lm_head._tiles
    for lin, got in ((model.layers[0].attn.qkv, fd.layers[0].qkv_kept), (model.layers[-1].mlp.down,
                                                                        fd.layers[-1].down_kept)):
        assert got == (lin._tiles.ptr if lin._tiles is not None else None)
    assert fd._head_kept == fd._embed_kept == (head.ptr if head is not None else None)
    assert (head is not None) == (kernels.active().keeps_tiles and kernels.active().level == "avx512"
                                  and kernels.keep_tiles_enabled())
    _compare(builtin_llm, 0.0)


@needs_kernels
def test_fused_path_counts_kv_projections(builtin_llm):
    kv = builtin_llm.engine.kv_cache
    before = kv.kv_computed
    _run(builtin_llm, [[1000, 1001, 1002]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), True)
    layers = builtin_llm.engine.model_config.num_layers
    assert kv.kv_computed - before == (3 + 4) * layers  # prompt once, then one per generated token but the last


def test_unsupported_models_and_backends_say_why(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 20)
    eng = llm.engine
    assert "QuantLinear" in unsupported_reason(eng.loaded.model, eng.kv_cache)  # float safetensors weights
    with pytest.raises(ValueError, match="fused decode unsupported"):
        FusedDecode(eng.loaded.model, eng.kv_cache)
    c = LLM(tiny_llama_dir, dtype="float32", kv_cache="contiguous", max_num_seqs=2).engine
    assert "contiguous" in unsupported_reason(c.loaded.model, c.kv_cache)


@needs_kernels
def test_a_model_with_mixed_type_projections_decodes_fused_bitwise(tmp_path):
    # Q4_K_M files mix types inside q/k/v (and sometimes gate/up): each part is its own matmul in the C step, as in
    # the eager path's QuantParts, so the tokens and logprobs are the eager path's exactly.
    from kvinfer.layers.quant_linear import QuantParts
    from tests.gguf_helpers import TYPES, write_mixed

    types = dict(TYPES, **{"blk.0.ffn_gate.weight": "Q4_0", "blk.0.ffn_down.weight": "Q8_0"})  # all kernel types
    path = write_mixed(tmp_path / "mixed.gguf", types=types)
    llm = LLM(str(path), kv_cache_memory=4 << 20, max_num_seqs=8)
    eng = llm.engine
    layer0 = eng.loaded.model.layers[0]
    assert isinstance(layer0.attn.qkv, QuantParts) and isinstance(layer0.mlp.gate_up, QuantParts)
    assert unsupported_reason(eng.loaded.model, eng.kv_cache) is None
    prompts = [[2 + (7 * i + j) % 60 for j in range(3 + 5 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True, logprobs=3) for i in range(4)]
    with fused_calls() as calls:
        fused = _run(llm, prompts, params, True)
    assert calls and eng.runner._fused is not None  # decode steps went through the C step
    eager = _run(llm, prompts, params, False)
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    assert_engine_clean(eng)


# A model run in a fresh process at one ISA level: the same prompts decoded with the fused step and with the eager
# path, batched, greedy and sampled; prints the level, how many decode calls went through the C step, and both
# runs' tokens and logprobs (as hex, so that the comparison is of bits).
_LEVEL_RUN = """
import importlib.util, json, sys
from kvinfer import LLM, SamplingParams, kernels
from kvinfer.models.fused_decode import unsupported_reason
from tests.kernel_helpers import fused_calls, run_fused
spec = importlib.util.spec_from_file_location("make_gguf", sys.argv[1] + "/scripts/make_gguf.py")
mg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mg)
path = mg.make(__import__("pathlib").Path(sys.argv[2]), sys.argv[3], sys.argv[5], seed=5)
llm = LLM(str(path), kv_cache_memory=4 << 20, max_num_seqs=8, block_size=16)
if sys.argv[4] == "shared":
    from tests.models.test_fused_decode import with_shared_experts
    with_shared_experts(llm)
elif sys.argv[4].startswith("bias"):
    from tests.models.test_fused_decode import with_biases
    with_biases(llm, more=sys.argv[4] == "bias+")
elif sys.argv[4] == "wide":  # FFN norms widened: the FFN's last bits then show in the residual stream
    for layer in llm.engine.loaded.model.layers:
        layer.post_attn_norm.weight.data.mul_(8.0)
reason = unsupported_reason(llm.engine.loaded.model, llm.engine.kv_cache)
# each layer's q/k/v: the type and whether a bias of each part (one part unless the types differ)
qkv = [[(p.qtype, p.bias is not None) for p in getattr(layer.attn.qkv, "parts", [layer.attn.qkv])]
       for layer in llm.engine.loaded.model.layers]
prompts = [[2 + (7 * i + j) % 200 for j in range(3 + 5 * i)] for i in range(5)]
params = [SamplingParams(temperature=0 if i % 2 == 0 else 0.9, seed=11 + i, max_tokens=8 + 3 * i, ignore_eos=True,
                         logprobs=2) for i in range(5)]
runs = {}
for fused in (True, False):
    with fused_calls() as calls:
        outs = run_fused(llm, prompts, params, fused)
    n_calls = len(calls) if fused else n_calls
    runs[str(fused)] = [[list(o.outputs[0].token_ids), [lp.logprob.hex() for lp in o.outputs[0].logprobs]]
                        for o in outs]
print(json.dumps([kernels.level(), reason, n_calls, runs, qkv]))
"""


def _levels_run(shape: str, tmp_path, graft: str = "", qtype: str = "Q8_0") -> list:
    """Runs _LEVEL_RUN at every level here and checks fused == eager and every level alike; returns the first
    level's description of the q/k/v projections."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    levels, runs, qkvs = levels_here(), {}, []
    for lv in levels:
        env = dict(os.environ, KVINFER_ISA=lv, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", _LEVEL_RUN, root, str(tmp_path / f"{lv}.gguf"), shape, graft,
                              qtype], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        level, reason, calls, result, qkv = json.loads(out.stdout.strip().splitlines()[-1])
        qkvs.append(qkv)
        assert level == lv and reason is None, (level, reason)
        assert calls > 0  # decode steps went through the C step
        assert result["True"] == result["False"], lv  # fused and eager: the same tokens and logprobs, bit for bit
        runs[lv] = result["True"]
    assert len(runs) >= 2
    for lv in levels[1:]:
        assert runs[lv] == runs[levels[0]], lv  # and every level the same bits
    return qkvs[0]


@needs_kernels
def test_qwen3_q_k_norms_decode_fused_bitwise_at_every_level(tmp_path):
    # Qwen3 normalises each head of q and k before RoPE: the C step applies the same row function with the same
    # eps, so a batched decode (greedy and sampled rows) is the eager path's bit for bit, at every ISA level.
    _levels_run("tiny-qwen3", tmp_path)


@needs_kernels
def test_qwen3_moe_decodes_fused_bitwise_at_every_level(tmp_path):
    # Top-2 of 8 experts, renormalised (a GGUF's routing), q/k norms: the C step routes with the eager path's own
    # row function, groups a step's rows by expert, runs the same matmuls and sums a row's experts in rank order, so
    # a batched decode is the eager path's bit for bit, at every ISA level.
    _levels_run("tiny-qwen3moe", tmp_path)


def with_shared_experts(llm, inter: int = 64, seed: int = 3) -> None:
    """Gives every layer of a tiny Qwen3-MoE GGUF model a gated shared expert, as Qwen2-MoE has (here beside
    renormalised routing, which a qwen2moe file does not have): a SwiGLU of Q8_0 gate-up and down beside a float gate,
    the kinds the loader makes for experts and routers. Random weights make the FFN small next to the residual stream
    and a last-bit difference in it would be rounded away: a wider FFN norm and shared weights of the routed experts'
    size make it dominate, and the gate's logits stay near zero, where the sigmoid's every bit shows."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from kvinfer.layers.mlp import SwiGLU
    from kvinfer.layers.quant_linear import KernelLinear, QuantLinear

    gen = torch.Generator().manual_seed(seed)
    for layer in llm.engine.loaded.model.layers:
        hid = layer.post_attn_norm.weight.shape[0]
        shared = SwiGLU(hid, inter)
        for name, shape in (("gate_up", (2 * inter, hid)), ("down", (hid, inter))):
            w = (0.05 * torch.randn(shape, generator=gen)).numpy().astype(np.float32)
            raw = torch.from_numpy(quantize(w, GGMLQuantizationType.Q8_0))
            setattr(shared, name, QuantLinear.from_raw(raw, "Q8_0", shape))
        layer.mlp.shared = shared
        layer.mlp.shared_gate = KernelLinear(0.01 * torch.randn(1, hid, generator=gen))
        with torch.no_grad():
            layer.post_attn_norm.weight.mul_(8.0)


@needs_kernels
def test_qwen2_moe_shared_expert_decodes_fused_bitwise_at_every_level(tmp_path):
    # The gated shared expert runs in the C step by the eager path's calls: the gate's one-column matmul, the
    # sigmoid as moe.py's _sigmoid computes it, the SwiGLU over all rows, then a rounded product added to the
    # routed sum; a batched decode (greedy and sampled rows) is the eager path's bit for bit, at every ISA level.
    _levels_run("tiny-qwen3moe", tmp_path, "shared")


@needs_kernels
def test_qwen2_moe_gguf_file_decodes_fused_bitwise_at_every_level(tmp_path):
    # A qwen2moe file as loaded: its own shared expert (Q8_0 gate-up and down, the float gate row), q/k/v biases and
    # top-k weights not renormalised; the C step is the eager path's bit for bit, at every ISA level.
    _levels_run("tiny-qwen2moe", tmp_path, "wide")


def with_biases(llm, scale: float = 25.0, more: bool = False, seed: int = 4) -> None:
    """Scales the q/k/v biases of a Qwen2 GGUF model (each part's, where q/k/v are parts) in place, and with more
    gives o, gate-up and down random biases too (no GGUF family has them; the C step takes them all). The random
    file's biases are small next to the matmuls' outputs; scaled, they are as large as the sums or larger (as
    Qwen2.5's k biases are), so adding them in any other order, or not at all, would change bits."""
    from kvinfer.layers.quant_linear import QuantLinear, QuantParts

    gen = torch.Generator().manual_seed(seed)
    for layer in llm.engine.loaded.model.layers:
        for holder, name in ((layer.attn, "qkv"), *([(layer.attn, "o"), (layer.mlp, "gate_up"),
                                                     (layer.mlp, "down")] if more else [])):
            proj = getattr(holder, name)
            for lin in (proj.parts if isinstance(proj, QuantParts) else [proj]):
                if lin.bias is not None:
                    with torch.no_grad():
                        lin.bias.mul_(scale)  # (the layer's kernel holds the tensor's address: the same after)
                    continue
                bias = 0.5 * torch.randn(lin.out_features, generator=gen)
                new = QuantLinear.from_raw(lin.source(), lin.qtype, (lin.out_features, lin.in_features), bias)
                assert proj is lin, "a projection in parts without a bias"  # (not made by these tests)
                setattr(holder, name, new)


@needs_kernels
def test_qwen2_qkv_biases_decode_fused_bitwise_at_every_level(tmp_path):
    # Qwen2's q/k/v biases (and o, gate-up and down biases, which the C step takes too) go into the very kvq_matmul
    # calls the eager path's QuantLinears make, so a batched decode (greedy and sampled rows) is the eager path's bit
    # for bit, at every ISA level.
    qkv = _levels_run("tiny-qwen2", tmp_path, "bias+")
    assert all(parts == [["Q8_0", True]] for parts in qkv)


@needs_kernels
@pytest.mark.skipif(not Path(LLAMA_QUANTIZE).is_file(), reason=f"{LLAMA_QUANTIZE} is not built (Q4_K_M needs it)")
def test_qwen2_q4_k_m_biased_qkv_parts_decode_fused_bitwise_at_every_level(tmp_path):
    # What Qwen2.5 Q4_K_M files hold: q/k Q4_K and v Q6_K in some layers, each part with its slice of the q/k/v bias,
    # one kvq_matmul per part with its own bias, as QuantParts runs them.
    qkv = _levels_run("tiny-256-qwen2", tmp_path, "bias", "Q4_K_M")
    assert [["Q4_K", True], ["Q4_K", True], ["Q6_K", True]] in qkv  # a layer's q/k/v in parts, each biased
    assert all(b for parts in qkv for _, b in parts)


@needs_kernels
@pytest.mark.skipif(not Path(LLAMA_QUANTIZE).is_file(), reason=f"{LLAMA_QUANTIZE} is not built (Q4_K_M needs it)")
def test_q4_k_m_q5_0_parts_decode_fused_bitwise_at_every_level(tmp_path):
    # Rows that are not whole 256-weight super-blocks (here 64 and 128 wide; Qwen2.5-0.5B's 896) are written as Q5_0
    # in a Q4_K_M file, and the kernels read them as stored (kept at avx512): one layer's q/k/v is Q5_0 whole, the
    # other's Q5_0 q/k with a Q8_0 v, in parts, each with its bias.
    qkv = _levels_run("tiny-qwen2", tmp_path, "", "Q4_K_M")
    assert [["Q5_0", True]] in qkv and [["Q5_0", True], ["Q5_0", True], ["Q8_0", True]] in qkv


@needs_kernels
@pytest.mark.skipif(not Path(LLAMA_QUANTIZE).is_file(), reason=f"{LLAMA_QUANTIZE} is not built (IQ4_XS needs it)")
def test_iq4_xs_files_iq4_nl_rows_decode_fused_bitwise_at_every_level(tmp_path):
    # An IQ4_XS file writes rows that are not whole 256-weight super-blocks as IQ4_NL (here every matrix of this
    # 64-wide model; Qwen2.5-0.5B's 896-wide ones): read as stored at every level, kept at avx512.
    qkv = _levels_run("tiny-qwen2", tmp_path, "", "IQ4_XS")
    assert qkv == [[["IQ4_NL", True]]] * 2


@needs_kernels
def test_biases_the_c_step_takes_and_refuses(tmp_path):
    # A dense layer's biases travel in the table beside their weights; an expert's bias, or a bias of another
    # dtype, keeps the eager path (and says why).
    from kvinfer.layers.quant_linear import QuantLinear

    llm = LLM(str(_make(tmp_path / "q2.gguf", "tiny-qwen2")), kv_cache_memory=4 << 20, max_num_seqs=8)
    model, kv = llm.engine.loaded.model, llm.engine.kv_cache
    assert unsupported_reason(model, kv) is None
    fd = FusedDecode(model, kv)
    for e, layer in zip(fd.layers, model.layers):
        assert e.qkv_bias == layer.attn.qkv.bias.data_ptr()
        assert e.o_bias is None and e.gate_up_bias is None and e.down_bias is None
    qkv = model.layers[1].attn.qkv
    qkv.bias = qkv.bias.double()
    assert "float32" in unsupported_reason(model, kv)
    qkv.bias = qkv.bias.float()
    assert unsupported_reason(model, kv) is None

    moe = _tiny_moe(tmp_path)
    model, kv = moe.engine.loaded.model, moe.engine.kv_cache
    ex = model.layers[0].mlp.experts[3]
    lin = ex.down
    ex.down = QuantLinear.from_raw(lin.source(), lin.qtype, (lin.out_features, lin.in_features),
                                   torch.zeros(lin.out_features))
    assert "biased projection" in unsupported_reason(model, kv)


def _make(path, shape: str, qtype: str = "Q8_0"):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_gguf",
                                                  Path(__file__).resolve().parents[2] / "scripts/make_gguf.py")
    mg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mg)
    return mg.make(path, shape, qtype, seed=7)


def _tiny_moe(tmp_path):
    return LLM(str(_make(tmp_path / "moe.gguf", "tiny-qwen3moe")), kv_cache_memory=4 << 20, max_num_seqs=8)


@needs_kernels
@pytest.mark.parametrize("top_k, renormalise, shared", [(1, False, False), (3, False, False), (4, True, False),
                                                       (1, False, True), (3, True, True)])
def test_moe_routing_variants_decode_fused_bitwise(tmp_path, top_k, renormalise, shared):
    # Both paths read the layer's top_k and renormalise: one expert per row (no sum), three or four (the running
    # sum past the first two ranks), raw softmax weights (Qwen3-MoE's default) and renormalised ones (Mixtral's);
    # with a shared expert, added to a single rank's product or to a running sum.
    llm = _tiny_moe(tmp_path)
    eng = llm.engine
    if shared:
        with_shared_experts(llm)  # (its FFN norms widened as below)
    for layer in eng.loaded.model.layers:
        layer.mlp.top_k, layer.mlp.renormalise = top_k, renormalise
        # Random weights make the experts' output small next to the residual stream, where a last-bit difference
        # in it would be rounded away: a wider norm makes it dominate, so the comparison sees its every bit.
        if not shared:
            with torch.no_grad():
                layer.post_attn_norm.weight.mul_(8.0)
    assert unsupported_reason(eng.loaded.model, eng.kv_cache) is None
    prompts = [[3 + (11 * i + j) % 150 for j in range(2 + 4 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=2) for i in range(6)]
    with fused_calls() as calls:
        fused = _run(llm, prompts, params, True)
    assert calls and eng.runner._fused is not None  # decode steps went through the C step
    eager = _run(llm, prompts, params, False)
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    assert_engine_clean(eng)


@needs_kernels
def test_moe_layers_the_c_step_cannot_run_say_why(tmp_path):
    from torch import nn

    from kvinfer.options import override

    llm = _tiny_moe(tmp_path)
    eng = llm.engine
    model, kv = eng.loaded.model, eng.kv_cache
    assert unsupported_reason(model, kv) is None
    moe = model.layers[1].mlp
    moe.owned = frozenset({0, 2})  # experts dealt out to ranks: an all-reduce inside the layer
    assert "tensor-parallel" in unsupported_reason(model, kv)
    moe.owned = None
    with_shared_experts(llm)  # Qwen2-MoE's gated shared expert: in the C step, where its pieces are
    assert unsupported_reason(model, kv) is None
    shared, gate = moe.shared, moe.shared_gate
    moe.shared = nn.Identity()
    assert "shared expert that is not a SwiGLU" in unsupported_reason(model, kv)
    moe.shared = shared
    moe.shared_gate = nn.Linear(gate.in_features, 1, bias=True)
    assert "shared expert gate" in unsupported_reason(model, kv)
    moe.shared_gate = gate
    assert unsupported_reason(model, kv) is None
    with override(batch_invariant=False):
        assert "batch invariance" in unsupported_reason(model, kv)
    assert unsupported_reason(model, kv) is None
