"""The first hour (issue 46): defaults that answer well, a CLI llama.cpp users already know."""
import io
import json
import shlex
import sys

import pytest

from kvinfer.cli import build_parser, main
from kvinfer.engine.generation_defaults import generation_defaults


@pytest.fixture(scope="module")
def llm():
    from kvinfer import LLM

    return LLM(kv_cache_memory="64MiB", max_model_len=1024)


def test_chat_defaults_answer_to_the_end(llm):
    # Before: SamplingParams() (max_tokens 16, temperature 1.0) cut the README's example off by length.
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    c = out.outputs[0]
    assert c.finish_reason == "stop", c.text
    assert "Paris" in c.text
    assert len(c.token_ids) > 0


def test_generation_config_supplies_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                  "do_sample": True, "eos_token_id": 2}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(str(tmp_path / "model.gguf")) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_defaults(str(tmp_path)) == {}
    assert generation_defaults(None) == {"temperature": 0.0}  # the built-in model's


def test_server_chat_body_defaults_come_from_the_model():
    from kvinfer.server.app import _sampling_params
    from kvinfer.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = _sampling_params(body, None, None, {"temperature": 0.6, "top_k": 20})
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 1.0, None)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.9, top_k=5)
    p = _sampling_params(body, None, None, {"temperature": 0.6, "top_k": 20})
    assert (p.temperature, p.top_k) == (0.9, 5)


def _generate_args(*argv):
    return build_parser().parse_args(["generate", *argv])


def test_generate_reads_the_prompt_from_stdin_dash_and_file(tmp_path):
    from kvinfer.cli import DEFAULT_PROMPT, read_prompt
    from kvinfer.errors import ValidationError

    assert read_prompt(_generate_args(), io.StringIO("piped question\n")) == "piped question"
    assert read_prompt(_generate_args("-"), io.StringIO("dash question\n")) == "dash question"
    assert read_prompt(_generate_args(), io.StringIO("")) == DEFAULT_PROMPT  # nothing piped in
    f = tmp_path / "p.txt"
    f.write_text("from a file")
    assert read_prompt(_generate_args("--file", str(f)), io.StringIO("")) == "from a file"
    assert read_prompt(_generate_args("-p", "short flag"), io.StringIO("ignored")) == "short flag"
    with pytest.raises(ValidationError, match="stdin held no prompt"):
        read_prompt(_generate_args("-"), io.StringIO(""))
    with pytest.raises(ValidationError, match="not several"):
        read_prompt(_generate_args("a", "-p", "b"), io.StringIO(""))
    with pytest.raises(ValidationError, match="cannot read"):
        read_prompt(_generate_args("-f", str(tmp_path / "missing.txt")), io.StringIO(""))


def test_generate_end_to_end_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("The capital of France is"))
    assert main(["generate", "--raw", "-n", "3", "--kv-cache-memory", "32MiB", "-c", "256"]) == 0
    out = capsys.readouterr()
    assert "prompt tokens 5 " in out.err or "prompt tokens 6 " in out.err, out.err  # the piped prompt, not the default
    assert "generated 3 (length)" in out.err


def test_llama_cpp_short_flags():
    a = _generate_args("-m", "x.gguf", "-p", "hi", "-n", "7", "-c", "512", "-t", "2", "-s", "9")
    assert (a.model, a.prompt_opt, a.max_tokens, a.max_model_len, a.threads, a.seed) == ("x.gguf", "hi", 7, 512, 2,
                                                                                          9)
    for cmd in (["serve"], ["bench", "throughput"], ["perplexity", "f.txt"], ["chat"]):
        a = build_parser().parse_args(cmd + ["-m", "x.gguf", "-c", "512", "-t", "2", "-s", "9"])
        assert (a.model, a.max_model_len, a.threads, a.seed) == ("x.gguf", 512, 2, 9)


def test_every_help_ends_with_examples():
    import argparse

    def walk(p):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    yield from walk(sp)

    for p in walk(build_parser()):
        tail = p.format_help().rstrip("\n").split("examples:\n")
        assert len(tail) == 2, p.prog
        lines = tail[1].splitlines()
        assert 2 <= len(lines) <= 3 and all("kvinfer" in line for line in lines), (p.prog, lines)
        for line in lines:  # each example is a command line the parser takes (required flags given)
            words = shlex.split(next(c for c in line.split(" | ") if "kvinfer" in c))  # echo .. | kvinfer .. | grep
            argv = words[words.index("kvinfer") + 1:]
            assert "_help_prog" not in vars(build_parser().parse_args(argv)), line


def test_an_unknown_flag_points_to_its_commands_help(capsys):
    for argv, prog in ((["generate", "hi", "--fast"], "kvinfer generate"),
                       (["bench", "decode", "--fast"], "kvinfer bench decode"), (["--fast"], "kvinfer")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err == f"kvinfer: error: unrecognized arguments: --fast (see {prog} --help)\n"


def test_bench_default_peers_are_the_installed_ones(monkeypatch, capsys):
    import importlib.util

    from kvinfer.bench import cli as bench_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("transformers", "llama_cpp") else real(name, *a))
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    args = build_parser().parse_args(["bench", "decode"])
    assert args.compare is None
    assert bench_cli._default_peers(args, None) == []  # before: ["transformers"], whether installed or not
    err = capsys.readouterr().err
    assert "transformers is not installed: pip install 'kvinfer[bench]'" in err
    assert "llama.cpp is not installed: pip install llama-cpp-python" in err
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    if real("transformers") is not None:
        assert bench_cli._default_peers(args, None) == ["transformers"]
    args = build_parser().parse_args(["bench", "decode", "--compare", "llama.cpp"])
    assert bench_cli._default_peers(args, None) == ["llama.cpp"]  # asked for: kept, and it says so when it runs


def test_threads_over_the_core_count_say_what_runs(caplog):
    import os

    from kvinfer.engine.startup import usable_threads

    cores = len(os.sched_getaffinity(0))
    with caplog.at_level("WARNING", logger="kvinfer"):
        assert usable_threads(1000) == cores
    assert f"--threads 1000 is more than the {cores} core" in caplog.text and f"running {cores}" in caplog.text
    caplog.clear()
    assert usable_threads(1) == 1 and not caplog.text


def test_kv_cache_fraction_is_a_share_of_what_is_left_after_the_weights(caplog):
    import psutil

    from kvinfer.config import EngineConfig
    from kvinfer.engine.startup import check_startup, kv_budget

    cfg = EngineConfig(kv_cache_fraction=0.99, max_model_len=256)
    avail = psutil.virtual_memory().available
    weights = 4 << 30
    # before: 0.99 of all the memory available, as if the weights took none of it
    assert kv_budget(cfg, weights) <= 0.99 * (avail - weights) + (64 << 20)
    with caplog.at_level("WARNING", logger="kvinfer"):
        check_startup(cfg)
    assert "--kv-cache-fraction 0.99: a KV cache of" in caplog.text and "once the weights" in caplog.text


def _start(argv, **kw):
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.getcwd(), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-c", "from kvinfer.cli import run; run()", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.parametrize("sig,code", [("SIGTERM", 0), ("SIGINT", 130)])
def test_generate_stops_on_a_signal_without_a_traceback(sig, code):
    import signal

    p = _start(["generate", "--raw", "-n", "4000", "--ignore-eos", "-c", "8192", "--kv-cache-memory", "256MiB",
                "--num-scheduler-steps", "1", "Once upon a time"], stdin=-3)
    assert p.stdout.read(1)  # the answer has started
    p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    assert b"Traceback" not in err
    assert (b"terminated" if sig == "SIGTERM" else b"interrupted") in err


def test_chat_ctrl_c_stops_the_answer_then_sigterm_ends_the_chat():
    import signal
    import subprocess
    import time

    p = _start(["chat", "-n", "4000", "--ignore-eos", "-c", "8192", "--kv-cache-memory", "256MiB",
                "--num-scheduler-steps", "1"], stdin=subprocess.PIPE)
    p.stdin.write(b"Tell me a long story.\n")
    p.stdin.flush()
    assert p.stdout.read(1)
    p.send_signal(signal.SIGINT)
    deadline = time.time() + 60
    p.stdin.write(b"/help\n")  # the chat goes on: its help line comes back
    p.stdin.flush()
    time.sleep(2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=max(1, deadline - time.time()))
    assert p.returncode == 0, err
    assert b"Traceback" not in err
    assert b"(answer stopped)" in err and b"/reset clears" in err


def test_simulate_pool_has_the_engines_block_count(capsys):
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.config import EngineConfig

    engine = LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=1024))
    blocks = engine.kv_manager.num_total_blocks
    # before: simulate sized the pool in float32 K/V, half the engine's bfloat16 blocks for the built-in model
    assert main(["simulate", "--synthetic", "4", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                 "--no-compare", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results"]["paged"]["capacity"].startswith(f"{blocks} blocks of 16 tokens"), (blocks, report)
