"""The simulator: the engine's own scheduler on a virtual clock, deterministic, with exact clock arithmetic."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvinfer.cli import main
from kvinfer.models.families import preset_config
from kvinfer.errors import ValidationError
from kvinfer.kv.manager import PagedKVManager
from kvinfer.lab import simulate as sim
from kvinfer.core.scheduler import Scheduler, ScheduledSeq, SchedulerOutput

SMOL = preset_config("smollm2-135m")
COST = sim.CostModel(0.01, 1e-4, 1e-3, 1e-6)


def cfg(**kw):
    return sim.SimConfig(**{"kv_cache_memory": 64 << 20, **kw})


def test_deterministic_for_the_same_trace_and_seed():
    trace = sim.synthetic_trace(24, seed=3)
    a = sim.summarize(sim.simulate(trace, SMOL, cfg(), COST))
    b = sim.summarize(sim.simulate(sim.synthetic_trace(24, seed=3), SMOL, cfg(), COST))
    assert a == b
    c = sim.summarize(sim.simulate(sim.synthetic_trace(24, seed=4), SMOL, cfg(), COST))
    assert c != a


def test_synthetic_trace_is_the_bench_workload():
    from kvinfer.bench.workload import throughput_workload

    trace = sim.synthetic_trace(64, seed=0)
    work = throughput_workload(64, 0)
    assert len(trace) == 64 and all(t.arrival == 0 for t in trace)
    assert [(t.prompt_tokens, t.output_tokens) for t in trace] == [(len(w.prompt_token_ids), w.output_tokens)
                                                                    for w in work]
    assert all(16 <= t.prompt_tokens <= 512 and 16 <= t.output_tokens <= 256 for t in trace)


def test_uses_the_engines_scheduler_and_paged_manager(monkeypatch):
    calls = {"schedule": 0, "allocate": 0}
    real_schedule, real_allocate = Scheduler.schedule, PagedKVManager.allocate_slots

    def schedule(self):
        calls["schedule"] += 1
        return real_schedule(self)

    def allocate(self, *a, **kw):
        calls["allocate"] += 1
        return real_allocate(self, *a, **kw)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(PagedKVManager, "allocate_slots", allocate)
    res = sim.simulate(sim.synthetic_trace(4), SMOL, cfg(), COST)
    assert calls["schedule"] == res.num_steps > 0
    assert calls["allocate"] >= res.num_steps


def test_virtual_clock_arithmetic():
    # Constant 1 s steps: the prefill step yields the first token, then one token per step.
    trace = [sim.TraceRequest(0.0, 10, 5), sim.TraceRequest(100.0, 4, 3)]
    res = sim.simulate(trace, SMOL, cfg(), sim.CostModel(1.0, 0, 0, 0))
    r0, r1 = res.requests
    assert (r0.ttft, r0.tpot, r0.finish, r0.generated) == (1.0, 1.0, 5.0, 5)
    # The clock jumps to the second arrival while idle.
    assert (r1.first_token, r1.finish, r1.ttft) == (101.0, 103.0, 1.0)
    assert res.num_steps == 8 and res.makespan == 103.0
    s = sim.summarize(res)
    assert s["generated_tokens"] == 8 and s["throughput_tok_s"] == pytest.approx(8 / 103)


def test_cost_model_features():
    from kvinfer.core.request import Request
    from kvinfer.sampling_params import SamplingParams

    r = Request("a", [1] * 20, SamplingParams(max_tokens=4))
    out = SchedulerOutput([ScheduledSeq(r, 19, 1), ScheduledSeq(r, 0, 12), ScheduledSeq(r, 7, 1)])
    assert sim.CostModel.features(out) == (1.0, 14, 2, 20 + 12 + 8)
    assert sim.CostModel(1, 2, 3, 4).step_time(out) == 1 + 2 * 14 + 3 * 2 + 4 * 40


def test_small_memory_preempts_and_contiguous_rejects():
    trace = [sim.TraceRequest(0.0, 100 + 7 * i, 60) for i in range(16)]
    runs = sim.run_simulation(trace, SMOL, cfg(kv_cache_memory=16 << 20), COST)  # 45 blocks: 720 tokens
    paged, contiguous = sim.summarize(runs["paged"]), sim.summarize(runs["contiguous"])
    assert paged["completed"] == 16 and paged["preemptions"] > 0 and not paged["rejected"]
    assert paged["kv_utilisation_peak"] <= 1.0 and paged["kv_utilisation_mean"] > 0.5
    # 16 MiB is less than one 8192-token slot (180 MiB): a max-length reservation serves nobody.
    assert contiguous["completed"] == 0 and len(contiguous["rejected"]) == 16
    # With room for a few slots, contiguous runs everything but with fewer sequences at once.
    runs = sim.run_simulation(trace, SMOL, cfg(kv_cache_memory=400 << 20, max_model_len=8192), COST)
    assert runs["contiguous"].capacity.startswith("2 slots")
    assert sim.summarize(runs["contiguous"])["completed"] == 16
    assert runs["paged"].makespan < runs["contiguous"].makespan


def test_request_longer_than_context_is_rejected_not_fatal():
    trace = [sim.TraceRequest(0.0, 100, 50), sim.TraceRequest(0.0, 10, 5)]
    s = sim.summarize(sim.simulate(trace, SMOL, cfg(max_model_len=128), COST))
    assert s["completed"] == 1 and [r["index"] for r in s["rejected"]] == [0]


def test_load_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival": 0.5, "prompt_tokens": 8, "output_tokens": 4}\n\n'
                 '{"arrival": 0, "prompt_tokens": 3, "output_tokens": 1}\n')
    assert sim.load_trace(str(p)) == [sim.TraceRequest(0.5, 8, 4), sim.TraceRequest(0.0, 3, 1)]
    p.write_text('{"arrival": 0, "prompt_tokens": 8, "output_tokens": 4}\n{"prompt_tokens": 0, "output_tokens": 1}\n')
    with pytest.raises(ValidationError, match=r"t.jsonl:2.*prompt_tokens"):
        sim.load_trace(str(p))


def test_parse_cost_model_and_scaling():
    assert sim.parse_cost_model("fitted") is sim.FITTED
    assert sim.parse_cost_model("0.01,0.002").coefficients == (0.01, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert sim.parse_cost_model("1,2,3,4,5,6,7").coefficients == (1, 2, 3, 4, 5, 6, 7)
    for bad in ("x", "1,2,3,4,5,6,7,8", "-1", "0,0", "0,0,0,0,1"):
        with pytest.raises(ValidationError, match="cost_model"):
            sim.parse_cost_model(bad)
    big = sim.FITTED.scaled_to(preset_config("llama-2-7b"))
    assert big.a == sim.FITTED.a and big.b > 10 * sim.FITTED.b and "scaled" in big.source
    assert sim.FITTED.scaled_to(SMOL) is sim.FITTED


def test_fitted_defaults_are_recorded():
    f = sim.FITTED
    assert all(c >= 0 for c in f.coefficients) and f.a > 0 and f.b > 0
    assert re.search(r"\d{4}-\d{2}-\d{2}", f.source) and "CPU" in f.source


def test_nonneg_lstsq_recovers_coefficients():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(40), rng.integers(1, 500, 40), rng.integers(0, 30, 40), rng.integers(1, 5000, 40)])
    true = np.array([0.02, 3e-4, 0.0, 2e-6])
    y = x @ true
    assert np.allclose(sim._nonneg_lstsq(x, y, 1 / y), true, atol=1e-9)


def _synthetic_samples(planned, fused, rng, noise=0.0):
    """Step timings made from known coefficients, shaped as calibrate() records them."""
    a, b, c, d = planned
    e, f, g = fused
    out = []
    for n, dec, ctx in [(64, 0, 64), (2048, 0, 2048), (512, 0, 512), (1024, 0, 1024), (1, 1, 70), (4, 4, 2060),
                        (32, 32, 540), (16, 16, 1100), (2048, 7, 4096), (300, 12, 5000), (8, 8, 300)]:
        t = a + b * n + c * dec + d * ctx
        out.append(dict(kind="planned", seconds=t * (1 + noise * rng.standard_normal()), steps=1,
                        num_batched_tokens=n, num_decode_seqs=dec, sum_context_tokens=ctx))
    for batch, ctx in [(1, 70), (1, 600), (4, 2070), (4, 300), (16, 1100), (32, 560), (32, 900), (64, 20000),
                       (8, 4000)]:
        t = e + f * batch + g * ctx
        out.append(dict(kind="fused", seconds=t * (1 + noise * rng.standard_normal()), steps=8,
                        num_batched_tokens=batch, num_decode_seqs=batch, sum_context_tokens=ctx))
    return out


def test_calibration_fit_recovers_known_coefficients():
    rng = np.random.default_rng(1)
    planned, fused = (0.004, 5e-4, 2e-4, 1e-6), (0.003, 3e-4, 8e-7)
    a, f, keep = sim.fit_samples(_synthetic_samples(planned, fused, rng))
    assert np.allclose(a, planned, rtol=1e-6) and np.allclose(f, fused, rtol=1e-6) and all(keep)
    # A step that another process stalled 10x is dropped, and the rest still give the coefficients.
    samples = _synthetic_samples(planned, fused, rng)
    samples[1]["seconds"] *= 10
    samples[-2]["seconds"] *= 10
    a, f, keep = sim.fit_samples(samples)
    assert not keep[1] and not keep[-2] and sum(keep) == len(samples) - 2
    assert np.allclose(a, planned, rtol=1e-6) and np.allclose(f, fused, rtol=1e-6)
    # Noisy timings (5%): close to the truth where the coefficient carries the cost.
    a, f, _ = sim.fit_samples(_synthetic_samples(planned, fused, rng, noise=0.05))
    assert a[1] == pytest.approx(planned[1], rel=0.15) and f[1] == pytest.approx(fused[1], rel=0.25)


def test_fused_decode_steps_cost_their_own_coefficients():
    # 2 requests, prompt 10, 20 new tokens, 8 steps per fused call: the prefill step (the first token), then
    # fused calls of 8, 8 and 3 steps; a planned step costs 1 s, a fused one 0.1 s.
    trace = [sim.TraceRequest(0.0, 10, 20), sim.TraceRequest(0.0, 10, 20)]
    cost = sim.CostModel(1.0, 0, 0, 0, 0.1, 0, 0)
    res = sim.simulate(trace, SMOL, cfg(), cost)
    assert res.num_steps == 20 and res.makespan == pytest.approx(1 + 19 * 0.1)
    # One step per call: every step is planned; without fused coefficients a fused step costs a planned one.
    assert sim.simulate(trace, SMOL, cfg(num_scheduler_steps=1), cost).makespan == pytest.approx(20.0)
    assert sim.simulate(trace, SMOL, cfg(), sim.CostModel(1.0, 0, 0, 0)).makespan == pytest.approx(20.0)
    # A request arriving during a fused call waits for its end, as in the engine (it would not be admitted).
    late = trace + [sim.TraceRequest(1.05, 4, 2)]
    r = sim.simulate(late, SMOL, cfg(), cost).requests[2]
    assert r.first_token == pytest.approx(1.0 + 8 * 0.1 + 1.0)


def test_fit_on_a_tiny_model(tmp_path):
    from kvinfer.config import EngineConfig

    shape = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=300)
    (tmp_path / "config.json").write_text(json.dumps(shape))
    model, samples = sim.fit_cost_model(EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float32"),
                                        clock="cpu")
    assert len(samples) > 20 and all(c >= 0 for c in model.coefficients) and model.a + model.b > 0
    assert "cpu clock" in model.source and model.fitted_parameters > 0


def test_cli_json(capsys):
    rc = main(["simulate", "--model", "smollm2-135m", "--synthetic", "8", "--seed", "2", "--dtype", "bfloat16",
               "--kv-cache-memory", "32MiB", "--cost-model", "0.01,0.0001", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    paged = r["results"]["paged"]
    assert paged["completed"] == 8 and set(paged["ttft_s"]) == {"p50", "p90", "p99"}
    assert r["results"]["contiguous"]["rejected"]


def test_cli_trace_and_plot(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(dict(arrival=i * 0.1, prompt_tokens=20 + i, output_tokens=5)) for i in range(6)))
    rc = main(["simulate", "--model", "smollm2-135m", "--trace", str(p), "--cost-model", "0.01",
               "--out", str(tmp_path / "o")])
    assert rc == 0
    assert "throughput" in capsys.readouterr().out
    assert (tmp_path / "o" / "simulate_kv_use.png").is_file()


@pytest.mark.parametrize("argv, word", [
    (["--cost-model", "a,b"], "cost_model"),
    (["--kv-cache-memory", "lots"], "kv_cache_memory"),
    (["--trace", "/nonexistent/trace.jsonl"], "trace"),
])
def test_cli_bad_values_are_one_line(capsys, argv, word):
    rc = main(["simulate", "--model", "smollm2-135m"] + argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and word in err and "Traceback" not in err


def test_cli_bench_prints_both_figures_and_the_error(tmp_path, capsys):
    shape = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(shape))
    argv = ["simulate", "--model", str(model), "--synthetic", "6", "--seed", "3", "--kv-cache-memory", "8MiB",
            "--bench", "--no-compare", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    measured = re.search(r"measured\s+([\d.]+) gen tok/s", out)
    simulated = re.search(r"simulated\s+([\d.]+) gen tok/s", out)
    error = re.search(r"error\s+([+-][\d.]+)%", out)
    assert measured and simulated and error, out
    m, s_, e = float(measured.group(1)), float(simulated.group(1)), float(error.group(1))
    assert m > 0 and s_ > 0 and e == pytest.approx((s_ / m - 1) * 100, abs=0.1 + 0.002 * abs(e))
    blocks = re.search(r"KV blocks\s+(\d+) engine, (\d+) simulated \(same\)", out)
    assert blocks and blocks.group(1) == blocks.group(2), out
    assert re.search(r"stalled\s+\d+ of \d+ measured steps", out) and "fitted on the measured run's own steps" in out
    assert main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    b = r["bench"]
    assert b["requests"] == 6 and b["workload_seed"] == 3 and b["engine_blocks"] == b["simulated_blocks"]
    assert b["error"] == pytest.approx(b["predicted_tok_s"] / b["measured_tok_s"] - 1)
    assert b["planned_steps"] == b["simulated_planned_steps"] and b["fused_steps"] == b["simulated_fused_steps"]
    assert 0 <= b["stalled_s"] <= b["seconds"] and b["own_error"] is not None
    assert r["cost_model"]["source"].startswith("fitted") and r["fit_samples"]
    # The simulated workload is the measured one: the same requests, so the same generated token count.
    assert r["results"]["paged"]["generated_tokens"] == b["generated_tokens"]


@pytest.mark.parametrize("argv, word", [
    (["--bench", "--trace", "x.jsonl"], "trace"),
    (["--bench", "--tp", "3"], "tensor_parallel_size"),
    (["--fit", "--cost-model", "0.01"], "cost_model"),
])
def test_cli_bench_and_fit_conflicts_are_one_line(capsys, argv, word):
    rc = main(["simulate", "--model", "smollm2-135m"] + argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and word in err and "Traceback" not in err
