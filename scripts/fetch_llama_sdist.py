"""Download the llama-cpp-python source distribution from PyPI (checked against PyPI's sha256), for the tests that
convert tiny Hugging Face models with llama.cpp's convert_hf_to_gguf.py (it ships inside the sdist).

    python scripts/fetch_llama_sdist.py DIR    # prints the path of the .tar.gz; does nothing if it is already there
"""
from __future__ import annotations

import hashlib
import re
import sys
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
INDEX = "https://pypi.org/simple/llama-cpp-python/"  # the simple index: each link carries its sha256


def fetch(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(INDEX, timeout=60) as r:
        page = r.read().decode()
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    m = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
    if m is None:
        raise RuntimeError(f"{INDEX} lists no {name}")
    url, want = m.groups()
    target = out_dir / name
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == want:
        return target
    tmp = target.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
        h = hashlib.sha256()
        while chunk := r.read(1 << 20):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != want:
        tmp.unlink()
        raise RuntimeError(f"{name}: sha256 {h.hexdigest()} is not PyPI's {want}")
    tmp.replace(target)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: fetch_llama_sdist.py DIR")
    try:
        print(fetch(Path(sys.argv[1])))
    except Exception as e:  # not fatal for `make test`: the converter tests then skip and say why
        sys.exit(f"could not fetch the llama-cpp-python {VERSION} sdist: {e}")
