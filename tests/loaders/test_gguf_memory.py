"""Memory: a loaded GGUF model holds the file's tensor bytes once, in memory it owns (not a view of a mapping
of the file, though the kept copies may be packed straight from one), and no float32 copy of a quantized weight."""
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
from tests.gguf_helpers import write_mixed
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
@pytest.mark.parametrize("keep,file", [("0", "tiny"), ("1", "tiny"), ("1", "mixed")])
def test_rewriting_the_file_after_load_changes_nothing(tmp_path, monkeypatch, keep, file):
    # 0: the kernels read the GGML rows themselves, not a tile copy; 1 (the default): the copies, packed straight
    # from the file's mapping where the level keeps them with the rows' pages given back. mixed: an untied
    # embedding the kernels read as GGML rows, parts of several types, Q5_1 (kept in no copy)
    monkeypatch.setenv("KVINFER_AMX_KEEP", keep)
    path = (make_gguf.make(tmp_path / "m.gguf", "tiny", "Q4_0") if file == "tiny"
            else write_mixed(tmp_path / "m.gguf"))
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    prompt = list(range(3, 43))
    before = step_logits(loaded, prompt, [7, 8], "paged")
    size = path.stat().st_size
    with open(path, "r+b") as f:  # same inode: a lazily read mapping would now see zeros
        f.write(b"\0" * size)
    after = step_logits(loaded, prompt, [7, 8], "paged")
    assert torch.equal(before, after)
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m._weight is None for m in linears)  # a 40-token prefill made no float32 copy


def test_mapped_blocks_view_the_file_unless_their_rows_are_reordered(tmp_path):
    path = make_gguf.make(tmp_path / "m.gguf", "tiny", "Q4_0")
    owned = read_gguf(path, keep_raw=True, lazy_types=frozenset({"Q4_0"}))
    ck = read_gguf(path, keep_raw=True, lazy_types=frozenset({"Q4_0"}), mapped_types=frozenset({"Q4_0"}))
    lo, hi = ck.mapped_span
    assert hi - lo == path.stat().st_size and owned.mapped_span == (0, 0)
    for name, (arr, qtype, shape) in ck.raw.items():
        inside = lo <= arr.ctypes.data < hi
        # q and k rows are put back in Hugging Face order: read, not viewed
        assert inside == (not name.endswith(("q_proj.weight", "k_proj.weight"))), name
        assert np.array_equal(arr, owned.raw[name][0]) and (qtype, shape) == owned.raw[name][1:], name


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "IQ4_NL"])
def test_kept_copies_packed_from_the_mapping_hold_the_files_rows(tmp_path, qtype):
    from kvinfer.layers.quant_linear import QuantEmbedding

    lib = kernels.active()
    if not (kernels.keep_tiles_enabled() and kernels.drop_source_enabled() and lib.drops_kept_source(qtype)):
        pytest.skip(f"the active kernels keep no {qtype} copy with the rows' pages given back")
    if qtype not in make_gguf.DIRECT and not Path(make_gguf.DEFAULT_QUANTIZE).is_file():
        pytest.skip(f"{make_gguf.DEFAULT_QUANTIZE} is not built ({qtype} needs it)")
    path = make_gguf.make(tmp_path / "m.gguf", "tiny", qtype)
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    raw = read_gguf(path, keep_raw=True, lazy_types=frozenset({qtype})).raw
    layer = loaded.model.layers[1]
    want = {layer.attn.qkv: [raw[f"model.layers.1.self_attn.{p}_proj.weight"][0] for p in "qkv"],
            layer.mlp.gate_up: [raw[f"model.layers.1.mlp.{p}_proj.weight"][0] for p in ("gate", "up")],
            layer.mlp.down: [raw["model.layers.1.mlp.down_proj.weight"][0]]}
    for m, parts in want.items():
        assert isinstance(m, QuantLinear) and m.qtype == qtype  # (Q5_0 too: read as stored, not as Q8_0)
        assert m._tiles is not None and m._tiles.dropped  # kept at load already
        rows = torch.from_numpy(np.concatenate(parts))
        assert torch.equal(m._tiles.tiles, lib.keep_tiles(rows, m.out_features, m.in_features, qtype).tiles)
        assert torch.equal(m.source(), rows)
    emb = loaded.model.embed
    assert isinstance(emb, QuantEmbedding) and emb.kept() is not None  # tied: the head's copy serves the lookups
    assert torch.equal(emb.kept().weight, emb.raw) and emb.kept().dropped


def _present_pages(addr: int, nbytes: int) -> int:
    """How many of the pages of [addr, addr + nbytes) this process has mapped in (/proc/self/pagemap bit 63)."""
    import struct

    page = 4096
    first, last = addr // page, (addr + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        data = f.read((last - first + 1) * 8)
    return sum(e >> 63 for e in struct.unpack(f"{len(data) // 8}Q", data))


@needs_kernels
def test_a_layers_pages_of_the_mapping_are_given_back_once_the_layer_is_kept(tmp_path, monkeypatch):
    # Dropping a tensor once packed gives back its whole pages; the pages it shares with its neighbours, and a
    # layer's float tensors, go when the layer is done, not at the end of the load (the load's peak).
    import gguf

    import kvinfer.loaders.model_loader as ml

    lib = kernels.active()
    if not (kernels.keep_tiles_enabled() and kernels.drop_source_enabled() and lib.drops_kept_source("Q8_0")):
        pytest.skip("the active kernels keep no Q8_0 copy with the rows' pages given back")
    path = make_gguf.make(tmp_path / "m.gguf", "tiny-256", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    spans = [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in reader.tensors
             if t.name.startswith("blk.0.")]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    del reader
    seen = []
    keep_now = ml.keep_now

    def spy(module):
        if module is not getattr(module, "layers", [None])[0] and hasattr(module, "layers"):  # the final call
            base = next(int(line.split("-")[0], 16) - int(line.split()[2], 16)
                        for line in open("/proc/self/maps") if line.rstrip().endswith(str(path)))
            seen.append(_present_pages(base + lo, hi - lo))
        keep_now(module)

    monkeypatch.setattr(ml, "keep_now", spy)
    load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    assert seen == [0]
