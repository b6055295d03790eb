"""The command line as a user meets it: answers, --help everywhere, one-line errors with non-zero exits."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvinfer.cli import build_parser, main
from tests.gguf_helpers import tiny_llama, write_gguf  # noqa: F401  (fixture reused)

KVINFER = [sys.executable, "-m", "kvinfer.cli"]


def test_generate_answers_paris_on_the_builtin_model():
    r = subprocess.run(KVINFER + ["generate", "What is the capital of France?", "--max-tokens", "32"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    stats = r.stderr.strip().splitlines()[-1]
    for field in ("prompt tokens", "generated", "TTFT", "tok/s", "KV cache in use"):
        assert field in stats, stats
    assert "Traceback" not in r.stderr


def _subcommands(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subcommands(sub):
                    yield f"{name} {inner}", subsub


def test_every_subcommand_has_help(capsys):
    names = [n for n, _ in _subcommands(build_parser())]
    assert {"generate", "chat", "models", "bench decode", "bench throughput"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as e:
            main(name.split() + ["--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "usage: kvinfer" in out and len(out.splitlines()) > 3, name


def run_main(capsys, args):
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err.strip()
    return code, err


def one_line_error(code, err, *needles):
    assert code != 0
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def test_missing_model_path(capsys):
    one_line_error(*run_main(capsys, ["generate", "hi", "--model", "/no/such/model"]), "/no/such/model",
                   "does not exist")


def test_unreadable_model_file(capsys, tmp_path):
    p = tmp_path / "broken.gguf"
    p.write_text("this is not a model")
    one_line_error(*run_main(capsys, ["generate", "hi", "--model", str(p)]), "broken.gguf", "not a GGUF")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    one_line_error(*run_main(capsys, ["generate", "hi", "--model", str(tmp_path)]), "falcon", "llama", "qwen2")


def test_unsupported_gguf_tensor_type(capsys, tmp_path, tiny_llama):  # noqa: F811
    import gguf

    _, cfg, state = tiny_llama
    state = dict(state)
    state.pop("model.layers.0.mlp.up_proj.weight")
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    iq = np.zeros((128, 64 // 32 * type_size), np.uint8)
    path = write_gguf(tmp_path / "iq.gguf", "llama", cfg, state,
                      extra_tensors=[("blk.0.ffn_up.weight", iq, gguf.GGMLQuantizationType.Q8_1)])
    one_line_error(*run_main(capsys, ["generate", "hi", "--model", str(path)]), "Q8_1", "not supported")


def test_prompt_longer_than_context(capsys):
    one_line_error(*run_main(capsys, ["generate", "word " * 100, "--max-model-len", "64", "--raw"]),
                   "context window", "101 tokens", "64")


@pytest.mark.parametrize("flag,value,needle", [
    ("--top-p", "1.5", "top_p"), ("--temperature", "-1", "temperature"), ("--top-k", "-5", "--top-k"),
    ("--min-p", "2", "min_p"), ("--max-tokens", "0", "--max-tokens"), ("--kv-cache-memory", "lots", "kv_cache_memory"),
    ("--block-size", "0", "--block-size"),
])
def test_invalid_values_named_with_range(capsys, flag, value, needle):
    code, err = run_main(capsys, ["generate", "hi", flag, value])
    one_line_error(code, err, needle)


def test_bad_flag_and_choice_are_one_line(capsys):
    for args in (["generate", "--no-such-flag"], ["generate", "hi", "--kv-cache", "huge"], ["generate", "hi", "--dtype", "int3"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and "error" in err, err


def test_models_lists_families_and_types(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("llama", "qwen2", "qwen3", "mistral", "gpt2", "bloom", "Q4_1", "Q6_K", "BF16"):
        assert name in out


def test_console_exit_keeps_exit_handlers_output_and_status():
    # run() skips interpreter teardown: what a normal exit guarantees must still happen.
    code = ("import atexit, sys; atexit.register(lambda: print('exit handler ran')); "
            "from kvinfer.cli import run; sys.argv = ['kvinfer'] + sys.argv[1:]; run()")
    ok = subprocess.run([sys.executable, "-c", code, "models"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "GGUF tensor types" in ok.stdout and ok.stdout.rstrip().endswith("exit handler ran")
    bad = subprocess.run([sys.executable, "-c", code, "generate", "--model", "/no/such/model", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "/no/such/model" in bad.stderr and "exit handler ran" in bad.stdout


def test_chat_template_flag_changes_the_prompt_and_bad_ones_are_one_line(capsys, tmp_path):
    template = tmp_path / "qa.jinja"
    template.write_text("Q: {{ messages[-1]['content'] }}\nA:", encoding="utf-8")
    r = subprocess.run(KVINFER + ["generate", "What is the capital of France?", "--max-tokens", "2",
                                  "--chat-template", str(template)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    stats = r.stderr.strip().splitlines()[-1]
    assert int(stats.split("prompt tokens ")[1].split()[0]) < 20, stats  # "Q: ...\nA:", not the 37-token chat
    one_line_error(*run_main(capsys, ["generate", "hi", "--chat-template", "missing.jinja"]), "missing.jinja",
                   "neither a file nor a template")
    one_line_error(*run_main(capsys, ["generate", "hi", "--chat-template", "{% if %}"]), "does not compile")


def test_serve_takes_the_model_as_vllm_serve_does(capsys):
    args = build_parser().parse_args(["serve", "some/model", "--port", "0"])
    assert args.model_tag == "some/model" and args.model is None
    one_line_error(*run_main(capsys, ["serve", "/no/such/model", "--port", "0"]), "/no/such/model", "does not exist")
    one_line_error(*run_main(capsys, ["serve", "a", "--model", "b", "--port", "0"]), "differs from --model")


def test_python_dash_m_kvinfer_is_the_kvinfer_command():
    ok = subprocess.run([sys.executable, "-m", "kvinfer", "--version"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("kvinfer ")
    bad = subprocess.run([sys.executable, "-m", "kvinfer", "--bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--bogus" in bad.stderr


def test_help_builds_every_parser_without_importing_torch():
    # Every command's --help (and a mistyped flag's one line) comes from the parsers alone: torch, and the engine
    # modules that import it, load only when a command runs.
    code = ("import sys\nfrom kvinfer.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvinfer.engine')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
