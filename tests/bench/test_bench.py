"""`kvinfer bench decode|throughput` end to end on a tiny model, with transformers as the peer."""
from __future__ import annotations

import json

import pytest

from kvinfer import kernels
from kvinfer.bench import machine, machine_line
from kvinfer.bench.workload import throughput_workload
from kvinfer.cli import main


def test_bench_throughput_json_counts_and_ratio(tiny_llama_dir, capsys):
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "4", "--hf-batch-size", "2",
               "--kv-cache-memory", "8MiB", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    ours, hf = res["rows"]
    work = throughput_workload(4, 0, vocab_size=256)
    assert ours["generated"] == sum(w.output_tokens for w in work)  # ignore_eos: every request runs to its length
    assert ours["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in work)
    assert hf["name"] == "transformers (static batches of 2)" and hf["useful_tokens"] == ours["generated"]
    assert hf["kvinfer_vs_this"] == ours["tps"] / hf["tps"]
    assert 0.5 < ours["kv_utilisation"] <= 1.0 and 0 < ours["peak_blocks"] <= ours["total_blocks"]
    assert ours["kv_bytes"] == 8 << 20 and ours["peak_rss"] > ours["weights_bytes"]


def test_bench_throughput_prints_ours_before_the_peers(tiny_llama_dir, capsys):
    assert main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "2", "--compare", "none"]) == 0
    out = capsys.readouterr().out
    assert out.index("generated tokens/s") < out.index("KV blocks peak") < out.index("engine ")
    assert "utilisation" in out and "peak RSS" in out and "transformers" not in out
    assert out.splitlines()[1].startswith("machine: ")  # every figure says what it was measured on


def test_bench_decode_table(tiny_llama_dir, capsys):
    rc = main(["bench", "decode", "--model", tiny_llama_dir, "--tokens", "8", "--prompt-tokens", "4", "--block-size", "2",
               "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in res["rows"]]
    assert names == ["kvinfer", "transformers"]
    for r in res["rows"]:
        assert r["decode_tps"] > 0 and r["ttft"] > 0
        assert r["prefill_tps"] == 4 / r["ttft"]
    assert res["rows"][0]["cached_prompt_tokens"] == 0  # the warm-up must not serve the prompt from the cache
    assert res["rows"][1]["kvinfer_vs_this"] == res["rows"][0]["decode_tps"] / res["rows"][1]["decode_tps"]
    assert res["machine"]["kernels"] == (kernels.level() or "off") and res["machine"]["cpu"]


def test_bench_with_dummy_weights_measures_transformers_on_the_same_shapes(tmp_path, capsys):
    """--load-format dummy has no weight file to share: the transformers peer builds the config's shapes itself
    (it used to fail on the missing path), for decode and throughput alike."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)))
    common = ["--load-format", "dummy", "--model", str(cfg), "--kv-cache-memory", "8MiB", "--json"]
    assert main(["bench", "decode", "--tokens", "6", "--prompt-tokens", "4", *common]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["name"] for r in rows] == ["kvinfer", "transformers"] and rows[1]["tokens"] == 6
    assert main(["bench", "throughput", "--num-requests", "2", "--hf-batch-size", "2", *common]) == 0
    ours, hf = json.loads(capsys.readouterr().out)["rows"]
    assert hf["useful_tokens"] == ours["generated"] > 0


def test_machine_names_the_cpu_its_isa_flags_and_the_kernel_level(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
                    "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 sha_ni\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    m = machine(info)
    assert m["cpu"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"  # the first processor's
    assert m["isa"] == ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"]
    assert m["kernels"] == (kernels.level() or "off") and m["cores"] >= 1
    line = machine_line(m)
    assert line.startswith("machine: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, ")
    assert "; avx2 fma f16c avx512f avx512_vnni avx512_bf16 amx_tile amx_int8; AMX " in line
    assert line.endswith(f"; kernels {m['kernels']}")
    unreadable = machine(tmp_path / "missing")  # not Linux: the platform's name, no flags, no crash
    assert unreadable["cpu"] and unreadable["isa"] == [] and "no AVX2" in machine_line(unreadable)


def test_bench_decode_rounds_take_turns_and_report_medians(tiny_llama_dir, capsys):
    argv = ["bench", "decode", "--model", tiny_llama_dir, "--tokens", "4", "--prompt-tokens", "4", "--block-size", "2",
            "--rounds", "2"]
    assert main(argv + ["--compare", "no-invariance", "--json"]) == 0
    mine, star = json.loads(capsys.readouterr().out)["rows"]
    assert mine["rounds"] == star["rounds"] == 2
    assert mine["cached_prompt_tokens"] == 0  # every round a new prompt: no prefix-cache hit in later rounds
    assert len(star["round_decode_ratios"]) == len(star["round_prefill_ratios"]) == 2
    assert all(x > 0 for x in star["round_decode_ratios"] + star["round_prefill_ratios"])
    assert main(argv + ["--compare", "none"]) == 0
    assert "medians of 2 rounds" in capsys.readouterr().out


def test_bench_rejects_unknown_peer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", "--compare", "vllm"])
    assert e.value.code == 2
    assert "unknown peer 'vllm'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["throughput", "--num-requests", "0"], "argument --num-requests: must be >= 1"),
    (["decode", "--tokens", "1"], "argument --tokens: must be >= 2"),
    (["decode", "--prompt-tokens", "0"], "argument --prompt-tokens: must be >= 1"),
    (["decode", "--rounds", "0"], "argument --rounds: must be >= 1"),
    (["throughput", "--hf-batch-size", "-1"], "argument --hf-batch-size: must be >= 1"),
    (["serve", "--rounds", "0"], "argument --rounds: must be >= 1"),
    (["serve", "--max-concurrency", "x"], "argument --max-concurrency: must be an integer"),
])
def test_bench_bad_counts_are_one_line_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


FAKE_LLAMA_SERVER = '''#!{python}
# Stands in for llama.cpp's server: /health, and /completion answering more tokens than asked (to be capped).
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
if os.environ.get("FAKE_FAIL"):
    print("error: model file not found", file=sys.stderr)
    sys.exit(3)
with open(os.environ["FAKE_ARGV"], "w") as f:
    json.dump(sys.argv[1:], f)
port = int(sys.argv[sys.argv.index("--port") + 1])

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        out = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, {{}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if os.environ.get("FAKE_HTTP_500"):
            return self._send(500, {{"error": "boom"}})
        ok = body["temperature"] == 0 and body["ignore_eos"] and isinstance(body["prompt"], list)
        self._send(200, {{"tokens_predicted": body["n_predict"] + 3 if ok else 0}})

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch):
    import sys

    exe = tmp_path / "llama-server"
    exe.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_ARGV", str(tmp_path / "argv.json"))
    return exe


def test_llama_server_peer_sends_the_workload_to_parallel_slots(fake_llama_server, tmp_path):
    from pathlib import Path

    from kvinfer.bench.peers import find_llama_server, llama_server_throughput

    work = throughput_workload(6, 0, vocab_size=256)
    assert find_llama_server(str(fake_llama_server)) == str(fake_llama_server)
    r = llama_server_throughput(str(fake_llama_server), Path("/m.gguf"), work, threads=2, slots=4, ctx_per_slot=800)
    assert r["useful_tokens"] == sum(w.output_tokens for w in work)  # capped at what each request asked for
    assert r["tps"] == r["useful_tokens"] / r["seconds"]
    argv = json.loads((tmp_path / "argv.json").read_text())
    for flag, value in [("-m", "/m.gguf"), ("-np", "4"), ("-c", "3200"), ("-t", "2")]:
        assert argv[argv.index(flag) + 1] == value
    assert "-np 4" in r["command"]


def test_llama_server_peer_reports_a_server_that_dies(fake_llama_server, monkeypatch):
    from pathlib import Path

    from kvinfer.bench.peers import llama_server_throughput

    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(RuntimeError, match="exited with 3: error: model file not found"):
        llama_server_throughput(str(fake_llama_server), Path("/m.gguf"), throughput_workload(2, 0, vocab_size=256),
                                threads=1, slots=2, ctx_per_slot=100)


def test_llama_server_peer_reports_failing_requests(fake_llama_server, monkeypatch):
    from pathlib import Path

    from kvinfer.bench.peers import llama_server_throughput

    monkeypatch.setenv("FAKE_HTTP_500", "1")
    with pytest.raises(RuntimeError, match="a request to llama-server failed: HTTP Error 500"):
        llama_server_throughput(str(fake_llama_server), Path("/m.gguf"), throughput_workload(2, 0, vocab_size=256),
                                threads=1, slots=2, ctx_per_slot=100)


def test_bench_throughput_without_llama_server_says_so(tiny_llama_dir, tmp_path, capsys):
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "2", "--compare", "llama-server",
               "--llama-server", str(tmp_path / "missing")])
    assert rc == 0
    cap = capsys.readouterr()
    assert "llama-server not found: pass --llama-server PATH or set LLAMA_SERVER; skipped" in cap.err
    assert "kvinfer" in cap.out and "llama.cpp server" not in cap.out


@pytest.fixture
def fake_llama_bench(tmp_path):
    """A stand-in for llama.cpp's llama-bench: prints its JSON for -p/-n, or fails when FAKE_BENCH_FAIL is set."""
    script = tmp_path / "llama-bench"
    script.write_text("""#!/usr/bin/env python3
import json, os, sys
if os.environ.get("FAKE_BENCH_FAIL"):
    print("error: unknown model architecture", file=sys.stderr); sys.exit(1)
a = sys.argv
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
print(json.dumps([{"n_prompt": p, "n_gen": 0, "avg_ts": 200.0}, {"n_prompt": 0, "n_gen": n, "avg_ts": 80.0}]))
""")
    script.chmod(0o755)
    return script


def test_llama_bench_peer_reads_pp_and_tg(fake_llama_bench, monkeypatch):
    from pathlib import Path

    from kvinfer.bench.peers import find_binary, llama_bench_decode

    row = llama_bench_decode(str(fake_llama_bench), Path("/m.gguf"), 512, 128, 2)
    assert row["decode_tps"] == 80.0 and row["ttft"] == 512 / 200.0
    assert "-p 512 -n 128 -t 2" in row["command"]
    monkeypatch.setenv("FAKE_BENCH_FAIL", "1")
    with pytest.raises(RuntimeError, match="llama-bench exited 1: error: unknown model architecture"):
        llama_bench_decode(str(fake_llama_bench), Path("/m.gguf"), 512, 128, 2)
    monkeypatch.setenv("LLAMA_BENCH", str(fake_llama_bench))
    assert find_binary(None, "LLAMA_BENCH", "llama-bench") == str(fake_llama_bench)
    assert find_binary("/nonexistent/llama-bench", "LLAMA_BENCH", "llama-bench") is None


def test_bench_exact_counts_bitwise_identical_requests(tiny_llama_dir, capsys):
    assert main(["bench", "exact", "--model", tiny_llama_dir, "--prompts", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "small KV budget (preemption)" in out and "none backend" in out
    restart = next(line for line in out.splitlines() if line.startswith("after a restart, from the disk tier"))
    assert "2/2" in restart and " 0 blocks restored" not in restart
    last = out.strip().splitlines()[-1].split()
    assert last[0] == "all" and last[1] == "18/18" and last[2] == "18/18"
