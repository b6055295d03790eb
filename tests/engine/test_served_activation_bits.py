"""`--activation-bits 8` end to end: a K-quant model's requests are bitwise the same however they are served (as at
16 bits) but not the 16-bit results; the setting is process-wide, so an engine at other bits is refused while one
runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvinfer import LLM, kernels
from kvinfer.config import EngineConfig
from kvinfer.errors import ValidationError
from tests.gguf_helpers import LLAMA_QUANTIZE

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels")
ROOT = Path(__file__).resolve().parents[2]

# In a fresh process (the builtin_llm of this session runs at 16 bits): the tiny K-quant model served alone and in
# three other ways at each bit count; prints, per bit count, whether every way matched and the first request's
# logprobs (hex).
_RUN = """
import importlib.util, json, sys
from pathlib import Path
from kvinfer import kernels
from kvinfer.config import EngineConfig
from kvinfer.loaders.model_loader import load_model
from tests.exactness_helpers import sample_requests, serve, serve_alone
spec = importlib.util.spec_from_file_location("make_gguf", sys.argv[1] + "/scripts/make_gguf.py")
mg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mg)
path = str(mg.make(Path(sys.argv[2]), "tiny-256", "Q4_K_M", seed=5))
loaded = load_model(EngineConfig(model=path, dtype="float32", device="cpu"))
reqs = sample_requests(loaded.config.vocab_size, 3)
ways = [dict(budget=7, kv_tokens=72, arrivals=[0, 3, 1, 5, 0, 2], order=[5, 4, 3, 2, 1, 0]),
        dict(kv_cache="contiguous", block_size=4, prefix=False),
        dict(kv_cache="none", budget=16, arrivals=[2, 0, 0, 1, 4, 0])]
out = {}
for bits in (16, 8, 16):
    alone = serve_alone(loaded, path, reqs, activation_bits=bits)
    same = all(serve(loaded, path, reqs, activation_bits=bits, **w)[0] == alone for w in ways)
    out.setdefault(str(bits), []).append([same, kernels.describe(), [lp.hex() for lp in alone[0][1]]])
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path(LLAMA_QUANTIZE).is_file(), reason=f"{LLAMA_QUANTIZE} is not built (Q4_K_M needs it)")
def test_eight_bits_are_exact_however_served_and_not_sixteen(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = subprocess.run([sys.executable, "-c", _RUN, str(ROOT), str(tmp_path / "m.gguf")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    for bits, runs in out.items():
        for same, described, _ in runs:
            assert same, bits  # tokens, logprobs, top alternatives and prompt logprobs, bitwise
            assert f"int{bits}-rounded" in described
    assert out["16"][0][2] == out["16"][1][2]  # back at 16: the 16-bit bits again
    assert out["8"][0][2] != out["16"][0][2]  # and 8 bits are another rounding


_TP = """
import json, sys
from kvinfer import LLM, SamplingParams
from tests.gguf_helpers import write_mixed

def run(path, tp):
    llm = LLM(path, tensor_parallel_size=tp, activation_bits=8, kv_cache_memory=4 << 20, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [2 + (5 * i + j) % 60 for j in range(4 + 3 * i)]} for i in range(3)],
                        params, use_tqdm=False)
    llm.close()
    return [[list(o.outputs[0].token_ids), [lp.logprob.hex() for lp in o.outputs[0].logprobs]] for o in outs]

if __name__ == "__main__":
    path = str(write_mixed(__import__("pathlib").Path(sys.argv[1])))
    print(json.dumps([run(path, 1), run(path, 2)]))
"""


def test_eight_bits_reach_the_tensor_parallel_ranks(tmp_path):
    # Each rank's library is set from the engine's config: TP 2 at 8 bits answers as TP 1 at 8 bits, bit for bit.
    script = tmp_path / "tp8.py"
    script.write_text(_TP)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = subprocess.run([sys.executable, str(script), str(tmp_path / "mixed.gguf")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    tp1, tp2 = json.loads(got.stdout.strip().splitlines()[-1])
    assert tp1 == tp2


def test_an_engine_at_other_bits_is_refused_while_one_runs(builtin_llm):
    assert builtin_llm.engine.config.activation_bits == 16
    with pytest.raises(ValidationError, match="activation_bits.*16 activation bits.*process-wide"):
        LLM(None, activation_bits=8, kv_cache_memory=16 << 20)
    assert kernels.activation_bits() == 16


def test_only_sixteen_or_eight():
    with pytest.raises(ValidationError, match="activation_bits.*16 or 8"):
        EngineConfig(activation_bits=12)
