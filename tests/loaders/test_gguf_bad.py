"""Bad GGUF files: one line from the CLI naming the file, the tensor and what is wrong; never a traceback."""
from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from kvinfer.cli import main

_spec = importlib.util.spec_from_file_location("make_gguf",
                                               Path(__file__).resolve().parents[2] / "scripts/make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    return make_gguf.make(tmp_path_factory.mktemp("bad") / "good.gguf", "tiny", "Q8_0").read_bytes()


def patch_u32_after(data: bytes, marker: bytes, skip: int, value: int) -> bytes:
    """The file with the u32 `skip` bytes after the first `marker` set to `value`."""
    at = data.index(marker) + len(marker) + skip
    return data[:at] + struct.pack("<I", value) + data[at + 4:]


def run_cli(path: Path, capsys) -> str:
    rc = main(["generate", "Hi", "--max-tokens", "1", "--model", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if not ln.startswith("WARNING")]
    assert len(lines) == 1, err
    assert str(path) in lines[0]
    return lines[0]


def test_truncated_names_the_tensor(good, tmp_path, capsys):
    p = tmp_path / "cut.gguf"
    p.write_bytes(good[: len(good) * 3 // 4])
    line = run_cli(p, capsys)
    assert "truncated" in line and "tensor " in line


def test_shape_disagrees_with_header(good, tmp_path, capsys):
    p = tmp_path / "ffn.gguf"
    # llama.feed_forward_length: key, then the value type (u32), then the value 128 -> 256
    p.write_bytes(patch_u32_after(good, b"llama.feed_forward_length", 4, 256))
    line = run_cli(p, capsys)
    assert "blk.0.ffn_gate.weight" in line and "[64, 128]" in line and "[64, 256]" in line


def test_unknown_tensor_type(good, tmp_path, capsys):
    p = tmp_path / "type.gguf"
    # tensor info: name, n_dims (u32), 2 dims (u64 each), then the type id
    p.write_bytes(patch_u32_after(good, b"blk.1.ffn_up.weight", 4 + 16, 250))
    line = run_cli(p, capsys)
    assert "blk.1.ffn_up.weight" in line and "250" in line and "not supported" in line


def test_unknown_architecture(good, tmp_path, capsys):
    p = tmp_path / "arch.gguf"
    at = good.index(b"general.architecture") + len(b"general.architecture") + 4 + 8  # value type, string length
    assert good[at:at + 5] == b"llama"
    p.write_bytes(good[:at] + b"falco" + good[at + 5:])
    line = run_cli(p, capsys)
    assert "'falco'" in line and "not supported" in line


def test_tensor_offset_past_the_end(good, tmp_path, capsys):
    p = tmp_path / "offset.gguf"
    # the offset (u64) after the type id of output_norm.weight (1 dim): far past the end of the file
    at = good.index(b"output_norm.weight") + len(b"output_norm.weight") + 4 + 8 + 4
    p.write_bytes(good[:at] + struct.pack("<Q", 1 << 40) + good[at + 8:])
    line = run_cli(p, capsys)
    assert "output_norm.weight" in line and "truncated" in line
