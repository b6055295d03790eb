"""`python -m kvinfer.parallel.measure [TP]`: LM head and embedding, replicated vs vocabulary-parallel, timed."""
from __future__ import annotations

import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvinfer.options import options

def _median_ms(fn, group) -> float:
    """Median over KVINFER_MEASURE_REPS runs of fn's time on rank 0; a barrier first so every rank starts each rep together."""
    times = []
    for _ in range(options().measure_reps):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _job(rank: int, world: int, port: int) -> None:
    from kvinfer.config import EngineConfig
    from kvinfer.loaders.model_loader import load_model
    from kvinfer.parallel.shard import CommStats, shard_lm_head

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    group = dist.group.WORLD
    loaded = load_model(EngineConfig(model=None, dtype="float32"))
    model, cfg = loaded.model, loaded.config
    head, embed = model.lm_head, model.embed  # the built-in model's tied head: a QuantLinear over the embedding

    def full_head(h):
        return head(h).float()

    shard_lm_head(model, cfg, rank, world, group, CommStats())
    per = -(-cfg.vocab_size // world)
    v0, v1 = rank * per, min((rank + 1) * per, cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for n in (1, 8):
            h = torch.randn(n, cfg.hidden_size, generator=g)
            # replicated: rank 0 alone computes every logit (the others wait, as they would for the next plan)
            rep = _median_ms(lambda: full_head(h) if rank == 0 else None, group)
            par = _median_ms(lambda: model.compute_logits(h), group)
            if rank == 0:
                same = bool(torch.equal(full_head(h), model.compute_logits(h)))
            else:
                model.compute_logits(h)
                same = None
            rows.append((f"LM head, {n} row(s)", rep, par, same))
        for n in (1, 32):
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)

            def masked():  # each rank looks up the ids in its vocabulary slice, zeros elsewhere, then sums
                mine = (ids >= v0) & (ids < v1)
                x = embed(torch.where(mine, ids, torch.zeros_like(ids))) * mine.unsqueeze(-1)
                dist.all_reduce(x, group=group)
                return x

            rep = _median_ms(lambda: embed(ids), group)
            par = _median_ms(masked, group)
            rows.append((f"embedding, {n} token(s)", rep, par, None))
        link = []
        for n in (1, 512):  # one collective's start-up, then the bytes/s beyond it (the simulator's -tp defaults)
            x = torch.randn(n, cfg.hidden_size)
            parts = [torch.empty_like(x) for _ in range(world)]
            link.append((x.numel() * 4 * (world - 1), _median_ms(lambda: dist.all_gather(parts, x, group=group),
                                                                 group)))
    if rank == 0:
        print(f"tensor parallel {world}, {options().measure_reps} reps each, median ms on rank 0 (replicated | vocabulary-parallel):")
        for name, rep, par, same in rows:
            extra = "" if same is None else f"  (same logits: {same})"
            print(f"  {name:22s} {rep:8.2f} | {par:8.2f}  -> {'vocabulary-parallel' if par < rep else 'replicated'}"
                  f" {max(rep, par) / min(rep, par):.2f}x faster{extra}")
        (b0, t0), (b1, t1) = link
        bw = (b1 - b0) / max(t1 - t0, 1e-9) * 1e3
        print(f"  all-gather [1, {cfg.hidden_size}] float32: {t0:.3f} ms; [512, {cfg.hidden_size}]: {t1:.3f} ms "
              f"-> latency {t0 * 1e3:.0f} us, {bw / 1e9:.3g} GB/s received per rank")
    dist.destroy_process_group()


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    args = sys.argv[1:] if argv is None else argv
    world = int(args[0]) if args else 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_job, args=(world, port), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
