"""The simulator: the engine's own scheduler on a virtual clock, deterministic, with exact clock arithmetic."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvinfer.cli import main
from kvinfer.config import preset_config
from kvinfer.errors import ValidationError
from kvinfer.kv.manager import PagedKVManager
from kvinfer.lab import simulate as sim
from kvinfer.scheduler import Scheduler, ScheduledSeq, SchedulerOutput

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
    from kvinfer.request import Request
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
    assert sim.parse_cost_model("0.01,0.002").coefficients == (0.01, 0.002, 0.0, 0.0)
    for bad in ("x", "1,2,3,4,5", "-1", "0,0"):
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
