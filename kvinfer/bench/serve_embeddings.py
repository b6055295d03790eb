"""`kvinfer bench serve --workload embeddings`: /v1/embeddings throughput of kvinfer's server against llama.cpp's
`llama-server --embeddings` on the same GGUF file, the same requests, in one run."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Optional

WORDS = ("the of and to in is was for on that with as by at from his her they this which have had not are but "
         "river market engine memory garden winter music history station village science letter morning window "
         "language doctor mountain company evening kitchen library ocean bridge question answer").split()


def embedding_workload(num_requests: int, per_request: int, seed: int) -> list[list[str]]:
    """Requests of `per_request` texts of 8-200 seeded random words each (mixed lengths, as a RAG ingest)."""
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200))) for _ in range(per_request)]
            for _ in range(num_requests)]


async def _run(url: str, work: list[list[str]], model: str, concurrency: int) -> dict:
    import asyncio

    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(texts):
            async with sem:
                r = await client.post(url + "/v1/embeddings", json={"model": model, "input": texts})
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code} from {url}: {r.text[:200]}")
                body = r.json()
                return len(body["data"]), body.get("usage", {}).get("prompt_tokens", 0)

        await one(work[0][:1])  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(w) for w in work])
        secs = time.perf_counter() - t0
    inputs = sum(n for n, _ in results)
    tokens = sum(t for _, t in results)
    return dict(seconds=secs, inputs=inputs, tokens=tokens, ips=inputs / secs, tps=tokens / secs)


def _llama_server(binary: str, model: Path, threads: int, slots: int, pooling: str):
    import socket
    import subprocess
    import tempfile
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
            str(threads), "-np", str(slots), "-c", str(slots * 512), "-b", "512", "-ub", "512", "-ngl", "0",
            "--embeddings", "--pooling", pooling]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' | '.join(tail)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("llama-server did not become healthy within 120 s")
        time.sleep(0.3)
    return proc, log, f"http://127.0.0.1:{port}", " ".join(argv[:1] + argv[3:])


def run_embeddings_bench(args, cfg) -> int:
    import asyncio

    import torch

    from kvinfer.bench import machine, machine_line
    from kvinfer.bench.peers import find_llama_server
    from kvinfer.engine.async_engine import AsyncLLMEngine
    from kvinfer.engine.pooling import model_pooling
    from kvinfer.server.app import ServerThread, create_app

    work = embedding_workload(args.num_requests, args.inputs_per_request, args.workload_seed)
    concurrency = args.max_concurrency or len(work)
    threads = torch.get_num_threads()
    pooling = model_pooling(cfg.model)[0] or "last"
    engine = AsyncLLMEngine.from_config(cfg, max_queue=len(work) * args.inputs_per_request)
    model_path = engine.engine.loaded.source.path
    rows = []
    server = ServerThread(create_app(engine, "bench")).start()
    try:
        rows.append(dict(name="kvinfer serve", **asyncio.run(_run(server.url, work, "bench", concurrency))))
    finally:
        server.stop()
        engine.shutdown()
    binary = find_llama_server(getattr(args, "llama_server", None))
    note: Optional[str] = None
    if binary is None:
        note = "llama-server not found (--llama-server, $LLAMA_SERVER or PATH): no peer row"
    elif model_path is None or Path(model_path).suffix != ".gguf":
        note = "the model is not a GGUF file: llama-server cannot load it, no peer row"
    else:
        slots = min(cfg.max_num_seqs, concurrency * args.inputs_per_request)  # as many sequences as kvinfer runs
        proc, log, url, command = _llama_server(binary, Path(model_path), threads, slots, pooling)
        try:
            rows.append(dict(name="llama-server", command=command, **asyncio.run(_run(url, work, "bench",
                                                                                      concurrency))))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()
    ratio = rows[0]["ips"] / rows[1]["ips"] if len(rows) > 1 else None
    if args.json:
        print(json.dumps(dict(machine=machine(), threads=threads, pooling=pooling, requests=len(work),
                              inputs_per_request=args.inputs_per_request, concurrency=concurrency, rows=rows,
                              kvinfer_over_llama_server=ratio, note=note), indent=2))
        return 0
    print(f"kvinfer bench serve --workload embeddings: {model_path or cfg.model}, {threads} threads, pooling "
          f"{pooling}, {len(work)} requests x {args.inputs_per_request} texts (8-200 random words), concurrency "
          f"{concurrency}")
    print(machine_line())
    print(f"{'server':<16}{'seconds':>9}{'inputs':>8}{'tokens':>9}{'inputs/s':>10}{'tokens/s':>10}")
    for r in rows:
        print(f"{r['name']:<16}{r['seconds']:>9.2f}{r['inputs']:>8}{r['tokens']:>9}{r['ips']:>10.1f}{r['tps']:>10.1f}")
    if ratio is not None:
        print(f"kvinfer / llama-server: {ratio:.2f}x inputs/s ({rows[1]['command']})")
    if note:
        print(note)
    return 0
