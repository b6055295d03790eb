"""The seeded benchmark workload shared by `bench throughput`, `bench serve` and `simulate`."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_tokens: int


def throughput_workload(num_requests: int = 64, seed: int = 0, prompt_range=(16, 512), output_range=(16, 256),
                        vocab_size: int = 49152, low_id: int = 100) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the ranges; prompts are random token ids (ignore_eos)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p = rng.randint(*prompt_range)
        o = rng.randint(*output_range)
        out.append(BenchRequest([rng.randrange(low_id, vocab_size) for _ in range(p)], o))
    return out


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return float("nan")
    k = max(0, min(len(vals) - 1, int(round(q / 100 * len(vals) + 0.5)) - 1))
    return vals[k]
