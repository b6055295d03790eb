"""KV tiers below the pool (RAM, disk, Redis): restored prefixes give the cold run's bits; faults only cost work."""
from __future__ import annotations

import errno
import os
import random
import shutil
import socket
import subprocess
import threading
import time

import pytest

from kvinfer import LLM, SamplingParams
from kvinfer.errors import ValidationError
from kvinfer.kv.tier_stores import DiskTier
from kvinfer.kv.block_pool import BlockPool
from kvinfer.kv.tiers import KVTiers, RamTier, decode_record, encode_record
from tests.conftest import assert_engine_clean

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
BPT = 512  # tiny llama: 2 layers * 2 kv heads * 16 dims * (K, V) * 4 bytes per token


def prompts(n, length=120, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]


def results(outs):
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


def generate_each(llm, ps):
    """One request at a time (a tier's hits come from what earlier requests left)."""
    outs = [llm.generate([p], PARAMS)[0] for p in ps]
    assert_engine_clean(llm.engine)
    return outs


@pytest.fixture(scope="module")
def cold(tiny_llama_dir):
    ps = prompts(4)
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache="none")
    return ps, results(generate_each(llm, ps))


def small_llm(model_dir, **kw):
    # 40 blocks of 4 tokens: one 120-token prompt fits, a second evicts the first
    return LLM(model_dir, dtype="float32", block_size=4, kv_cache_memory=BPT * 4 * 40, **kw)


def test_ram_tier_restores_evicted_prefixes_exactly(tiny_llama_dir, cold):
    ps, ref = cold
    llm = small_llm(tiny_llama_dir, kv_offload_memory="4MiB")
    first = generate_each(llm, ps)
    again = generate_each(llm, ps)  # each prompt was evicted from the pool by the others
    assert results(first) == ref and results(again) == ref
    ram = llm.engine.kv_tiers.counters()["ram"]
    assert ram["hits"] >= 4 * 25 and ram["bytes_in"] == ram["hits"] * 2048 and ram["errors"] == 0
    assert all(o.num_cached_tokens >= 100 for o in again)
    off = small_llm(tiny_llama_dir)
    generate_each(off, ps)
    assert all(o.num_cached_tokens == 0 for o in generate_each(off, ps))  # the pool alone had lost them


def test_ram_copies_run_off_the_engine_thread(tiny_llama_dir, cold):
    """The RAM tier's copies of blocks that may be evicted next are made by its worker thread: a step goes on while
    a copy is held up, and the prefixes restored from those copies are the cold run's bits."""
    ps, ref = cold
    llm = small_llm(tiny_llama_dir, kv_offload_memory="4MiB")
    tiers = llm.engine.kv_tiers
    assert tiers.ahead > 0
    gate, copying, readers = threading.Event(), threading.Event(), []
    real = tiers.read_block

    def read(bid):
        readers.append(threading.current_thread().name)
        if threading.current_thread().name == "kv-tier-ram":
            copying.set()
            gate.wait(300)
        return real(bid)

    tiers.read_block = read
    try:
        assert results(generate_each(llm, ps[:1])) == ref[:1]  # its 30 full blocks are freed, still cached
        assert copying.wait(300)  # the worker took the first of them and is held at the gate
        # A short request (from never-used blocks) runs every step to the end while that copy is held up.
        short = llm.generate([[5, 6, 7, 8, 9]], PARAMS)[0]
        assert len(short.outputs[0].token_ids) == 6 and not gate.is_set() and tiers.copies_ahead == 0
    finally:
        gate.set()
    tiers.flush()
    assert tiers.copies_ahead >= 29 and llm.engine.kv_tiers.counters()["ram"]["bytes_out"] > 0
    again = generate_each(llm, ps[1:] + ps[:1])  # the others evict the first prompt; it comes back from RAM
    assert results(again) == ref[1:] + ref[:1] and again[-1].num_cached_tokens >= 100
    assert tiers.sync_copies == 0 and set(readers) == {"kv-tier-ram"}  # no copy on the engine's thread
    llm.close()


def test_a_block_is_handed_out_only_after_its_copy():
    """A free block whose copy to the RAM tier is still running is reused only once the copy has finished."""
    store = {i: bytes([i]) * 8 for i in range(4)}
    events, gate, readers = [], threading.Event(), []

    def read(bid):
        readers.append(threading.current_thread().name)
        assert gate.wait(300)
        events.append(("copied", bid))
        return store[bid]

    ram = RamTier(1 << 20)
    tiers = KVTiers(b"f" * 16, 8, read, lambda bid, payload: None, [ram], ahead=8)
    pool = BlockPool(4)
    pool.on_evict = tiers.on_evict
    (b,) = pool.allocate(1)
    pool.register(b, b"k" * 16)
    pool.free([b])  # free queue: the 3 never-used blocks, then b (cached)
    tiers.copy_ahead(pool.next_evictions(8))  # the worker takes b's copy and waits at the gate
    entered = threading.Event()

    def on_reuse(bid):
        if bid == b:
            entered.set()
        tiers.on_reuse(bid)

    pool.on_reuse = on_reuse
    opener = threading.Thread(target=lambda: (entered.wait(300), events.append("gate opened"), gate.set()))
    opener.start()
    got = pool.allocate(4)  # the last one is b: its old bytes reach the RAM tier before anything may write it
    events.append("allocated")
    opener.join()
    assert got[-1] == b and events == ["gate opened", ("copied", b), "allocated"]
    assert ram.get(b"k" * 16) == store[b] and tiers.reuse_waits == 1 and tiers.sync_copies == 0
    assert readers == ["kv-tier-ram"]
    tiers.close()


def test_write_through_copies_are_taken_by_the_writer_and_a_reused_block_waits_for_its_copy():
    """Blocks computed for the persistent tiers are copied out of the pool by the writer thread, not the step's;
    a block freed and handed out again before the writer copied it waits for that copy (its bytes, not the next
    request's, reach the tier)."""
    store = {i: bytes([i]) * 8 for i in range(2)}
    events, gate, readers = [], threading.Event(), []

    def read(bid):
        readers.append(threading.current_thread().name)
        assert gate.wait(300)
        events.append(("copied", bid))
        return store[bid]

    class Sink(RamTier):
        persistent = True

    sink = Sink(1 << 20)
    tiers = KVTiers(b"f" * 16, 8, read, lambda bid, payload: None, [sink])
    assert tiers.watches_reuse and tiers.ahead == 0
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.register(b, b"k" * 16)
    tiers.computed(b, b"k" * 16)
    tiers.after_step(lambda bid, h: True)  # returns at once: the writer is held at the gate, copying b
    assert events == [] and tiers.queued_bytes == 8
    pool.free([b])
    entered = threading.Event()

    def on_reuse(bid):
        if bid == b:
            entered.set()
        tiers.on_reuse(bid)

    pool.on_reuse = on_reuse
    opener = threading.Thread(target=lambda: (entered.wait(300), events.append("gate opened"), gate.set()))
    opener.start()
    got = pool.allocate(2)  # the free queue: the never-used block, then b
    events.append("allocated")
    opener.join()
    tiers.flush()
    assert got[-1] == b and events == ["gate opened", ("copied", b), "allocated"]
    assert sink.get(b"k" * 16) == store[b] and tiers.reuse_waits == 1 and readers == ["kv-tier-writer"]
    tiers.close()


def test_disk_write_through_reads_no_block_on_the_engine_thread(tiny_llama_dir, cold, tmp_path):
    ps, ref = cold
    llm = small_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path))
    tiers, readers = llm.engine.kv_tiers, set()
    real = tiers.read_block

    def read(bid):
        readers.add(threading.current_thread().name)
        return real(bid)

    tiers.read_block = read
    assert results(generate_each(llm, ps)) == ref
    tiers.flush()
    assert readers == {"kv-tier-writer"} and len(list(tmp_path.glob("*.kvb"))) >= 4 * 29
    llm.close()


def test_ram_tier_budget_is_lru():
    t = RamTier(3000)
    for k in (b"a", b"b", b"c"):
        t.put(k, b"x" * 1000)
    assert t.get(b"a") is not None  # a is now the most recent
    t.put(b"d", b"y" * 1000)
    assert t.get(b"b") is None and t.get(b"a") is not None and t.used == 3000 and t.stats.evictions == 1


def test_record_checks():
    fp, key = b"f" * 16, b"k" * 16
    rec = encode_record(fp, key, b"payload!")
    assert bytes(decode_record(rec, fp, key, 8)[0]) == b"payload!"
    assert decode_record(rec[:-1], fp, key, 8)[1] == "truncated"
    assert decode_record(rec, b"g" * 16, key, 8)[1].startswith("foreign")
    flipped = bytearray(rec)
    flipped[-3] ^= 1
    assert decode_record(bytes(flipped), fp, key, 8)[1] == "checksum mismatch"


def test_disk_tier_survives_restart_bitwise(tiny_llama_dir, cold, tmp_path):
    ps, ref = cold
    llm = small_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path))
    assert results(generate_each(llm, ps)) == ref
    llm.close()
    files = list(tmp_path.glob("*.kvb"))
    assert len(files) >= 4 * 29
    llm = small_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path))  # a new process's view: nothing in the pool
    again = generate_each(llm, ps)
    assert results(again) == ref
    assert all(o.num_cached_tokens >= 116 for o in again)
    assert llm.engine.kv_tiers.counters()["disk"]["hits"] >= 4 * 29
    llm.close()


def _corrupt(files, how):
    for f in files:
        data = bytearray(f.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0x40
            f.write_bytes(bytes(data))
        elif how == "truncate":
            f.write_bytes(bytes(data[:len(data) // 3]))


@pytest.mark.parametrize("how", ["flip", "truncate", "foreign"])
def test_disk_faults_are_recomputed(tiny_llama_dir, cold, tmp_path, how):
    ps, ref = cold
    llm = small_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path))
    generate_each(llm, ps[:1])
    llm.close()
    files = sorted(tmp_path.glob("*.kvb"))
    bad = files[::3]
    if how == "foreign":  # another model's blocks, under the names this model looks for
        other = tmp_path / "other"
        save_dir = tmp_path / "model2"
        from tests.conftest import save_tiny_llama

        save_tiny_llama(save_dir, seed=1)
        o = small_llm(str(save_dir), kv_cache_dir=str(other))
        generate_each(o, ps[:1])
        o.close()
        theirs = {f.name.split("-", 1)[1]: f for f in other.glob("*.kvb")}
        bad = [f for f in files if f.name.split("-", 1)[1] in theirs][::3]
        assert bad
        for f in bad:
            shutil.copyfile(theirs[f.name.split("-", 1)[1]], f)
    else:
        _corrupt(bad, how)
    llm = small_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path))
    out = generate_each(llm, ps[:1])
    assert results(out) == ref[:1]
    disk = llm.engine.kv_tiers.counters()["disk"]
    assert disk["errors"] >= 1
    assert out[0].num_cached_tokens < 116  # the walk stopped at the first bad block
    llm.close()


def test_disk_full_and_quota(tiny_llama_dir, cold, tmp_path, monkeypatch):
    ps, ref = cold
    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    llm = small_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path))
    assert results(generate_each(llm, ps[:2])) == ref[:2]
    llm.close()
    assert llm.engine.kv_tiers.counters()["disk"]["errors"] > 0
    assert not list(tmp_path.iterdir())  # no temporary files left behind
    monkeypatch.setattr(os, "replace", real_replace)
    quota = 20 * (2048 + 48)
    llm = small_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path), kv_cache_dir_size=quota)
    assert results(generate_each(llm, ps)) == ref
    llm.close()
    assert sum(f.stat().st_size for f in tmp_path.glob("*.kvb")) <= quota
    assert llm.engine.kv_tiers.counters()["disk"]["evictions"] > 0


def test_two_disk_tiers_share_a_directory(tmp_path):
    fp = b"f" * 16
    a, b = DiskTier(tmp_path, 1 << 20, fp, 8), DiskTier(tmp_path, 1 << 20, fp, 8)
    a.put(b"k" * 16, b"12345678")
    assert bytes(b.get(b"k" * 16)) == b"12345678"
    b.put(b"k" * 16, b"12345678")  # already there: left alone
    assert len(list(tmp_path.iterdir())) == 1


def test_tier_flags_are_checked():
    from kvinfer.config import EngineConfig

    with pytest.raises(ValidationError, match="kv_offload_memory"):
        EngineConfig(kv_offload_memory="lots")
    with pytest.raises(ValidationError, match="kv_cache_dir"):
        EngineConfig(kv_cache_dir_size="1GiB")
    with pytest.raises(ValidationError, match="kv_cache_redis"):
        EngineConfig(kv_cache_redis="localhost:6379")


# ---- Redis ----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0", proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


def test_redis_tier_shared_between_engines(tiny_llama_dir, cold, redis_url):
    ps, ref = cold
    url, _ = redis_url
    first = small_llm(tiny_llama_dir, kv_cache_redis=url)
    assert results(generate_each(first, ps[:2])) == ref[:2]
    first.close()
    second = small_llm(tiny_llama_dir, kv_cache_redis=url)  # another replica: its pool is empty
    out = generate_each(second, ps[:2])
    assert results(out) == ref[:2]
    assert all(o.num_cached_tokens >= 116 for o in out)  # >= 90% of the prompt not recomputed
    second.close()


def test_redis_killed_mid_run(tiny_llama_dir, cold, redis_url):
    ps, ref = cold
    url, proc = redis_url
    llm = small_llm(tiny_llama_dir, kv_cache_redis=url)
    assert results(generate_each(llm, ps[:2])) == ref[:2]
    llm.engine.kv_tiers.flush()
    proc.kill()
    proc.wait(10)
    assert results(generate_each(llm, ps)) == ref  # every request answered, from the pool or recomputed
    llm.close()
    assert llm.engine.kv_tiers.counters()["redis"]["errors"] >= 1


def test_redis_down_at_start(tiny_llama_dir, cold):
    ps, ref = cold
    llm = small_llm(tiny_llama_dir, kv_cache_redis=f"redis://127.0.0.1:{_free_port()}/0")
    assert results(generate_each(llm, ps[:1])) == ref[:1]
    llm.close()


def test_tier_counters_on_metrics(tiny_llama_dir, cold):
    from prometheus_client import CollectorRegistry, generate_latest

    from kvinfer.server.tier_metrics import register_tier_metrics

    ps, _ = cold
    llm = small_llm(tiny_llama_dir, kv_offload_memory="4MiB")
    generate_each(llm, ps + ps)
    reg = CollectorRegistry()
    register_tier_metrics(reg, llm.engine, "tiny")
    text = generate_latest(reg).decode()
    hits = llm.engine.kv_tiers.counters()["ram"]["hits"]
    assert hits > 0 and f'kvinfer_kv_tier_hits_total{{model_name="tiny",tier="ram"}} {float(hits)}' in text
    assert 'kvinfer_kv_tier_errors_total{model_name="tiny",tier="ram"} 0.0' in text
    assert 'kvinfer_kv_tier_queued_bytes{model_name="tiny"} 0.0' in text  # no persistent tier: nothing queued


def test_bench_prefix_cache_json(tiny_llama_dir, capsys):
    import json

    from kvinfer.cli import main

    rc = main(["bench", "prefix-cache", "--model", tiny_llama_dir, "--dtype", "float32", "--block-size", "4",
               "--prefixes", "4", "--prefix-tokens", "64", "--rounds", "2", "--long-prefix", "200", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["bitwise_identical"]
    runs = report["runs"]
    assert runs["pool only"]["before_restart"]["cached_tokens"] == 0  # a quarter of the prefixes fit: LRU loses all
    assert runs["ram"]["before_restart"]["cached_tokens"] >= 4 * 64 - 16
    assert runs["disk"]["after_restart"]["cached_tokens"] >= 8 * 60
    assert report["long_prefix"]["cached_tokens"] >= 196


def test_plan_sizes_the_tiers(capsys):
    import json

    from kvinfer.cli import main

    assert main(["plan", "--memory", "2GiB", "--kv-offload-memory", "4GiB", "--kv-cache-dir-size", "20GiB",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    bpt, ram, disk = plan["kv_bytes_per_token"], plan["kv_tiers"]["ram"], plan["kv_tiers"]["disk"]
    assert ram["blocks"] == (4 << 30) // (bpt * 16) and disk["blocks"] == (20 << 30) // (bpt * 16 + 48)
    assert ram["prefixes"] == ram["blocks"] // 250


def test_bench_two_servers_share_a_prefix_through_redis(capsys):
    """Two `kvinfer serve` processes of the built-in model on one private redis-server: the second's first request
    on the prompt the first computed takes >= 90% of it from Redis, with the same tokens and logprobs."""
    import json

    from kvinfer.cli import main

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    rc = main(["bench", "prefix-cache", "--two-servers", "--long-prefix", "200", "--max-tokens", "3",
               "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["same_output"] and report["prompt_tokens"] == 200
    assert report["first"]["cached_tokens"] == 0 and report["second"]["cached_tokens"] >= 180
    assert report["second"]["redis_block_hits"] * 16 == report["second"]["cached_tokens"]
    assert report["redis_errors"] == [0, 0]


def test_bench_two_servers_needs_a_prompt(capsys):
    from kvinfer.cli import main

    assert main(["bench", "prefix-cache", "--two-servers", "--long-prefix", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--long-prefix" in err


def test_a_tier_slower_than_recomputing_is_passed_by_and_probed_again(monkeypatch):
    """Once a tier has measured slower per block than the engine computes a block, lookups pass it by (the block
    is recomputed: the same bits), except every PROBE_EVERY-th lookup, which measures it again; a fast tier behind
    it is still used, and a tier that got fast again is used again. The tiers' clock is a fake one that only the
    slow tier moves, so a busy machine cannot make the fast case look slow."""
    import kvinfer.kv.tiers as tiers_module

    delay = [0.05]
    clock = [0.0]

    class FakeTime:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def perf_counter():
            return clock[0]

    monkeypatch.setattr(tiers_module, "time", FakeTime())

    class Slow(RamTier):
        name = "slow"

        def get(self, key):
            clock[0] += delay[0]
            return super().get(key)

    slow, fast = Slow(1 << 20), RamTier(1 << 20)
    fast.name = "fast"
    tiers = KVTiers(b"f" * 16, 8, lambda bid: b"", lambda bid, payload: None, [slow, fast], block_tokens=16)
    slow.put(b"a" * 16, b"A" * 8)
    fast.put(b"b" * 16, b"B" * 8)
    for _ in range(KVTiers.TRUST_AFTER):  # not measured enough yet: asked every time
        assert [k for k, _ in tiers.fetch([b"a" * 16])] == [b"a" * 16]
    tiers.note_compute(0.016, 1600)  # 10 microseconds a token: 0.16 ms a block
    assert slow.s_per_block >= 0.04 and slow.stats.hits == KVTiers.TRUST_AFTER
    got = [list(tiers.fetch([b"a" * 16, b"b" * 16])) for _ in range(KVTiers.PROBE_EVERY - 1)]
    assert all(g == [] for g in got)  # "a" only lives in the slow tier: recomputed, and the walk stops there
    assert slow.stats.slow_skips == KVTiers.PROBE_EVERY - 1 and slow.stats.hits == KVTiers.TRUST_AFTER
    assert [k for k, _ in tiers.fetch([b"b" * 16])] == [b"b" * 16]  # the probe: asked (a miss), then fast has it
    assert slow.stats.misses == 1 and fast.stats.hits == 1
    delay[0] = 0.0
    for _ in range(KVTiers.PROBE_EVERY * 4):  # probes see it fast again; then it is asked every time
        list(tiers.fetch([b"a" * 16]))
    skips = slow.stats.slow_skips
    assert [k for k, _ in tiers.fetch([b"a" * 16])] == [b"a" * 16] and slow.stats.slow_skips == skips
    tiers.close()
