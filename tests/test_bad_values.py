"""Every bad value is one clear line: a table over every flag of every command, start-up memory and context
checks, the server's field checks, logit_bias, and chat driven through a pseudo-terminal."""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvinfer.cli import build_parser, main
from kvinfer.config import EngineConfig
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.errors import ModelLoadError, ValidationError

HUGE = "99999999999999999999"
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")  # an existing file

# Flags shared by every command that builds an engine; checked once, on `generate`.
ENGINE = {
    "--model": ["/no/such/model"],
    "--load-format": ["pickle"],
    "--tokenizer": ["/no/such/tokenizer"],
    "--chat-template": ["no-such-template.jinja", "{% if %}"],
    "--dtype": ["int3"],
    "--quantization": ["awq"],
    "--device": ["tpu"],
    "--kv-cache": ["huge"],
    "--kv-cache-dtype": ["int4"],
    "--activation-bits": ["4", "eight"],
    "--kv-cache-memory": ["-5GiB", "0", "lots", "nan", "1TiB", HUGE],
    "--kv-cache-fraction": ["-0.5", "1.5", "nan", "half"],
    "--block-size": ["0", "2000", "abc"],
    "--max-model-len": ["0", "100000", HUGE, "nan"],
    "--max-num-seqs": ["0", "-1", HUGE],
    "--max-num-batched-tokens": ["0", HUGE],
    "--num-scheduler-steps": ["0", "65", "x"],
    "--threads": ["0", HUGE, "1.5"],
    "--seed": ["-1", HUGE, "abc"],
    "--tensor-parallel-size": ["0", "abc"],
    "--nnodes": ["0", "3"],
    "--node-rank": ["-1", "5"],
    "--master-port": ["0", "70000"],
    "--speculative": ["beam"],
    "--speculative-model": ["/no/such/model"],
    "--num-speculative-tokens": ["0", "17"],
    "--ngram-min": ["0"],
    "--ngram-max": ["0", "100"],
    "--kv-offload-memory": ["lots", "-1GiB", "0"],
    "--kv-cache-dir": [README, "/proc/nope"],
    "--kv-cache-dir-size": ["lots", "0"],
    "--kv-cache-redis": ["http://x"],
}
SAMPLING = {
    "--max-tokens": ["0", "-1", HUGE, "nan"],
    "--temperature": ["-1", "nan", "inf", "hot"],
    "--top-p": ["0", "1.5", "nan"],
    "--top-k": ["-5", HUGE],
    "--min-p": ["-0.1", "2", "nan"],
    "--repetition-penalty": ["0", "-1", "nan"],
    "--sampling-seed": ["-1", HUGE],
}
# Per command: its own flags (the engine and sampling ones are covered above).
OWN = {
    "": {"--log-level": ["loud"]},
    "generate": {**ENGINE, **SAMPLING, "--file": ["/no/such/file"]},
    "serve": {"--host": ["999.1.1.1"], "--port": ["-1", "70000", "abc"], "--max-queue": ["-1", HUGE],
              "--max-body-bytes": ["0", "lots"], "--shutdown-timeout": ["-1", "nan", "abc"],
              "--responses-store-size": ["0", "lots"], "--allowed-hosts": ["http://evil.example/", "a b"],
              "--pooling": ["max"], "--reasoning-parser": ["o1"]},
    "bench decode": {"--tokens": ["1", HUGE], "--prompt-tokens": ["0"], "--compare": ["vllm", "llama-server"],
                     "--rounds": ["0", "x"]},
    "bench throughput": {"--num-requests": ["0"], "--workload-seed": ["-1", HUGE], "--compare": ["vllm"],
                         "--llama-server-slots": ["0"],
                         "--hf-batch-size": ["0"]},
    "bench structured": {"--requests": ["0"], "--tokens": ["1", "nan"], "--rounds": ["0"]},
    "bench spec": {"--prompts": ["0", "9"], "--throughput-requests": ["-1"], "--rounds": ["0", "51"]},
    "bench prefix-cache": {"--prefixes": ["0"], "--prefix-tokens": ["0"], "--suffix-tokens": ["0"], "--rounds": ["0"],
                           "--long-prefix": ["-1"], "--redis": ["http://x"], "--workload-seed": ["-1"]},
    "bench exact": {"--prompts": ["1", HUGE], "--tokens": ["0", "nan"]},
    "bench kv-attention": {"--context": ["15", HUGE], "--calls": ["0"], "--rounds": ["0", "nan"], "--threads": ["0"]},
    "bench serve": {"--num-requests": ["0"], "--workload-seed": [HUGE], "--max-concurrency": ["0"],
                    "--rounds": ["0", "nan"], "--workload": ["chat"], "--inputs-per-request": ["0"]},
    "perplexity": {"--context": ["3", HUGE, "x"], "--chunks": ["0", "nan"]},
    "lab kvcache": {"--tokens": ["0", HUGE], "--prompt-tokens": ["0"], "--backends": ["fast", ","],
                    "--out": [README, "/proc/nope"]},
    "plan": {"--model": ["/no/such/model"], "--kv-offload-memory": ["lots"], "--kv-cache-dir-size": ["lots"], "--memory": ["-5GiB", "0", "lots", "nan"],
             "--max-model-len": ["0", HUGE], "--dtype": ["int3"], "--block-size": ["0"], "--tp": ["0"],
             "--tensor-parallel-size": ["0"], "--kv-cache-dtype": ["int4"],
             "--workload": ["gaussian"], "--concurrent": ["0"]},
    "simulate": {"--trace": ["/no/such/trace.jsonl", README], "--synthetic": ["0"], "--seed": ["-1", HUGE],
                 "--model": ["/no/such/model"], "--dtype": ["int3"], "--kv-cache-memory": ["0", "lots"],
                 "--block-size": ["0"], "--max-model-len": ["0"], "--max-num-seqs": ["0"],
                 "--max-num-batched-tokens": ["0"], "--cost-model": ["cheap", "nan,1", "0"], "--threads": ["0", HUGE],
                 "--fit-clock": ["sundial"], "--out": [README, "/proc/nope"], "--tp": ["0"],
                 "--tensor-parallel-size": ["0"], "--tp-latency": ["-1", "nan", "fast"],
                 "--tp-bandwidth": ["0", "-2", "inf"], "--num-scheduler-steps": ["0", "65"]},
}
# Free text: no value is bad. (Engine and sampling flags of other commands are the shared ones above.)
FREE_TEXT = {"--prompt", "--system", "--stop", "--api-key", "--served-model-name", "--master-addr",
             # A missing peer binary is one line and a skipped peer, by design (test_bench): ours still runs.
             "--llama-server", "--llama-bench"}
NEEDS_ARGS = {"plan": ["--memory", "40GiB"], "perplexity": [README]}  # what a command requires, so the flag
# under test is what fails


def _value_flags(parser):
    """(command, flag) for every option that takes a value, in every subcommand."""
    def walk(p, name):
        for a in p._actions:
            if a.__class__.__name__ == "_SubParsersAction":
                for sub, sp in a.choices.items():
                    yield from walk(sp, f"{name} {sub}".strip())
            elif a.option_strings and a.nargs != 0 and a.dest != "help":
                yield name, a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
    yield from walk(parser, "")


def test_the_table_covers_every_flag():
    shared = set(ENGINE) | set(SAMPLING)
    missing = [(cmd, flag) for cmd, flag in _value_flags(build_parser())
               if flag not in OWN.get(cmd, {}) and flag not in shared and flag not in FREE_TEXT]
    assert not missing, f"flags without bad values in the table: {missing}"


CASES = [(cmd, flag, v) for cmd, flags in OWN.items() for flag, values in flags.items() for v in values]


def _run(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err.strip()


def _argv(cmd, flag, value):
    if cmd == "":
        return [f"{flag}={value}", "models"]
    words = cmd.split()
    head = words + (["hi"] if cmd == "generate" and flag != "--file" else [])
    return head + NEEDS_ARGS.get(cmd, []) + [f"{flag}={value}"]


@pytest.mark.parametrize("cmd,flag,value", CASES, ids=[f"{c or 'kvinfer'} {f}={v}" for c, f, v in CASES])
def test_bad_value_is_one_line(capsys, cmd, flag, value):
    code, err = _run(capsys, _argv(cmd, flag, value))
    assert code not in (0, None), err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    # The line names the flag (argparse) or its parameter (our checks), and says what is wrong only once.
    names = (flag, flag.lstrip("-").replace("-", "_"))
    assert any(n in err for n in names), err
    assert err.count(flag) <= 1, err


def test_cuda_without_a_gpu_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, err = _run(capsys, ["generate", "hi", "--device", "cuda"])
    assert code == 1 and len(err.splitlines()) == 1 and "CUDA is not available" in err, err


def test_flag_is_not_repeated_and_negative_sizes_are_values(capsys):
    code, err = _run(capsys, ["bench", "decode", "--tokens", "1"])
    assert err.count("--tokens") == 1 and "must be >= 2" in err, err
    code, err = _run(capsys, ["plan", "--memory", "-5GiB"])
    assert code == 1 and "must be > 0" in err and "expected one argument" not in err, err


# ---- start-up: refuse before allocating ---------------------------------------------------------------------
def _no_allocation(monkeypatch):
    from kvinfer.engine import startup

    def boom(*a, **k):
        raise AssertionError("allocated after all")

    for name in ("load_model", "make_kv"):
        monkeypatch.setattr(startup, name, boom)
    return startup


def test_engine_config_takes_sizes_as_the_command_line_does():
    assert EngineConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 << 20
    assert EngineConfig(kv_cache_memory=1 << 20).kv_cache_memory == 1 << 20
    with pytest.raises(ValidationError, match="kv_cache_memory='12XB'"):
        EngineConfig(kv_cache_memory="12XB")
    with pytest.raises(ValidationError, match="must be > 0"):
        EngineConfig(kv_cache_memory="0MiB")


@pytest.mark.parametrize("kw,msg", [(dict(block_size="16"), "block_size='16': must be an integer"),
                                    (dict(max_model_len=1.5), "max_model_len=1.5: must be an integer or None"),
                                    (dict(kv_cache_fraction="0.5"), "kv_cache_fraction='0.5': must be a number"),
                                    (dict(enable_prefix_caching=1), "must be True or False"),
                                    (dict(seed=True), "seed=True: must be an integer"),
                                    (dict(model=3), "model=3: must be a string or None")])
def test_engine_config_values_of_the_wrong_type_name_the_setting(kw, msg):
    with pytest.raises(ValidationError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kw)


def test_engine_config_takes_paths_and_numpy_numbers():
    from pathlib import Path

    import numpy as np

    cfg = EngineConfig(model=Path("/tmp/m.gguf"), max_num_seqs=np.int64(4), kv_cache_fraction=np.float32(0.5))
    assert cfg.model == "/tmp/m.gguf" and cfg.max_num_seqs == 4


def test_kv_budget_above_available_memory_is_refused_before_allocating(monkeypatch):
    startup = _no_allocation(monkeypatch)
    monkeypatch.setattr(startup, "available_memory", lambda device: 3 << 30)
    with pytest.raises(ValidationError) as e:
        LLMEngine(EngineConfig(kv_cache_memory=4 << 30))
    msg = str(e.value)
    assert e.value.param == "kv_cache_memory" and "4.00 GiB" in msg and "3.00 GiB" in msg, msg
    # Contiguous: the slots the budget buys, capped by max_num_seqs, are what is checked.
    with pytest.raises(ValidationError):
        LLMEngine(EngineConfig(kv_cache="contiguous", kv_cache_memory=8 << 30))
    with pytest.raises(AssertionError, match="allocated"):  # within the memory it goes on to load
        LLMEngine(EngineConfig(kv_cache="contiguous", kv_cache_memory=8 << 30, max_num_seqs=1))


def test_weights_above_available_memory_and_wrong_quantization_are_refused_before_loading(monkeypatch):
    startup = _no_allocation(monkeypatch)
    monkeypatch.setattr(startup, "available_memory", lambda device: 8 << 30)
    with pytest.raises(ModelLoadError, match=r"weights of llama-2-7b need about 25\.\d\d GiB.*8\.00 GiB"):
        LLMEngine(EngineConfig(model="llama-2-7b", load_format="dummy", dtype="float32"))
    with pytest.raises(ValidationError, match="needs a GGUF model"):
        LLMEngine(EngineConfig(model="llama-2-7b", load_format="dummy", quantization="gguf"))


def test_max_model_len_beyond_the_positions_is_refused_before_loading(monkeypatch):
    _no_allocation(monkeypatch)
    with pytest.raises(ValidationError, match="must be <= 8192"):
        LLMEngine(EngineConfig(max_model_len=100000))


def test_port_in_use_is_one_line_without_serving_banner():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvinfer.cli", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and f"127.0.0.1:{port}" in r.stderr, r.stderr
    assert "serving" not in r.stderr


# ---- generation: max_tokens that fits, no half characters ---------------------------------------------------
def test_default_max_tokens_shrinks_to_what_fits(capsys):
    # Short prompts in a tiny window: the point is the arithmetic, not the model's speed.
    code = main(["generate", "Hi there", "--raw", "--max-model-len", "8", "--ignore-eos"])
    err = capsys.readouterr().err
    assert code == 0, err
    prompt = int(err.split("prompt tokens ")[1].split()[0])
    assert f"generated {8 - prompt} (length)" in err, err
    code, err = _run(capsys, ["generate", "Hi there", "--raw", "--max-model-len", "8", "--max-tokens", "20"])
    assert code == 1 and "max_tokens (20)" in err, err  # an explicit value is not changed behind your back


def test_no_cache_summary_does_not_claim_a_reserve():
    from types import SimpleNamespace

    from kvinfer.cli import _kv_summary

    line = _kv_summary(SimpleNamespace(kv_manager=SimpleNamespace(keeps_kv=False)), 100)
    assert "no KV cache" in line and "reserved" not in line  # was "765 KiB of 0 B reserved"


# ---- the server's fields ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    from server_helpers import engine_config, start_server

    s = start_server(engine_config(max_num_seqs=4))
    with httpx.Client(base_url=s.url, timeout=120) as c:
        c.vocab = s.engine.engine.model_config.vocab_size
        yield c
    s.stop()


def _error(r, status, param=None, needle=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    if param is not None:
        assert e["param"] == param, e
    if needle is not None:
        assert needle in e["message"], e
    return e


def test_logit_bias_steers_greedy_decoding(client):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    target = client.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    biased = client.post("/v1/completions", json={**body, "logit_bias": {str(target): 100}}).json()
    assert biased["choices"][0]["text"] == client.post("/detokenize", json={"tokens": [target] * 4}).json()["prompt"]
    assert biased["choices"][0]["text"] != plain
    for bad, needle in (({"abc": 1}, "token ids"), ({str(client.vocab): 1}, "outside the vocabulary"),
                        ({"5": 101}, "[-100, 100]")):
        _error(client.post("/v1/completions", json={**body, "logit_bias": bad}), 400, "logit_bias", needle)


def test_logit_bias_in_the_sampler():
    import torch

    from kvinfer.core.sampler import SampleRow, Sampler
    from kvinfer.sampling_params import SamplingParams

    logits = torch.tensor([[1.0, 3.0, 2.0]])

    def pick(**kw):
        return Sampler().sample(logits.clone(), [SampleRow(SamplingParams(**kw), [0], [], None)]).token_ids[0]

    assert pick(temperature=0) == 1
    assert pick(temperature=0, logit_bias={1: -100}) == 2
    assert pick(temperature=0, logit_bias={0: 2.5}) == 0
    g = torch.Generator().manual_seed(0)
    row = SampleRow(SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100}), [0], [], g)
    assert {Sampler().sample(logits.clone(), [row]).token_ids[0] for _ in range(20)} == {2}
    for bad in ({-1: 1.0}, {0: float("nan")}, {0: 100.5}, {"a": 1.0}):
        with pytest.raises(ValidationError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_messages_prompts_and_images(client):
    url = "/v1/chat/completions"
    _error(client.post(url, json={"messages": [{"role": "user"}]}), 400, "messages[0]", "needs content")
    _error(client.post(url, json={"messages": [{"role": "user", "content": None}]}), 400, "messages[0]")
    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    e = _error(client.post(url, json={"messages": [{"role": "user", "content": image}]}), 400,
               "messages[0].content", "images are not supported")
    assert "Input should" not in e["message"]
    _error(client.post(url, json={"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}), 400,
           "messages[0].content", "'input_audio' are not supported")
    e = _error(client.post("/v1/completions", json={"prompt": "", "max_tokens": 2}), 400, "prompt", "empty")
    assert e["code"] != "context_length_exceeded"
    ok = client.post(url, json={"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# ---- chat through a pseudo-terminal ---------------------------------------------------------------------------
class _Pty:
    def __init__(self, argv):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so Ctrl-C is a real SIGINT
            os.execv(sys.executable, [sys.executable, "-m", "kvinfer.cli"] + argv)
        self.out = ""
        self.exited = False

    def _read(self, timeout: float) -> bool:
        if not select.select([self.fd], [], [], timeout)[0]:
            return True
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # the child closed the terminal
            chunk = b""
        self.out += chunk.decode("utf-8", "replace")
        return bool(chunk)

    def expect(self, needle: str, after: int = 0, timeout: float = 120.0, more: int = 0) -> int:
        """Wait for `needle` (and then `more` characters) after offset `after`; returns the offset past it."""
        deadline = time.monotonic() + timeout
        while needle not in self.out[after:] or len(self.out) < after + self.out[after:].index(needle) + more:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(max(left, 0), 1.0)):
                raise AssertionError(f"{needle!r} not seen; output so far:\n{self.out}")
        return after + self.out[after:].index(needle) + len(needle)

    def send(self, text: str) -> int:
        mark = len(self.out)
        os.write(self.fd, text.encode())
        return mark

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exited = True
                return os.waitstatus_to_exitcode(status)
            self._read(0.2)
        raise AssertionError("chat did not exit")

    def close(self) -> None:
        if not self.exited:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_chat_in_a_terminal_ctrl_c_overflow_and_commands():
    p = _Pty(["chat", "--max-model-len", "160", "--max-tokens", "100", "--temperature", "0", "--ignore-eos"])
    try:
        at = p.expect(">>> ", timeout=180)
        at = p.expect("unknown command /bogus", after=p.send("/bogus\n"))
        at = p.expect("/reset clears", after=p.send("/help\n"))
        at = p.expect(">>> ", after=at)
        # Ctrl-C once the answer is streaming stops the answer, not the session.
        at = p.expect("dragon.\r\n", after=p.send("Tell me a long story about a dragon.\n"))
        p.expect("", after=at, more=3)
        p.send("\x03")
        at = p.expect(">>> ", after=p.expect("(answer stopped)", after=at))
        # The next turn does not fit beside the first: the oldest turns go, and it says so.
        at = p.expect("were dropped", after=p.send("Now tell me another long story, about a cat who sails.\n"))
        at = p.expect("starts over)\r\n", after=at)
        p.expect("", after=at, more=3)
        p.send("\x03")
        at = p.expect(">>> ", after=p.expect("(answer stopped)", after=at))
        # A single message longer than the window is refused, and the session goes on.
        at = p.expect("send something shorter", after=p.send("word " * 200 + "\n"))
        at = p.expect("(conversation cleared)", after=p.send("/reset\n"))
        p.send("/exit\n")
        assert p.wait() == 0, p.out
        assert "Traceback" not in p.out and "kvinfer: error" not in p.out, p.out
    finally:
        p.close()
