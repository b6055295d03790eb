"""Memory: a loaded GGUF model holds the file's tensor bytes once, in memory it owns (not a view of a mapping
of the file), and no float32 copy of a quantized weight."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from kvinfer import kernels
from kvinfer.config import EngineConfig
from kvinfer.layers.quant_linear import QuantLinear
from kvinfer.loaders.gguf_loader import read_gguf
from kvinfer.loaders.model_loader import load_model
from tests.reference_helpers import step_logits

_spec = importlib.util.spec_from_file_location("make_gguf",
                                               Path(__file__).resolve().parents[2] / "scripts/make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)

needs_kernels = pytest.mark.skipif(not kernels.available() or not kernels.batch_invariant(),
                                   reason="the GGUF kernels are unavailable here")


def test_lazy_blocks_are_owned_copies(tmp_path):
    path = make_gguf.make(tmp_path / "m.gguf", "tiny", "Q8_0")
    ck = read_gguf(path, keep_raw=True, lazy_types=frozenset({"Q8_0"}))
    assert ck.raw and all(t == "Q8_0" for _, t, _ in ck.raw.values())  # only the lazy matrices' blocks kept
    for name, (arr, _, _) in ck.raw.items():
        base = arr
        while isinstance(base.base, np.ndarray):
            base = base.base
        assert base.base is None and base.flags.owndata, name  # not a view of an mmap


@needs_kernels
def test_rewriting_the_file_after_load_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVINFER_AMX_KEEP", "0")  # the kernels read the GGML rows themselves, not a tile copy
    path = make_gguf.make(tmp_path / "m.gguf", "tiny", "Q4_0")
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    prompt = list(range(3, 43))
    before = step_logits(loaded, prompt, [7, 8], "paged")
    size = path.stat().st_size
    with open(path, "r+b") as f:  # same inode: a lazily read mapping would now see zeros
        f.seek(size // 2)
        f.write(b"\0" * (size - size // 2))
    after = step_logits(loaded, prompt, [7, 8], "paged")
    assert torch.equal(before, after)
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m._weight is None for m in linears)  # a 40-token prefill made no float32 copy
