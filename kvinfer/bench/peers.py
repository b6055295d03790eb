"""Peers measured in the same run: Hugging Face transformers and (optionally) llama.cpp."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch


def load_transformers(source, dtype: torch.dtype, device: torch.device, model: Optional[str] = None):
    """The same weights in transformers, on the engine's device: a GGUF is dequantized by transformers itself. With
    `--load-format dummy` (source.kind "dummy", `model` the preset name or config path) there are no weights to
    share: transformers builds the same shapes from the same config with its own random weights, which is enough
    for timing (the peers run a fixed number of tokens, EOS or not)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:  # its per-tensor progress bars would bury the benchmark's table
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:  # its GGUF conversion draws a tqdm bar of its own
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        if not isinstance(gguf_utils.tqdm, functools.partial):
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except (ImportError, AttributeError):
        pass
    model_path = source.path
    if source.kind == "dummy":
        import json

        from kvinfer.config import PRESETS

        if model in PRESETS:
            d = dict(PRESETS[model])
        else:
            d = json.loads((model_path / "config.json" if model_path.is_dir() else model_path).read_text())
        hf_config = AutoConfig.for_model(**d)
        with torch.device(device):  # initialised where it runs: a 7B model's random init is slow on a CPU
            m = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    elif model_path.is_file():
        m = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    return m.to(device).eval()


class _TimingStreamer:
    """transformers calls put() with the prompt, then once per generated token."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if value.is_cuda:  # the token is computed when its time is taken, not merely queued
            torch.cuda.synchronize(value.device)
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def transformers_decode(model, prompt_ids: list[int], new_tokens: int) -> dict:
    ids = torch.tensor([prompt_ids], device=model.device)
    streamer = _TimingStreamer()
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, streamer=streamer, pad_token_id=0)
    t = streamer.times
    return dict(ttft=t[0] - t0, decode_tps=(len(t) - 1) / (t[-1] - t[0]), tokens=len(t))


def transformers_static_batches(model, requests, batch_size: int) -> dict:
    """Static batching: each batch of `batch_size` runs until its longest output is done."""
    useful = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids):] = 1
            longest = max(r.output_tokens for r in batch)
            model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=0)
            useful += sum(r.output_tokens for r in batch)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    secs = time.perf_counter() - t0
    return dict(seconds=secs, useful_tokens=useful, tps=useful / secs)


def load_llama_cpp(model_path: Path, n_ctx: int, threads: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)


def llama_cpp_decode(llm, prompt_ids: list[int], new_tokens: int) -> Optional[dict]:
    llm.reset()
    t0 = time.perf_counter()
    times = []
    for _tok in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        if len(times) >= new_tokens:
            break
    return dict(ttft=times[0] - t0, decode_tps=(len(times) - 1) / (times[-1] - times[0]), tokens=len(times))


def llama_cpp_throughput(llm, requests) -> dict:
    """llama-cpp-python's Python API runs one sequence at a time: the workload back to back."""
    useful = 0
    t0 = time.perf_counter()
    for r in requests:
        n = 0
        for _tok in llm.generate(r.prompt_token_ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if n >= r.output_tokens:
                break
        useful += n
    secs = time.perf_counter() - t0
    return dict(seconds=secs, useful_tokens=useful, tps=useful / secs)


def find_binary(explicit: Optional[str], env: str, name: str) -> Optional[str]:
    """A llama.cpp binary: the explicit path, else $env, else `name` on PATH (None when none is executable)."""
    import os
    import shutil

    cand = explicit or os.environ.get(env) or name
    return shutil.which(cand) or (cand if os.path.isfile(cand) and os.access(cand, os.X_OK) else None)


def llama_bench_decode(binary: str, model_path: Path, prompt_tokens: int, new_tokens: int, threads: int,
                       repetitions: int = 3) -> dict:
    """llama.cpp's own benchmark: pp<prompt_tokens> and tg<new_tokens>, mean tokens/s over its repetitions. Its
    prefill figure is the prompt alone, so TTFT is reported as prompt_tokens / that rate. Raises RuntimeError
    (one line) when the binary fails or prints something else than its JSON."""
    import json
    import subprocess

    argv = [binary, "-m", str(model_path), "-p", str(prompt_tokens), "-n", str(new_tokens), "-t", str(threads),
            "-r", str(repetitions), "-o", "json"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"llama-bench could not run: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {tail}")
    try:
        rows = json.loads(proc.stdout)
        pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt_tokens and r["n_gen"] == 0)
        tg = next(r["avg_ts"] for r in rows if r["n_gen"] == new_tokens and r["n_prompt"] == 0)
    except (ValueError, KeyError, StopIteration, TypeError) as e:
        raise RuntimeError(f"llama-bench printed no pp{prompt_tokens}/tg{new_tokens} results: {e}") from e
    return dict(ttft=prompt_tokens / pp, decode_tps=tg, tokens=new_tokens, command=" ".join(argv))


def find_llama_server(explicit: Optional[str]) -> Optional[str]:
    """The llama.cpp server binary: --llama-server, else $LLAMA_SERVER, else `llama-server` on PATH."""
    return find_binary(explicit, "LLAMA_SERVER", "llama-server")


def llama_server_throughput(binary: str, model_path: Path, requests, threads: int, slots: int,
                            ctx_per_slot: int) -> dict:
    """The workload through llama.cpp's own HTTP server with `slots` parallel sequences (continuous batching):
    every request is sent at once from its own thread, the server queues what its slots cannot take."""
    import json
    import socket
    import subprocess
    import tempfile
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [binary, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "-b", "512", "-ngl", "0"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.time() > deadline:
                raise RuntimeError("llama-server did not become healthy within 120 s")
            time.sleep(0.3)

        def one(r, n_predict=None):
            body = json.dumps(dict(prompt=r.prompt_token_ids, n_predict=n_predict or r.output_tokens,
                                   temperature=0.0, top_k=1, ignore_eos=True, cache_prompt=False,
                                   stream=False)).encode()
            req = urllib.request.Request(base + "/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=3600) as resp:
                out = json.loads(resp.read())
            return min(int(out.get("tokens_predicted", 0)), n_predict or r.output_tokens)

        try:
            one(requests[0], 4)  # warm-up
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(requests)) as pool:
                useful = sum(pool.map(one, requests))
            secs = time.perf_counter() - t0
        except (OSError, ValueError) as e:  # urllib's HTTP and connection errors are OSErrors
            raise RuntimeError(f"a request to llama-server failed: {e}") from e
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return dict(seconds=secs, useful_tokens=useful, tps=useful / secs, command=" ".join(argv[:1] + argv[3:]))


# How to get each optional peer, named when one is missing.
PEER_INSTALL = {
    "transformers": "pip install 'kvinfer[bench]' (transformers; gguf too for a GGUF model)",
    "llama.cpp": "pip install llama-cpp-python, or --llama-bench PATH / $LLAMA_BENCH (llama.cpp's llama-bench)",
}


def peer_present(name: str, gguf: bool = False, llama_bench_ok: bool = True) -> bool:
    """Whether an optional peer can run here: its package imports (transformers needs gguf for a GGUF model), or
    for llama.cpp, llama-cpp-python or a llama-bench binary ($LLAMA_BENCH, PATH)."""
    import importlib.util
    import os

    if name == "transformers":
        return importlib.util.find_spec("transformers") is not None and (
            not gguf or importlib.util.find_spec("gguf") is not None)
    if name == "llama.cpp":
        return (importlib.util.find_spec("llama_cpp") is not None
                or (llama_bench_ok and bool(os.environ.get("LLAMA_BENCH")) and find_binary(None, "LLAMA_BENCH", "llama-bench") is not None))
    return True


def pick_peers(candidates, gguf: bool = False, llama_bench_ok: bool = True) -> tuple[list[str], list[str]]:
    """(the candidates present here, one line per missing one naming how to get it)."""
    present = [p for p in candidates if peer_present(p, gguf, llama_bench_ok)]
    missing = [f"{p} is not installed: {PEER_INSTALL[p]}" for p in candidates if p not in present]
    return present, missing
