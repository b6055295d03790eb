"""GGUF files of Gemma 3, Phi-3, Qwen3-MoE, Qwen2-MoE and Mixtral written by llama.cpp's own convert_hf_to_gguf.py from
tiny random transformers models: the config read from the file, logits and greedy tokens against transformers, experts
kept quantized, and one-line errors for what a file asks that kvinfer does not do."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvinfer import LLM, SamplingParams
from kvinfer.config import EngineConfig
from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.layers.quant_linear import QuantLinear
from kvinfer.loaders.gguf_loader import read_gguf, read_metadata, read_metadata_config
from kvinfer.loaders.model_loader import load_model
from kvinfer.models.families import load_hf_config
from kvinfer.utils import builtin_model_path
from tests.family_helpers import GEMMA3, NEW_FAMS as FAMS
from tests.reference_helpers import hf_greedy, hf_logits, prompts, save_tiny, step_logits

# llama.cpp's converter, from the llama-cpp-python sdist (or a path to convert_hf_to_gguf.py itself).
# `make test` fetches it (scripts/fetch_llama_sdist.py) into .venv/sdist.
SDIST = Path(os.environ.get("KVINFER_LLAMA_SDIST",
                            Path(__file__).resolve().parents[2] / ".venv/sdist/llama_cpp_python-0.3.36.tar.gz"))
CONVERTER = os.environ.get("KVINFER_CONVERT_HF_TO_GGUF")
# The converter hashes the tokenizer's pre-tokenizer; the built-in model's (SmolLM2's) is one it knows.
VOCAB = 49152

# What a GGUF file can say. Gemma 3: the file names no layer pattern (llama.cpp's default, every sixth layer global,
# is transformers' default too) and no query_pre_attn_scalar (llama.cpp scales by head_dim). Qwen3-MoE: llama.cpp
# always renormalises the top-k weights (as the released models' norm_topk_prob=true). Qwen2-MoE: llama.cpp never does
# (as Qwen1.5-MoE's norm_topk_prob=false); a shared expert as wide as the Q8_0 blocks, so --outtype q8_0 keeps it.
CONFIGS = {
    "gemma3": dict({k: v for k, v in GEMMA3.items() if k != "layer_types"}, num_hidden_layers=6,
                   query_pre_attn_scalar=32),
    "phi3": FAMS["phi3"].config,
    "qwen3_moe": dict(FAMS["qwen3_moe"].config, norm_topk_prob=True),
    "mixtral": FAMS["mixtral"].config,
    "qwen2_moe": dict(FAMS["qwen2_moe"].config, norm_topk_prob=False, shared_expert_intermediate_size=64),
}
GGUF_ARCH = {"gemma3": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe"}


def _boost_shared_expert(hf) -> None:
    """Qwen2-MoE: a shared expert whose output outweighs the routed experts' and a gate whose logits spread over the
    sigmoid's curve, so that dropping the shared expert, or taking its gate as any constant, changes the tokens."""
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.shared_expert.down_proj.weight.mul_(3.0)
            layer.mlp.shared_expert_gate.weight.mul_(6.0)


# Changes to the random weights before saving, by family.
BOOST = {"qwen2_moe": _boost_shared_expert}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def converter(tmp_path_factory) -> Path:
    if CONVERTER:
        return Path(CONVERTER)
    if not SDIST.is_file():
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py: no llama-cpp-python sdist at {SDIST} (`make test` "
                    "fetches it: scripts/fetch_llama_sdist.py; or set KVINFER_LLAMA_SDIST or KVINFER_CONVERT_HF_TO_GGUF)")
    out = tmp_path_factory.mktemp("llama_cpp")
    wanted = ("/convert_hf_to_gguf.py", "/conversion/", "/gguf-py/")
    with tarfile.open(SDIST) as tar:
        members = [m for m in tar.getmembers()
                   if "/vendor/llama.cpp/" in m.name and any(w in m.name for w in wanted)]
        tar.extractall(out, members=members, filter="data")
    found = sorted(out.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        pytest.skip(f"{SDIST} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return found[0]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    """The built-in model's tokenizer as tokenizer.json, with the class the converter reads it through."""
    from kvinfer.loaders.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.from_gguf_metadata(read_metadata(builtin_model_path())).backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    return d


def convert(converter: Path, model_dir: Path, outtype: str) -> Path:
    out = model_dir.with_name(f"{model_dir.name}-{outtype}.gguf")
    # Without a tokenizer.model, the converter's Llama class imports sentencepiece only to find that file missing
    # and fall back to tokenizer.json; an empty stand-in lets it get there where sentencepiece is not installed.
    shim = model_dir.parent / "sentencepiece_shim"
    shim.mkdir(exist_ok=True)
    (shim / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(shim))
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, which knows its keys
    r = subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", outtype, "--outfile", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"convert_hf_to_gguf.py could not convert {model_dir.name}: {r.stderr.strip()[-400:]}")
    return out


_CACHE: dict = {}


@pytest.fixture(scope="module")
def ref_of(tmp_path_factory, converter, tokenizer_files):
    """name -> (HF directory, HF model, GGUF path (float32), prompt, HF greedy tokens, HF logits)."""
    def get(name, outtype="f32"):
        if name not in _CACHE:
            fam = FAMS[name]
            path = tmp_path_factory.mktemp(name) / "hf"
            hf = save_tiny(fam.config_cls, fam.model_cls, path, seed=1, **fam.init,
                           **dict(CONFIGS[name], vocab_size=VOCAB))
            if name in BOOST:
                BOOST[name](hf)
                hf.save_pretrained(path)
            for f in tokenizer_files.iterdir():
                shutil.copy(f, path / f.name)
            prompt = prompts(1, seed=11, lo=13, hi=13, vocab=VOCAB)[0]
            tokens = hf_greedy(hf, prompt, 24)
            _CACHE[name] = dict(dir=path, hf=hf, prompt=prompt, tokens=tokens, logits=hf_logits(hf, prompt + tokens))
        entry = _CACHE[name]
        if outtype not in entry:
            entry[outtype] = convert(converter, entry["dir"], outtype)
        return entry

    yield get
    _CACHE.clear()


@pytest.mark.parametrize("name", CONFIGS)
def test_config_from_the_file_equals_the_hf_config(name, ref_of):
    ref = ref_of(name)
    path = ref["f32"]
    assert read_metadata(path)["general.architecture"] == GGUF_ARCH[name]
    got, want = read_metadata_config(path), load_hf_config(ref["dir"] / "config.json")
    assert got.replace(torch_dtype=None) == want.replace(torch_dtype=None)


def test_gemma3_file_windows_and_bases(ref_of):
    cfg = read_metadata_config(ref_of("gemma3")["f32"])
    assert cfg.layer_windows == (6, 6, 6, 6, 6, None) and cfg.rope_local_theta == 100.0
    assert cfg.rope_scaling.type == "linear" and cfg.final_logit_softcap == 30.0


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_greedy_tokens_match_transformers(name, ref_of):
    ref = ref_of(name)
    assert len(set(ref["tokens"])) > 4, "a degenerate reference: the model repeats itself"
    loaded = load_model(EngineConfig(model=str(ref["f32"]), dtype="float32", device="cpu"))
    n = len(ref["prompt"])
    ours = step_logits(loaded, ref["prompt"], ref["tokens"][:12], "paged", block_size=4)
    diff = (ours - ref["logits"][:n + 12]).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs logits diff {diff:.2e}"
    llm = LLM(str(ref["f32"]), dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4,
              max_model_len=64, max_num_batched_tokens=5)
    out = llm.generate([ref["prompt"]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref["tokens"]


def test_gemma3_norms_are_taken_as_written(ref_of):
    """The converter writes Gemma's norms as 1 + w; the loader must not add the one again."""
    ref = ref_of("gemma3")
    loaded = load_model(EngineConfig(model=str(ref["f32"]), dtype="float32", device="cpu"))
    hf_w = ref["hf"].model.layers[0].post_feedforward_layernorm.weight
    assert torch.equal(loaded.model.layers[0].post_mlp_norm.weight, 1.0 + hf_w.float())


@pytest.mark.parametrize("name", CONFIGS)
def test_f16_files_match_transformers_at_f16_weights(name, ref_of):
    """--outtype f16 (matrices F16, stacked experts included; norms and the router kept F32 by the converter): the
    logits of transformers with those very weights rounded to float16."""
    import copy

    ref = ref_of(name, "f16")
    hf = copy.deepcopy(ref["hf"])
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if p.ndim >= 2 and not pname.endswith((".gate.weight", ".shared_expert_gate.weight")):
                p.copy_(p.half().float())
    ids = ref["prompt"] + ref["tokens"][:12]
    want = hf_logits(hf, ids)
    loaded = load_model(EngineConfig(model=str(ref["f16"]), dtype="float32", device="cpu"))
    ours = step_logits(loaded, ref["prompt"], ref["tokens"][:12], "paged", block_size=4)
    diff = (ours - want).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs logits diff {diff:.2e}"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "phi3", "qwen2_moe"])
def test_q8_0_files_stay_quantized(name, ref_of):
    """--outtype q8_0: every expert's (Qwen2-MoE's shared one too, and Phi-3's fused) matrices are served from the
    file's Q8_0 blocks, the router (and the shared expert's gate) stays float; the logits are those of the same
    weights dequantized (up to the kernels' 8-bit activations) and near transformers'."""
    ref = ref_of(name, "q8_0")
    ck_types = read_gguf(ref["q8_0"]).tensor_types
    loaded = load_model(EngineConfig(model=str(ref["q8_0"]), dtype="float32", device="cpu"))
    layer = loaded.model.layers[1]
    if name == "phi3":
        assert ck_types["model.layers.1.self_attn.qkv_proj.weight"] == "Q8_0"
        linears = [layer.attn.qkv, layer.mlp.gate_up, layer.mlp.down]
    else:
        assert ck_types["model.layers.1.mlp.experts.3.down_proj.weight"] == "Q8_0"
        linears = [m for e in layer.mlp.experts for m in (e.gate_up, e.down)]
        assert not isinstance(layer.mlp.router, QuantLinear) and layer.mlp.router.weight.dtype == torch.float32
        if name == "qwen2_moe":
            assert ck_types["model.layers.1.mlp.shared_expert.down_proj.weight"] == "Q8_0"
            linears += [layer.mlp.shared.gate_up, layer.mlp.shared.down]
            assert not isinstance(layer.mlp.shared_gate, QuantLinear)
            assert layer.mlp.shared_gate.weight.dtype == torch.float32
    assert all(isinstance(m, QuantLinear) and m.qtype == "Q8_0" for m in linears)
    n = len(ref["prompt"])
    ours = step_logits(loaded, ref["prompt"], ref["tokens"][:12], "paged", block_size=4)
    widened = load_model(EngineConfig(model=str(ref["q8_0"]), dtype="float32", device="cpu", quantization="none"))
    assert widened.quantized_modules == 0
    same_weights = step_logits(widened, ref["prompt"], ref["tokens"][:12], "paged", block_size=4)
    scale = same_weights.abs().max().item()
    assert (ours - same_weights).abs().max().item() <= 1e-3 * scale
    assert (ours - ref["logits"][:n + 12]).abs().max().item() <= 0.05 * scale


def rewrite(src: Path, dst: Path, set_keys: dict = {}, drop_tensors=(), replace_tensors: dict = {}) -> Path:
    """src with some metadata values set (as the given gguf value types), some tensors left out and some replaced
    (name -> float32 array, torch order)."""
    r = gguf.GGUFReader(str(src))
    arch = read_metadata(src)["general.architecture"]
    w = gguf.GGUFWriter(str(dst), arch)
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", *set_keys}
    for key, field in r.fields.items():
        if key in skip:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    for key, (value, vtype) in set_keys.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in replace_tensors:
            w.add_tensor(t.name, replace_tensors[t.name])
        elif t.name not in drop_tensors:
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING


@pytest.mark.parametrize("name, change, match", [
    ("qwen3_moe", dict(set_keys={"qwen3moe.expert_gating_func": (2, U32)}), "expert_gating_func=2"),
    ("qwen3_moe", dict(drop_tensors=[f"blk.1.{p}.weight" for p in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                                                                     "ffn_down_exps")]),
     "dense layers among expert layers"),
    ("mixtral", dict(set_keys={"llama.expert_used_count": (9, U32)}), "num_experts_per_tok=9"),
    ("gemma3", dict(set_keys={"gemma3.rope.scaling.type": ("dynamic", STR)}), "rope_scaling type 'dynamic'"),
    ("phi3", dict(drop_tensors=["rope_factors_short.weight"]), "without its pair"),
    ("qwen2_moe", dict(drop_tensors=["blk.1.ffn_down_shexp.weight"]), "lacks the tensor blk.1.ffn_down_shexp.weight"),
    ("qwen2_moe", dict(replace_tensors={"blk.0.ffn_gate_inp_shexp.weight": np.ones(63, np.float32)}),
     r"blk.0.ffn_gate_inp_shexp.weight has shape \[63\], the header's metadata implies \[64\] or \[64, 1\]"),
    ("qwen2_moe", dict(set_keys={"qwen2moe.expert_used_count": (7, U32)}), "num_experts_per_tok=7"),
])
def test_unsupported_files_are_one_line_errors(name, change, match, ref_of, tmp_path):
    bad = rewrite(ref_of(name)["f32"], tmp_path / f"bad-{name}.gguf", **change)
    for load in (read_metadata_config, read_gguf):
        with pytest.raises((UnsupportedError, ModelLoadError), match=match) as e:
            load(bad)
        assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_models_lists_the_gguf_architectures(capsys):
    from kvinfer.cli import main

    assert main(["models"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("GGUF architectures"))
    for arch in ("llama", "gemma3", "phi3", "qwen3moe", "qwen2moe", "Mixtral"):
        assert arch in line


def test_cli_names_the_file_in_one_line(ref_of, tmp_path, capsys):
    from kvinfer.cli import main

    bad = rewrite(ref_of("qwen3_moe")["f32"], tmp_path / "sigmoid.gguf",
                  set_keys={"qwen3moe.expert_gating_func": (2, U32)})
    assert main(["generate", "--model", str(bad), "-n", "2", "hi"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "expert_gating_func" in err[0]


def test_qwen2moe_shared_gate_written_1d_loads_alike(ref_of, tmp_path):
    """llama-quantize writes the shared expert's gate 1-D ([hidden]; the converter writes [hidden, 1]): the same
    weights, the same logits."""
    src = ref_of("qwen2_moe")["f32"]
    gates = {t.name: np.array(t.data).reshape(-1) for t in gguf.GGUFReader(str(src)).tensors
             if t.name.endswith("ffn_gate_inp_shexp.weight")}
    assert gates and all(g.shape == (64,) for g in gates.values())
    flat = rewrite(src, tmp_path / "gate-1d.gguf", replace_tensors=gates)
    assert [len(t.shape) for t in gguf.GGUFReader(str(flat)).tensors if t.name in gates] == [1] * len(gates)
    ref = ref_of("qwen2_moe")
    logits = [step_logits(load_model(EngineConfig(model=str(p), dtype="float32", device="cpu")), ref["prompt"],
                          ref["tokens"][:6], "paged", block_size=4) for p in (src, flat)]
    assert torch.equal(*logits)
