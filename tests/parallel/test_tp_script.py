"""Tensor parallelism from a user's script (issue 46): a missing main guard fails fast and says so; a second engine
starts after the first is dropped."""
import os
import subprocess
import sys
import time

MAIN_GUARD = 'if __name__ == "__main__":'


def _run_script(tmp_path, text, timeout):
    script = tmp_path / "script.py"
    script.write_text(text)
    # Before: the start waited for the rendezvous timeout (KVINFER_TP_START_TIMEOUT), then named no guard.
    env = dict(os.environ, PYTHONPATH=os.getcwd(), KVINFER_TP_START_TIMEOUT="150", TORCH_CPP_LOG_LEVEL="ERROR")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p, time.monotonic() - t0


def test_tp_script_without_main_guard_fails_fast_naming_the_guard(tmp_path):
    p, wall = _run_script(tmp_path, "from kvinfer import LLM\n"
                                    "llm = LLM(tensor_parallel_size=3, kv_cache_memory='16MiB', max_model_len=128)\n"
                                    "print('started')\n", timeout=300)
    assert p.returncode != 0 and "started" not in p.stdout
    assert MAIN_GUARD in p.stderr.splitlines()[-1], p.stderr[-2000:]
    assert wall < 100  # far below the 150 s rendezvous timeout it used to wait out (a busy 2-core machine)
    assert "Loading" not in p.stderr and "KV cache" not in p.stderr  # refused before the model was read


def test_tp_script_creating_the_engine_in_a_function_without_guard_is_refused_too(tmp_path):
    p, _ = _run_script(tmp_path, "from kvinfer import LLM\n"
                                 "def main():\n"
                                 "    return LLM(tensor_parallel_size=3, kv_cache_memory='16MiB', max_model_len=128)\n"
                                 "llm = main()\n"
                                 "print('started')\n", timeout=300)
    assert p.returncode != 0 and "started" not in p.stdout
    assert MAIN_GUARD in p.stderr.splitlines()[-1], p.stderr[-2000:]


def test_main_guard_test_reads_either_order():
    import ast

    from kvinfer.parallel.runtime import _tests_main

    assert _tests_main(ast.parse('__name__ == "__main__"', mode="eval").body)
    assert _tests_main(ast.parse("'__main__' == __name__", mode="eval").body)
    assert not _tests_main(ast.parse('__name__ != "__main__"', mode="eval").body)
    assert not _tests_main(ast.parse('name == "__main__"', mode="eval").body)


def test_second_tp_engine_after_del(tmp_path):
    p, _ = _run_script(tmp_path, f"""from kvinfer import LLM, SamplingParams
{MAIN_GUARD}
    kw = dict(tensor_parallel_size=3, kv_cache_memory="16MiB", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(**kw)
    a = llm.generate("The capital of France is", params)[0].outputs[0].token_ids
    del llm
    llm = LLM(**kw)
    b = llm.generate("The capital of France is", params)[0].outputs[0].token_ids
    print("same" if a == b else f"differ {{a}} {{b}}")
""", timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "same"
