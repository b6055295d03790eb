"""The KV backend seam: one factory, the KVManager protocol, per-request views, the step layout in one place."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvinfer.kv.cache import _group_seqs
from kvinfer.kv.factory import KVSpec, kv_layout, make_kv
from kvinfer.kv.interface import KVManager, SeqSlice, decodes_first, is_decode, leading_decodes
from kvinfer.core.request import Request
from kvinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2] / "kvinfer"
BACKENDS = ("paged", "contiguous", "none")


def _spec(kind: str, count: int = 6) -> KVSpec:
    return KVSpec(kind, num_layers=2, count=count, block_size=4, num_kv_heads=2, max_len=32, head_dim=8,
                  dtype=torch.float32, device=torch.device("cpu"))


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize("kind", BACKENDS)
def test_factory_pairs_a_manager_with_its_cache_behind_the_protocol(kind):
    m, cache = make_kv(_spec(kind))
    assert isinstance(m, KVManager) and m.kind == cache.name == kind
    assert cache.block_pools == (kind == "paged")
    a, b = _req("a", 6), _req("b", 3)
    assert m.allocate_slots(a, 6) and m.allocate_slots(b, 3)
    used = m.num_units - m.num_free_units
    # Units and tokens per unit are what a backend holds, whatever it calls them.
    assert (used, m.unit_tokens, m.token_capacity) == {"paged": (3, 4, 24), "contiguous": (2, 32, 192),
                                                       "none": (0, 0, 0)}[kind]
    fields, held = m.snapshot([a, b])
    assert len(held) == 2 and fields["tokens_allocated"] == used * m.unit_tokens
    m.free(a)
    m.free(b)
    m.check_integrity()
    assert m.num_free_units == m.num_units


def test_per_request_views_are_what_the_backend_reads():
    paged, _ = make_kv(_spec("paged"))
    contiguous, _ = make_kv(_spec("contiguous", 3))
    none, _ = make_kv(_spec("none"))
    a, b = _req("a", 5), _req("b", 2)
    for m in (paged, contiguous, none):
        assert m.allocate_slots(a, 5) and m.allocate_slots(b, 2)
    assert paged.seq_slice(b, 2, 1) == SeqSlice(2, 1, block_table=[2])  # a holds blocks 0 and 1
    assert contiguous.seq_slice(b, 2, 1) == SeqSlice(2, 1, slot=1)
    assert none.seq_slice(b, 2, 1) == SeqSlice(0, 3)  # nothing cached: recompute from the first token
    assert paged.keeps_kv and contiguous.keeps_kv and not none.keeps_kv
    assert paged.can_fork and not contiguous.can_fork and not none.can_fork
    # Only the paged pool caps a request below the context window.
    assert (paged.max_request_tokens, contiguous.max_request_tokens) == (24, 32) and none.max_request_tokens > 1e9


def test_the_step_layout_puts_decodes_first_and_the_backends_group_them():
    seqs = [SeqSlice(0, 5), SeqSlice(7, 1), SeqSlice(3, 4), SeqSlice(9, 1), SeqSlice(0, 1), SeqSlice(2, 1)]
    laid = decodes_first(seqs, lambda s: s)
    assert laid == [seqs[1], seqs[3], seqs[5], seqs[0], seqs[2], seqs[4]]  # stable in both parts
    assert leading_decodes(laid) == 3 and not is_decode(SeqSlice(0, 1))  # a 1-token prompt is a prefill
    groups = _group_seqs(laid)
    assert groups[0] == laid[:3] and all(len(g) == 1 for g in groups[1:]) and len(groups) == 4


def test_layout_budget_rules():
    assert kv_layout("paged", 10, 4, 32, 8, 400) == (10, 400)
    assert kv_layout("contiguous", 10, 4, 32, 2, 10_000) == (2, 640)  # capped by max_num_seqs
    assert kv_layout("contiguous", 10, 4, 32, 8, 100, allow_no_slot=True) == (0, 0)
    for kind in ("paged", "contiguous"):
        with pytest.raises(Exception, match="too small"):
            kv_layout(kind, 10, 4, 32, 8, 20)


def test_no_backend_name_is_compared_outside_the_factory():
    """A `.kind` / `.kv_cache` / `.name` (or `kind`) compared with a backend's name is a decision the factory or
    a KVManager capability should make."""
    names = set(BACKENDS)

    def subject(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in ("kind", "kv_cache", "name")) or \
            (isinstance(node, ast.Name) and node.id == "kind")

    def literal(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "kv" / "factory.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(subject(s) for s in sides) and any(literal(s) for s in sides):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
