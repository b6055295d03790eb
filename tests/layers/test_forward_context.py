"""The forward context: one forward's facts (its prompt rows), set by the runner around exactly that forward, read by
the layers through get_forward_context(), private to the thread running the forward; and the KV manager told at
construction whether prompt rows have their own route."""
from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from kvinfer import SamplingParams
from kvinfer.engine.model_runner import ModelRunner, StepPlan
from kvinfer.layers.forward_context import EMPTY, ForwardContext, get_forward_context, set_forward_context


def test_empty_outside_any_forward_and_restored_after_one():
    assert get_forward_context() is EMPTY and EMPTY.prompt_spans == ()
    spans = [(0, 3), (5, 9)]
    with set_forward_context(ForwardContext(prompt_spans=spans)) as ctx:
        spans.append((10, 12))  # the caller's list is not the context's
        assert get_forward_context() is ctx and ctx.prompt_spans == ((0, 3), (5, 9))
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.prompt_spans = ()
        with set_forward_context(dataclasses.replace(ctx, prompt_spans=[(1, 2)])):  # a part of the rows (experts)
            assert get_forward_context().prompt_spans == ((1, 2),)
        assert get_forward_context() is ctx
    assert get_forward_context() is EMPTY
    with pytest.raises(RuntimeError, match="in the forward"):
        with set_forward_context(ForwardContext(prompt_spans=[(0, 1)])):
            raise RuntimeError("in the forward")
    assert get_forward_context() is EMPTY


def test_threads_do_not_see_each_others_forward():
    both_inside = threading.Barrier(2, timeout=30)
    seen, errors = {}, []

    def forward(name: str, spans):
        try:
            with set_forward_context(ForwardContext(prompt_spans=spans)):
                both_inside.wait()
                seen[name] = get_forward_context().prompt_spans
                both_inside.wait()  # neither leaves before both have read
            seen[name + " after"] = get_forward_context()
        except Exception as e:  # (reported below: an assertion in a thread would pass silently)
            errors.append(e)

    with set_forward_context(ForwardContext(prompt_spans=[(0, 100)])):  # this thread's forward: not theirs
        threads = [threading.Thread(target=forward, args=("engine", [(0, 4)])),
                   threading.Thread(target=forward, args=("drafter", [(2, 3), (7, 8)]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert get_forward_context().prompt_spans == ((0, 100),)
    assert not errors, errors
    assert seen == {"engine": ((0, 4),), "drafter": ((2, 3), (7, 8)), "engine after": EMPTY, "drafter after": EMPTY}
    fresh = []
    with set_forward_context(ForwardContext(prompt_spans=[(0, 1)])):
        t = threading.Thread(target=lambda: fresh.append(get_forward_context()))
        t.start()
        t.join(60)
    assert fresh == [EMPTY]  # a thread started during a forward does not inherit it


class _Model(torch.nn.Module):
    """Records the context each forward runs in; raises where asked."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail, self.seen = fail, []

    def forward(self, input_ids, positions, md, backend):
        self.seen.append(get_forward_context())
        if self.fail:
            raise RuntimeError("the forward failed")
        return torch.zeros(len(input_ids), 4)


class _Backend:
    def copy_blocks(self, copies):
        pass

    def prepare(self, slices):
        return SimpleNamespace(kernel=None)  # no kernel metadata: never the fused decode step


def _plan(spans) -> StepPlan:
    return StepPlan([5, 6, 7, 8], [0, 1, 2, 3], [], [], prompt_spans=list(spans))


def test_the_runner_sets_the_plans_spans_for_its_forward_only():
    model = _Model()
    runner = ModelRunner(model, _Backend(), None, torch.device("cpu"))
    runner.run_plan(_plan([(1, 4)]))
    assert get_forward_context() is EMPTY
    runner.run_plan(_plan([]))
    assert [c.prompt_spans for c in model.seen] == [((1, 4),), ()]
    failing = ModelRunner(_Model(fail=True), _Backend(), None, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="the forward failed"):
        failing.run_plan(_plan([(0, 4)]))
    assert failing.model.seen[0].prompt_spans == ((0, 4),)
    assert get_forward_context() is EMPTY


def test_managers_get_prompt_roles_when_built():
    from kvinfer.kv.factory import KVSpec, make_kv, make_manager

    assert make_manager("paged", 4, 16, 64).prompt_roles is False
    assert make_manager("paged", 4, 16, 64, prompt_roles=True).prompt_roles is True
    spec = KVSpec("paged", 1, 4, 16, 1, 64, 8, torch.float32, torch.device("cpu"))
    assert make_kv(spec, prompt_roles=True)[0].prompt_roles is True
    assert make_kv(spec)[0].prompt_roles is False


def _engine(path, fake_route: bool, monkeypatch):
    """The built-in model's engine, one model forward per step (no fused decode); fake_route: as if the prompt
    route were on (this machine's kernels have none, so the rows' arithmetic stays the usual one)."""
    from kvinfer.config import EngineConfig
    from kvinfer.engine.llm_engine import LLMEngine

    with monkeypatch.context() as mp:
        if fake_route:
            mp.setattr(ModelRunner, "prompt_route_for", staticmethod(lambda model: model is not None))
        eng = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory=64 << 20, max_model_len=256,
                                     block_size=16, max_num_batched_tokens=16, num_scheduler_steps=1))
    eng.runner.use_fused_decode = False
    return eng


def _run_two(eng) -> tuple[dict, list]:
    """Request a (20 prompt tokens) until it decodes, then b (24) beside it: a's decode rows and b's prompt chunks
    share steps. Returns each request's tokens and, per model forward, (its prompt spans, input ids, positions)."""
    forwards = []
    eng.loaded.model.register_forward_pre_hook(
        lambda m, args: forwards.append((get_forward_context().prompt_spans, args[0].tolist(), args[1].tolist())))
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request("a", list(range(1000, 1020)), p)
    toks = {}
    for _ in range(3):
        for out in eng.step():
            toks[out.request_id] = list(out.outputs[0].token_ids)
        assert get_forward_context() is EMPTY
    eng.add_request("b", list(range(2000, 2024)), p)
    while eng.has_unfinished_requests():
        for out in eng.step():
            toks[out.request_id] = list(out.outputs[0].token_ids)
        assert get_forward_context() is EMPTY
    return toks, forwards


def test_each_forward_gets_its_own_prompt_rows_by_role(builtin_model_path, monkeypatch):
    eng = _engine(builtin_model_path, True, monkeypatch)
    # built with the route: the manager's hashes count prompt tokens from its first block on
    assert eng.runner.prompt_route and eng.kv_manager.prompt_roles
    toks, forwards = _run_two(eng)

    def is_prompt(tok: int, pos: int) -> bool:  # a's prompt is 1000 + position, b's 2000 + position
        return (pos < 20 and tok == 1000 + pos) or (pos < 24 and tok == 2000 + pos)

    mixed = 0
    for spans, ids, pos in forwards:
        rows = [i for i in range(len(ids)) if is_prompt(ids[i], pos[i])]
        assert [i for a, b in spans for i in range(a, b)] == rows, (spans, ids, pos)
        mixed += bool(rows) and len(rows) < len(ids)
    assert mixed  # some step held prompt rows and others: each row took its own role
    assert any(not spans for spans, _, _ in forwards)
    plain = _engine(builtin_model_path, False, monkeypatch)
    assert not plain.runner.prompt_route and not plain.kv_manager.prompt_roles
    assert _run_two(plain)[0] == toks  # the spans change no arithmetic where the kernels have no prompt route


def test_a_drafter_manager_gets_prompt_roles_when_built(builtin_model_path, monkeypatch):
    from kvinfer.spec.draft import DraftProposer

    eng = _engine(builtin_model_path, False, monkeypatch)
    assert DraftProposer(eng.loaded, 4, 16).manager.prompt_roles is False
    monkeypatch.setattr(ModelRunner, "prompt_route_for", staticmethod(lambda model: model is not None))
    d = DraftProposer(eng.loaded, 4, 16)
    assert d.manager.prompt_roles is True and d.runner.prompt_route is True
