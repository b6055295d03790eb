"""`kvinfer bench prefix-cache --two-servers`: two `kvinfer serve` processes on one Redis. The first computes a long
prompt; the second's first request on it should find the prefix in Redis instead of computing it again."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import kvinfer
from kvinfer.bench import machine, machine_line
from kvinfer.bench.prefix_cache import _free_port, start_redis

# The engine flags handed on to both servers (the rest keep serve's defaults).
FORWARDED = (("--model", "model"), ("--load-format", "load_format"), ("--tokenizer", "tokenizer"),
             ("--dtype", "dtype"), ("--quantization", "quantization"), ("--device", "device"),
             ("--kv-cache-dtype", "kv_cache_dtype"), ("--kv-cache-memory", "kv_cache_memory"),
             ("--block-size", "block_size"), ("--max-model-len", "max_model_len"), ("--threads", "threads"),
             ("--seed", "seed"), ("--max-num-batched-tokens", "max_num_batched_tokens"))
START_TIMEOUT_S = 300.0
DRAIN_TIMEOUT_S = 120.0


def server_argv(args, port: int, redis_url: str) -> list[str]:
    argv = [sys.executable, "-m", "kvinfer.cli", "serve", "--port", str(port), "--kv-cache-redis", redis_url]
    for flag, attr in FORWARDED:
        value = getattr(args, attr, None)
        if value is not None:
            argv += [flag, str(value)]
    return argv


class Server:
    """One `kvinfer serve` subprocess (this kvinfer's code), its log in a file."""

    def __init__(self, argv: list[str], log: Path):
        env = dict(os.environ)
        root = str(Path(kvinfer.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.log = log
        self.url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_up(self, client: httpx.Client) -> str:
        """The served model's name, once /health answers."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvinfer serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if client.get(self.url + "/health", timeout=2).status_code == 200:
                    return client.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvinfer serve did not come up in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def metric(self, client: httpx.Client, name: str, tier: str = "") -> float:
        total = 0.0
        for line in client.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + "{") and (not tier or f'tier="{tier}"' in line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def complete(client: httpx.Client, url: str, model: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion of token ids: TTFT (to the first chunk with text), tokens and logprobs, and
    the usage's cached tokens."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens, logprobs, usage = None, [], [], None
    with client.stream("POST", url + "/v1/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or ():
                lp = c.get("logprobs") or {}
                if lp.get("tokens"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += lp["tokens"]
                    logprobs += lp["token_logprobs"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return dict(ttft_s=ttft, tokens=tokens, logprobs=logprobs, prompt_tokens=(usage or {}).get("prompt_tokens"),
                cached_tokens=cached)


def wait_written(client: httpx.Client, server: Server) -> None:
    """Until the server's writer thread has sent every computed block on to Redis."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while server.metric(client, "kvinfer_kv_tier_queued_bytes") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the first server's KV writes did not drain")
        time.sleep(0.1)


def vocab_size(args) -> int:
    """The model's vocabulary size (prompt ids are drawn below it), from a small engine in this process."""
    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm_engine import LLMEngine

    probe = LLMEngine(engine_config_from_args(args).replace(kv_cache_memory=1 << 20, kv_offload_memory=None,
                                                            kv_cache_dir=None, kv_cache_dir_size=None,
                                                            kv_cache_redis=None))
    vocab = probe.model_config.vocab_size
    probe.close()
    return vocab


def cmd_two_servers(args) -> int:
    if getattr(args, "tensor_parallel_size", 1) != 1:
        print("kvinfer bench prefix-cache: --two-servers runs on one rank (the KV tiers are off under tensor "
              "parallelism)", file=sys.stderr)
        return 2
    tokens = args.long_prefix
    if tokens < 2:
        print("kvinfer bench prefix-cache: --two-servers needs --long-prefix of at least 2 tokens", file=sys.stderr)
        return 2
    vocab = vocab_size(args)
    work = Path(tempfile.mkdtemp(prefix="kvinfer-two-servers-"))
    redis_url, redis_proc = (args.redis, None) if args.redis else start_redis(work)
    if redis_url is None:
        print("kvinfer bench prefix-cache: --two-servers needs redis-server and the redis client (Debian: apt-get "
              "install redis-server; pip install redis), or --redis URL", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        return 2
    servers: list[Server] = []
    try:
        with httpx.Client() as client:
            for i in range(2):
                servers.append(Server(server_argv(args, _free_port(), redis_url), work / f"server{i + 1}.log"))
            models = [s.wait_up(client) for s in servers]
            rng = random.Random(args.workload_seed)
            # Each server first answers a short prompt of its own (start-up costs out of the way), then the first
            # computes the long prompt, and once its blocks are in Redis the second gets the same prompt.
            for s, m in zip(servers, models):
                complete(client, s.url, m, [rng.randrange(100, vocab) for _ in range(32)], 2)
            ids = [rng.randrange(100, vocab) for _ in range(tokens)]
            first = complete(client, servers[0].url, models[0], ids, args.max_tokens)
            wait_written(client, servers[0])
            second = complete(client, servers[1].url, models[1], ids, args.max_tokens)
            hits = servers[1].metric(client, "kvinfer_kv_tier_hits_total", "redis")
            errors = [s.metric(client, "kvinfer_kv_tier_errors_total", "redis") for s in servers]
    except RuntimeError as e:
        print(f"kvinfer bench prefix-cache --two-servers: {e}", file=sys.stderr)
        return 1
    finally:
        for s in servers:
            s.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    same = first["tokens"] == second["tokens"] and first["logprobs"] == second["logprobs"]
    prompt = second["prompt_tokens"] or tokens
    report = dict(prompt_tokens=prompt, first=dict(ttft_s=first["ttft_s"], cached_tokens=first["cached_tokens"]),
                  second=dict(ttft_s=second["ttft_s"], cached_tokens=second["cached_tokens"],
                              redis_block_hits=int(hits)),
                  skipped=second["cached_tokens"] / prompt, ttft_ratio=second["ttft_s"] / first["ttft_s"],
                  redis_errors=[int(e) for e in errors], same_output=same, machine=machine())
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(machine_line())
        print(f"two kvinfer serve processes on one Redis, a {prompt}-token prompt ({args.max_tokens} tokens out)")
        print(f"server 1, computed:        TTFT {first['ttft_s'] * 1e3:9.1f} ms, {first['cached_tokens']} cached "
              f"tokens")
        print(f"server 2, its first time:  TTFT {second['ttft_s'] * 1e3:9.1f} ms, {second['cached_tokens']} cached "
              f"tokens ({100 * report['skipped']:.1f}% of the prefill skipped, {int(hits)} blocks from Redis)")
        print(f"TTFT ratio {report['ttft_ratio']:.3f}; Redis errors {report['redis_errors']}; outputs (tokens and "
              f"logprobs) identical: {'yes' if same else 'NO'}")
    return 0 if same else 1

