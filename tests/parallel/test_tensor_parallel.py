"""Tensor parallelism over gloo: TP 2 and 3 give TP 1's tokens; server, two nodes, failures; no process left behind."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from kvinfer import LLM, SamplingParams
from kvinfer.config import EngineConfig
from kvinfer.errors import UnsupportedError, ValidationError
from kvinfer.parallel import check_tp_size, kv_heads_per_rank, valid_sizes

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180  # seconds any one multi-process step may take on a busy 2-core machine


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_tracker(p: psutil.Process) -> bool:
    # multiprocessing's resource tracker: one per process that spawned, it lives as long as its parent does.
    try:
        return "resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if _alive(p) and not _is_tracker(p)]


@pytest.fixture(autouse=True)
def no_process_left_behind():
    before = {p.pid for p in _children()}
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in _children() if p.pid not in before]:
        time.sleep(0.1)
    left = [p for p in _children() if p.pid not in before]
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[p.cmdline()[:4] for p in left]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvinfer(*args, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen([sys.executable, "-m", "kvinfer.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def _end(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)  # its own session: the group is it and its workers
        p.wait(10)


# ---- sizes and errors (no processes) -------------------------------------------------------------------
def test_head_counts_decide_the_sizes_that_work(builtin_model_path):
    from kvinfer.loaders.gguf_loader import read_metadata_config

    cfg = read_metadata_config(Path(builtin_model_path))  # 9 heads, 3 KV heads, MLP 1536
    assert valid_sizes(cfg) == [1, 3]
    assert kv_heads_per_rank(cfg, 3) == 1
    with pytest.raises(ValidationError) as e:
        check_tp_size(cfg, 2)
    msg = str(e.value)
    assert "9 attention heads" in msg and "3 KV heads" in msg and "sizes that work for this model: 1, 3" in msg
    assert "\n" not in msg
    gqa = cfg.replace(num_heads=12, num_kv_heads=2, intermediate_size=1536)
    assert kv_heads_per_rank(gqa, 4) == 1 and kv_heads_per_rank(gqa, 2) == 1  # replicated, then split
    with pytest.raises(ValidationError):
        check_tp_size(gqa, 3)  # 3 neither divides nor is a multiple of 2 KV heads
    # Experts are dealt out whole: no more ranks than experts; the dense MLP width does not count.
    moe = cfg.replace(num_heads=12, num_kv_heads=2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=256,
                      intermediate_size=1000)
    assert valid_sizes(moe) == [1, 2]
    with pytest.raises(ValidationError, match="be at most the 3 experts") as e:
        check_tp_size(moe, 4)
    assert "\n" not in str(e.value) and "sizes that work for this model: 1, 2" in str(e.value)


def test_gguf_split_inside_a_block_is_named():
    from kvinfer.parallel.shard import CommStats, shard_decoder
    from kvinfer.layers.quant_linear import QuantLinear
    from tests.tp_helpers import build, config_of

    cfg = config_of("llama", {})  # MLP width 96: TP 3 cuts the down projection at input 32, TP 2 at 48

    def q8_model():
        model = build(cfg)
        for layer in model.layers:  # Q8_0 blocks of 32 values: zero bytes are valid blocks (scale 0)
            d = layer.mlp.down
            layer.mlp.down = QuantLinear(torch.zeros(d.out_features, d.in_features // 32 * 34, dtype=torch.uint8),
                                         "Q8_0", (d.out_features, d.in_features))
        return model

    with pytest.raises(UnsupportedError, match="inside a 32-value Q8_0 block"):
        shard_decoder(q8_model(), cfg, 0, 2, None, CommStats(), exact=False)
    shard_decoder(q8_model(), cfg, 0, 2, None, CommStats(), exact=True)  # whole output rows: no block is cut


def test_engine_config_validates_parallel_fields():
    for kw, param in [(dict(tensor_parallel_size=0), "tensor_parallel_size"), (dict(tensor_parallel_size=3, nnodes=2),
                      "nnodes"), (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank"),
                      (dict(master_port=70000), "master_port")]:
        with pytest.raises(ValidationError) as e:
            EngineConfig(**kw)
        assert e.value.param == param


def test_bench_reports_the_allreduce_share(capsys):
    from types import SimpleNamespace

    from kvinfer.bench.cli import _print_tp, _tp_comm
    from kvinfer.parallel.shard import CommStats

    stats = CommStats(allreduce_s=0.3, allreduce_calls=120, allreduce_bytes=120 * 2304, broadcast_s=0.02, steps=2)
    c = _tp_comm(SimpleNamespace(tp=SimpleNamespace(size=3, stats=stats)), wall_s=1.0)
    assert c["allreduce_ms"] == pytest.approx(150.0) and c["allreduce_share"] == pytest.approx(0.3)
    assert c["step_ms"] == pytest.approx(500.0) and c["allreduce_calls"] == 60
    _print_tp(c)
    out = capsys.readouterr().out
    assert "tensor parallel 3: all-reduce 150.00 ms per step (60 calls, 135.0 KiB) of 500.00 ms = 30.0%" in out
    # 150 + 10 ms of 500 communicate in 62 collectives; at 10 us each: 340 ms of compute + 0.62 ms
    assert "outlook: 32.0% of this step is communication (62 collectives, 2.58 ms each)" in out
    assert "would spend 0.62 ms in them: 340.62 ms instead of 500.00 ms" in out
    assert _tp_comm(SimpleNamespace(tp=None), 1.0) is None


def test_simulator_tp_cost_term():
    from kvinfer.models.families import preset_config
    from kvinfer.lab import simulate as sim
    from kvinfer.core.request import Request
    from kvinfer.sampling_params import SamplingParams
    from kvinfer.core.scheduler import ScheduledSeq, SchedulerOutput

    smol = preset_config("smollm2-135m")  # 30 layers, hidden 576, MLP 1536, vocab 49152
    base = sim.CostModel(0.01, 3e-3, 6e-3, 9e-6)
    r = Request("a", [1] * 20, SamplingParams(max_tokens=4))
    out = SchedulerOutput([ScheduledSeq(r, 19, 1), ScheduledSeq(r, 0, 12)])  # 13 tokens, 1 decode, 1 sampled row
    exact = sim.TPCost(base, 3, smol, latency_s=1e-3, bandwidth=1e9)
    moved = (576 + 576 + 1536 + 576) * 2 / 3 * 13 * 30 + 49152 * 2 / 3  # values each rank receives
    assert exact.comm_time(out) == pytest.approx(121 * 1e-3 + moved * 4 / 1e9)
    assert exact.step_time(out) == pytest.approx(0.01 + (3e-3 * 13 + 6e-3 + 9e-6 * 32) / 3 + exact.comm_time(out))
    reduce = sim.TPCost(base, 3, smol, latency_s=1e-3, bandwidth=1e9, exact=False)
    assert reduce.comm_time(out) == pytest.approx(61 * 1e-3 + ((576 * 2) * 2 * 2 / 3 * 13 * 30 + 49152 * 2 / 3) * 4e-9)
    assert sim.TPCost(base, 1, smol).comm_time(out) == 0.0
    # KV memory is per rank: one of the 3 KV heads each, so 3x the blocks (10 blocks of bfloat16 at TP 1)
    trace, memory = [sim.TraceRequest(0.0, 40, 4)], 30 * 2 * 3 * 64 * 2 * 16 * 10
    one = sim.simulate(trace, smol, sim.SimConfig(kv_cache_memory=memory), base)
    three = sim.simulate(trace, smol, sim.SimConfig(kv_cache_memory=memory, tp=3), exact)
    assert (one.capacity, three.capacity) == ("10 blocks of 16 tokens", "30 blocks of 16 tokens")


def test_simulate_cli_tp(capsys):
    import json

    from kvinfer.cli import main

    argv = ["simulate", "--model", "smollm2-135m", "--synthetic", "4", "--no-compare", "--json"]
    assert main(argv + ["-tp", "3", "--tp-latency", "10", "--tp-bandwidth", "100"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "tensor parallel 3" in r["cost_model"]["source"] and "at 10 us" in r["cost_model"]["source"]
    assert r["results"]["paged"]["completed"] == 4
    assert main(argv + ["-tp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sizes that work for this model: 1, 3" in err


# ---- every family, sharded, against the unsharded model (one 3-rank gloo job) ---------------------------
def test_every_family_tp2_and_tp3_match_tp1():
    import torch.multiprocessing as mp

    from tests.tp_helpers import CASES, family_job

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=family_job, args=(r, 3, port, results), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    got = []
    try:
        while len(got) < 2 * len(CASES):
            item = results.get(timeout=TIMEOUT)
            assert item[0] != "error", f"rank {item[1]} failed:\n{item[2]}"
            got.append(item)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for family, tp, kv, exact, diff, same in got:
        what = f"{family} TP {tp} ({kv} KV heads, {'exact' if exact else 'all-reduce'})"
        assert same, f"{what}: greedy tokens differ from TP 1"
        # Exact: every value is computed whole, in TP 1's order. All-reduce: N partial sums, another order.
        assert diff == 0.0 if exact else diff < 1e-4, f"{what}: log-probs differ by {diff:.2e}"


# ---- the built-in model (Q4_1 GGUF, quantized kernels) at TP 3, then the server over it ------------------
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def tp3_engine(builtin_model_path):
    from kvinfer.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=None, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512,
                                 tensor_parallel_size=3))
    yield eng
    eng.close()


def test_builtin_model_tp3_matches_tp1(tp3_engine, builtin_llm):
    eng = tp3_engine
    assert eng.tp.size == 3 and eng.loaded.quantized_modules > 0  # the Q4_1 kernels, sharded
    assert eng.kv_cache.k[0].shape[2] == 1  # one of the 3 KV heads per rank
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True, prompt_logprobs=1)
    ref = builtin_llm.generate(PROMPTS, params, use_tqdm=False)
    ids = [eng.add_request(None, p, params) for p in PROMPTS]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    for r, i in zip(ref, ids):
        a, b = r.outputs[0], done[i].outputs[0]
        assert a.token_ids == b.token_ids
        # Bitwise: every logit is computed whole in TP 1's order (all-gathers, vocabulary-parallel head). The
        # all-reduce route (KVINFER_TP_EXACT=0) differs by up to ~7e-3 here: its other summation order changes last
        # bits, which the int16 rounding of activations per block in the quantized matmuls amplifies.
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
        # prompt logprobs too: every rank computes its slice of the head for the same rows
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(r.prompt_token_ids)
        assert r.prompt_logprobs == done[i].prompt_logprobs
    head = eng.loaded.model.lm_head
    assert type(head).__name__ == "VocabParallelHead" and head.inner.out_features == 49152 // 3
    assert eng.tp.stats.allreduce_calls == eng.tp.stats.steps * 4 * eng.model_config.num_layers


def test_server_under_tp_answers_the_openai_client(tp3_engine, builtin_llm):
    import openai

    from kvinfer.engine.async_engine import AsyncLLMEngine
    from kvinfer.server.app import ServerThread, create_app

    want = builtin_llm.chat([{"role": "user", "content": PROMPTS[0]}],
                            SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    engine = AsyncLLMEngine(tp3_engine)
    server = ServerThread(create_app(engine, "smollm")).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": PROMPTS[0]}],
                                           temperature=0, max_tokens=12)
        assert r.choices[0].message.content == want
    finally:
        server.stop()
        engine.shutdown()  # closes the TP engine: its workers end here


# ---- processes: two nodes on loopback, a killed worker ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny_tp")
    save_tiny_llama(path, num_attention_heads=6, num_key_value_heads=2, hidden_size=48, intermediate_size=96)
    return str(path)


def test_two_nodes_on_loopback(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ref = LLM(tiny_dir, dtype="float32", kv_cache_memory=4 << 20).generate([prompt], params, use_tqdm=False)
    port = _free_port()
    node1 = _kvinfer("generate", "--model", tiny_dir, "--dtype", "float32", "-tp", "2", "--nnodes", "2",
                     "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port))
    try:
        llm = LLM(tiny_dir, dtype="float32", kv_cache_memory=4 << 20, tensor_parallel_size=2, nnodes=2,
                  node_rank=0, master_addr="127.0.0.1", master_port=port)
        assert not llm.engine.tp.procs  # one process per node: node 0 started none
        out = llm.generate([prompt], params, use_tqdm=False)
        llm.close()
        assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert node1.wait(TIMEOUT) == 0, node1.stderr.read()
    finally:
        _end(node1)


def _serve_tp2(model_dir: str):
    """`kvinfer serve -tp 2` in its own session, once /health answers: (process, url)."""
    import httpx

    port = _free_port()
    srv = _kvinfer("serve", "--model", model_dir, "--dtype", "float32", "-tp", "2", "--port", str(port),
                   "--kv-cache-memory", "4MiB", "--served-model-name", "x")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + TIMEOUT
    while True:
        if srv.poll() is not None:
            raise AssertionError(srv.stderr.read())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return srv, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _end(srv)
            raise AssertionError("server did not start")
        time.sleep(0.3)


def test_ctrl_c_mid_request_leaves_no_process(tiny_dir):
    import httpx

    srv, url = _serve_tp2(tiny_dir)
    try:
        workers = [p for p in psutil.Process(srv.pid).children(recursive=True) if not _is_tracker(p)]
        assert workers
        body = dict(model="x", prompt=[5, 6, 7], max_tokens=400, temperature=0, ignore_eos=True, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # generating now
            os.killpg(srv.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert srv.wait(60) in (0, 130)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"orphans: {[p.pid for p in alive]}"
    finally:
        _end(srv)


def test_killed_worker_gives_503_and_the_server_exits_nonzero(tiny_dir):
    import httpx

    srv, url = _serve_tp2(tiny_dir)
    try:
        body = dict(model="x", prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        workers = [p for p in psutil.Process(srv.pid).children(recursive=True) if not _is_tracker(p)]
        assert len(workers) >= 1
        for w in workers:
            w.kill()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert "tensor-parallel worker rank 1" in r.json()["error"]["message"]
        assert srv.wait(60) != 0
        assert "tensor-parallel worker rank 1" in srv.stderr.read()
    finally:
        _end(srv)


# ---- CUDA / NCCL ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 GPUs")
@pytest.mark.parametrize("exact", ["1", "0"])
def test_nccl_tp2_matches_tp1(tiny_dir, monkeypatch, exact):
    import torch.distributed as dist

    monkeypatch.setenv("KVINFER_TP_EXACT", exact)  # the spawned rank inherits it
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    kw = dict(dtype="float32", device="cuda", kv_cache_memory=4 << 20)
    ref = LLM(tiny_dir, **kw).generate([prompt], params, use_tqdm=False)
    llm = LLM(tiny_dir, tensor_parallel_size=2, **kw)
    try:
        tp = llm.engine.tp
        assert dist.get_backend(tp.compute) == "nccl" and llm.engine.loaded.device.type == "cuda"
        head = llm.engine.loaded.model.lm_head
        assert type(head).__name__ == "VocabParallelHead" and head.inner.weight.is_cuda
        out = llm.generate([prompt], params, use_tqdm=False)
        assert tp.stats.head_s > 0 and tp.stats.allreduce_calls > 0
    finally:
        llm.close()
    a, b = ref[0].outputs[0], out[0].outputs[0]
    assert a.token_ids == b.token_ids
    # cuBLAS picks its kernels by shape, so even the exact route is not bitwise on CUDA
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


# ---- a mixture of experts with quantized experts, TP 2 through the engine -------------------------------------
def test_moe_gguf_tp2_gives_tp1s_tokens_and_logprobs(tmp_path):
    """Whole experts dealt out to the ranks (4 of 8 each): the engine's TP 2 answers bit for bit as TP 1, prompt
    log-probs included, and each rank holds only its own experts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_gguf", ROOT / "scripts/make_gguf.py")
    make_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gguf)
    path = str(make_gguf.write_direct(tmp_path / "moe.gguf", "tiny-qwen3moe", "Q8_0", seed=4))
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True, prompt_logprobs=1)
    prompts = ["The sea is", "Count: one, two,"]
    kw = dict(dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    ref = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        eng = llm.engine
        moe = eng.loaded.model.layers[0].mlp
        assert moe.owned == frozenset({0, 2, 4, 6}) and isinstance(moe.experts[1], torch.nn.Identity)
        assert eng.loaded.quantized_modules > 0
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == [x.logprob for x in b.outputs[0].logprobs]
        assert a.prompt_logprobs == b.prompt_logprobs


# ---- a fused projection whose parts differ in type (Q4_K_M's q/k Q4_K and v Q6_K), TP 2 --------------------------
def test_mixed_type_projections_shard_and_give_tp1s_bits(tmp_path):
    """q/k/v of other types (QuantParts) split by rows as their parts: each rank's share keeps each part's type,
    and TP 2 answers bit for bit as TP 1."""
    from kvinfer.layers.quant_linear import QuantParts
    from tests.gguf_helpers import write_mixed

    path = str(write_mixed(tmp_path / "mixed.gguf"))
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    prompts = [[2 + (5 * i + j) % 60 for j in range(4 + 3 * i)] for i in range(3)]
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
    ref = LLM(path, **kw).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        qkv = llm.engine.loaded.model.layers[0].attn.qkv
        inner = getattr(qkv, "inner", qkv)
        assert isinstance(inner, QuantParts) and [p.qtype for p in inner.parts] == ["Q4_0", "Q4_0", "Q8_0"]
        assert [p.out_features for p in inner.parts] == [32, 16, 16]  # this rank's half of q (4 heads), k, v (2)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.close()
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == [x.logprob for x in b.outputs[0].logprobs]
