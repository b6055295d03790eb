"""Tensor-parallel processes over torch.distributed: rendezvous, the workers' loop, rank 0's per-step broadcast."""
from __future__ import annotations

import ast
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from kvinfer.config import EngineConfig, ModelConfig
from kvinfer.engine.model_runner import ModelRunner, StepPlan, row_chunks
from kvinfer.errors import KvinferError, ValidationError
from kvinfer.kv.factory import make_cache
from kvinfer.options import Options, options
from kvinfer.options import use as use_options
from kvinfer.parallel.shard import CommStats, CollectiveModule, check_tp_size, exact_mode, local_config, shard_decoder

log = logging.getLogger("kvinfer")



def _start_timeout() -> timedelta:
    """Rendezvous and start-up (every rank loads its model) may take minutes on a slow disk or a far node."""
    return timedelta(seconds=options().tp_start_timeout)


def _step_timeout() -> timedelta:
    """A collective of a step that takes longer than this means a rank hangs: the engine fails instead of
    waiting."""
    return timedelta(seconds=options().tp_step_timeout)


# Workers wait for rank 0's next step on their own group: an idle server must not time them out.
IDLE_TIMEOUT = timedelta(days=7)
DEFAULT_MULTINODE_PORT = 29500
# A worker's exit code when it found itself re-running the user's script (no `if __name__ == "__main__":` guard).
SPAWN_GUARD_EXIT = 87
SPAWN_GUARD_HINT = ('the script that creates the engine ran again in a tensor-parallel worker: workers are started '
                    'with multiprocessing\'s "spawn", which imports your main script, so put the code that creates '
                    'the engine under `if __name__ == "__main__":` (as torch.multiprocessing and vLLM require)')


class TensorParallelError(KvinferError):
    """A tensor-parallel rank died, hung or could not start: the engine cannot go on (fatal)."""

    fatal = True

    def __init__(self, message: str):
        self.param = None
        super().__init__(message)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet and which ranks this process is and starts."""

    world: int
    rank: int  # this process's rank
    spawn_ranks: tuple[int, ...]  # ranks this process starts as local children
    addr: str
    port: int  # 0: rank 0 picks a free one (single node)
    torchrun: bool  # started by torchrun: its env:// rendezvous, one process per rank, nothing spawned
    local_world: int  # ranks on this machine, which share its cores

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Rendezvous":
        tp, env = config.tensor_parallel_size, os.environ
        if int(env.get("WORLD_SIZE", "1") or 1) > 1 and "RANK" in env:
            world = int(env["WORLD_SIZE"])
            if world != tp:
                raise ValidationError("tensor_parallel_size", tp, f"must equal WORLD_SIZE={world} set by torchrun")
            return cls(world, int(env["RANK"]), (), env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT", "0") or 0),
                       True, int(env.get("LOCAL_WORLD_SIZE", world)))
        per_node = tp // config.nnodes
        first = config.node_rank * per_node
        port = config.master_port or (DEFAULT_MULTINODE_PORT if config.nnodes > 1 else 0)
        return cls(tp, first, tuple(range(first + 1, first + per_node)), config.master_addr or "127.0.0.1", port,
                   False, per_node)


def is_worker_process(config: EngineConfig) -> bool:
    """Whether this process only runs the model (node_rank > 0, or a torchrun rank other than 0)."""
    if config.tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
        return False
    return Rendezvous.from_config(config).rank != 0


def refuse_spawn_bootstrap() -> None:
    """In a worker that is still importing the user's script (spawn's bootstrap), a tensor-parallel engine being
    created means the script has no main guard: say what to add and leave at once (its parent sees the exit code)
    instead of loading the model and then failing inside multiprocessing."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.write(f"kvinfer: error: {SPAWN_GUARD_HINT}\n")
        sys.stderr.flush()
        os._exit(SPAWN_GUARD_EXIT)


def refuse_unguarded_main(config: EngineConfig) -> None:
    """On the process that will spawn workers, before anything is loaded: an engine created by the main script's
    top-level code outside `if __name__ == "__main__":` would be created again in every worker (spawn re-runs that
    script), so say what to add now rather than after the workers have started and found it out. Scripts run
    under torchrun (nothing spawned), interactive sessions and `python -c` have nothing to check."""
    if not Rendezvous.from_config(config).spawn_ranks:
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py") or getattr(main, "__spec__", None) is not None:
        return  # `python -m pkg` re-imports the module by name, under its own guard; none to read otherwise
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return  # not reached from the script's top level (a thread, a callback): the worker check still holds
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _tests_main(node.test) and node.lineno <= line <= (node.end_lineno or 0):
            return
    raise TensorParallelError(f"{path} line {line} creates a tensor-parallel engine outside "
                              f"`if __name__ == \"__main__\":`; its workers are started with multiprocessing's "
                              f"\"spawn\", which imports the main script, so that line would run again in each of "
                              f"them: put the code that creates the engine under `if __name__ == \"__main__\":` (as "
                              f"torch.multiprocessing and vLLM require)")


def _tests_main(test: ast.expr) -> bool:
    """Whether an if's test is `__name__ == "__main__"` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _set_threads(config: EngineConfig, local_world: int) -> None:
    # The ranks of one machine share its cores: torch's default (all cores each) would oversubscribe them.
    torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // local_world))


def _compute_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _join(rdv: Rendezvous, rank: int, device: torch.device, store=None):
    """init_process_group for `rank`; returns (control group, compute group)."""
    # The default group's timeout bounds the rendezvous itself (a node that never comes); then two groups: the
    # control group (gloo, no practical timeout) carries rank 0's plans, for which an idle worker may wait for
    # hours; the compute group's all-reduces time out, so a hung rank fails the step.
    if rdv.torchrun:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=rdv.world, timeout=_start_timeout())
    else:
        if store is None:
            store = dist.TCPStore(rdv.addr, rdv.port, rdv.world, is_master=False, timeout=_start_timeout())
        dist.init_process_group("gloo", store=store, rank=rank, world_size=rdv.world, timeout=_start_timeout())
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    compute = dist.new_group(backend=_compute_backend(device), timeout=_step_timeout())
    return control, compute


def _join_watching(rdv: Rendezvous, device: torch.device, store, procs: list):
    """Rank 0's _join, in a thread, while this node's workers are watched: one that exits before the ranks meet
    fails the start at once (naming the main guard when that is why) rather than after KVINFER_TP_START_TIMEOUT."""
    done: dict = {}

    def join():
        try:
            done["groups"] = _join(rdv, 0, device, store)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = e

    t = threading.Thread(target=join, name="kvinfer-tp-rendezvous", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
        dead = [(r, p) for r, p in zip(rdv.spawn_ranks, procs) if p.exitcode is not None]
        if dead and t.is_alive():
            r, p = dead[0]
            if p.exitcode == SPAWN_GUARD_EXIT:
                raise TensorParallelError(SPAWN_GUARD_HINT)
            raise TensorParallelError(f"tensor-parallel worker rank {r} {_exit_text(p.exitcode)} before the ranks "
                                      f"met; its error is above")
    if "error" in done:
        raise done["error"]
    return done["groups"]


def _recv(group):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _device_for(config: EngineConfig, rdv: Rendezvous, rank: int) -> torch.device:
    from kvinfer.loaders.model_loader import resolve_device

    dev = resolve_device(config.device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank - (rdv.rank if not rdv.torchrun else 0)))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return dev


# ---- the workers ------------------------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    # A parent killed with SIGKILL cannot end its children: they notice and leave on their own.
    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="kvinfer-parent-watch", daemon=True).start()


def _spawned_worker(config: EngineConfig, rdv: Rendezvous, rank: int, parent_pid: int, opts: Options) -> None:
    """Entry of a worker process started by a node's main process (torch.multiprocessing, spawn), with its
    switches (rank 0's, which may differ from the environment it inherited when set in-process)."""
    use_options(opts)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; rank 0 ends us
    _watch_parent(parent_pid)
    sys.exit(run_worker(config, rdv, rank))


def run_worker(config: EngineConfig, rdv: Rendezvous, rank: int) -> int:
    """Join the group, load and shard the model, then run rank 0's steps until it says stop; the exit code."""
    from kvinfer.loaders.model_loader import load_model

    _set_threads(config, rdv.local_world)
    device = _device_for(config, rdv, rank)
    try:
        control, compute = _join(rdv, rank, device)
    except Exception as e:
        print(f"kvinfer: tensor-parallel rank {rank}: could not join rank 0 at {rdv.addr}:{rdv.port}: "
              f"{_first_line(e)}", file=sys.stderr)
        return 1
    err, runner = None, None
    try:
        from kvinfer import kernels

        kernels.set_activation_bits(config.activation_bits)  # as rank 0's (a worker runs no other engine)
        loaded = load_model(config)  # on CUDA, the device set just above
        shard_decoder(loaded.model, loaded.config, rank, rdv.world, compute, CommStats())
    except Exception as e:  # reported to rank 0, which names it in its own error
        err = f"{type(e).__name__}: {e}"
    try:
        msg = _recv(control)  # ("init", kv_spec, rank 0's exact mode)
        if err is None and msg[2] != exact_mode():
            err = f"KVINFER_TP_EXACT differs from rank 0's ({int(msg[2])}): set it alike on every node"
        if err is None:
            try:
                runner = _worker_runner(loaded, msg[1])
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
        errs = [None] * rdv.world
        dist.all_gather_object(errs, err, group=control)
        if any(errs):
            return 1
        while True:
            msg = _recv(control)
            if msg[0] == "stop":
                return 0
            hidden = runner.run_plan(msg[1])
            if msg[1].sample_rows:
                runner.logits(hidden, msg[1].sample_rows)  # this rank's vocabulary slice, gathered by rank 0
            for rows in row_chunks(msg[1].prompt_rows):  # prompt logprobs: the same LM-head calls as rank 0's
                runner.logits(hidden, rows)
    except Exception as e:
        print(f"kvinfer: tensor-parallel rank {rank}: lost rank 0 ({_first_line(e)}); exiting", file=sys.stderr)
        return 1
    finally:
        _destroy()


def _worker_runner(loaded, kv_spec) -> ModelRunner:
    # This rank's device (its own GPU under NCCL) and its shard's ALiBi slopes.
    cache = make_cache(dataclasses.replace(kv_spec, device=loaded.device), alibi=getattr(loaded.model, "alibi", None))
    runner = ModelRunner(loaded.model, cache, None, loaded.device)
    runner.use_fused_decode = False
    return runner


def run_worker_node(config: EngineConfig) -> int:
    """A process that is not rank 0 (node_rank > 0, or a torchrun rank): start this node's other ranks, serve."""
    rdv = Rendezvous.from_config(config)
    mine = f"ranks {rdv.rank}-{rdv.spawn_ranks[-1]}" if rdv.spawn_ranks else f"rank {rdv.rank}"
    print(f"kvinfer: tensor-parallel {mine} of {rdv.world}, joining rank 0 at {rdv.addr}:{rdv.port}; "
          f"this node runs the model only", file=sys.stderr)
    procs = _spawn(config, rdv)
    try:
        return run_worker(config, rdv, rdv.rank)
    finally:
        _end_processes(procs, 10.0)


def _spawn(config: EngineConfig, rdv: Rendezvous) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork would copy this process's threads and torch state
    procs = []
    for r in rdv.spawn_ranks:
        p = ctx.Process(target=_spawned_worker, args=(config, rdv, r, os.getpid(), options()), daemon=True,
                        name=f"kvinfer-tp-rank{r}")
        p.start()
        procs.append(p)
    return procs


def _end_processes(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _destroy() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group with a dead peer may not tear down cleanly; the process is ending anyway
            pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "did not answer"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _release(control, procs: list, state: dict) -> None:
    """Rank 0's teardown: tell the workers to stop (if they can still hear it), make sure every local one has ended,
    then destroy the process group so that another engine can start in this process."""
    if state["failed"] is None:
        try:
            dist.broadcast_object_list([("stop",)], src=0, group=control)
        except Exception:
            pass
    _end_processes(procs, 10.0 if state["failed"] is None else 0.5)
    _destroy()


# ---- rank 0 -----------------------------------------------------------------------------------------
class TensorParallel:
    """Rank 0's side: the shard of the model it computes, its workers, and the per-step broadcast of plans."""

    def __init__(self, rdv: Rendezvous, procs: list, control, compute, stats: CommStats, local: ModelConfig):
        self.rdv = rdv
        self.procs = procs
        self.control, self.compute = control, compute
        self.stats = stats
        self.local_config = local
        self._state = {"failed": None}
        # The workers and the process group go when the engine is shut down, garbage-collected or at exit, whichever
        # comes first; the finalizer holds no reference to self, so `del llm` lets it run.
        self._finalizer = weakref.finalize(self, _release, control, procs, self._state)

    @property
    def failed(self) -> Optional[str]:
        return self._state["failed"]

    @failed.setter
    def failed(self, value: Optional[str]) -> None:
        self._state["failed"] = value

    @property
    def size(self) -> int:
        return self.rdv.world

    @classmethod
    def start(cls, config: EngineConfig, loaded) -> "TensorParallel":
        """Shard rank 0's loaded model, start this node's workers and meet the other nodes."""
        tp, cfg = config.tensor_parallel_size, loaded.config
        check_tp_size(cfg, tp)
        rdv = Rendezvous.from_config(config)
        if dist.is_initialized():  # an engine dropped without close() may only wait for the collector
            import gc

            gc.collect()
        if dist.is_initialized():
            raise ValidationError("tensor_parallel_size", tp, "another tensor-parallel engine still holds this "
                                  "process's process group: close it first (llm.close(), or drop every reference)")
        if rdv.rank != 0:
            raise ValidationError("node_rank", config.node_rank, "the engine runs on node 0 (rank 0) only")
        if loaded.device.type == "cuda" and not rdv.torchrun and torch.cuda.device_count() < rdv.local_world:
            raise ValidationError("tensor_parallel_size", tp, f"needs {rdv.local_world} GPUs on this node, "
                                                              f"found {torch.cuda.device_count()}")
        stats = CommStats()
        shard_decoder(loaded.model, cfg, 0, tp, None, stats)  # before any process starts: bad splits fail here
        if config.num_threads is None:
            _set_threads(config, rdv.local_world)
        store = None
        if not rdv.torchrun:
            store = dist.TCPStore(rdv.addr, rdv.port, rdv.world, is_master=True, timeout=_start_timeout(),
                                  wait_for_workers=False)
            rdv = dataclasses.replace(rdv, port=store.port)
        procs = _spawn(config, rdv)
        try:
            control, compute = _join_watching(rdv, loaded.device, store, procs)
        except TensorParallelError:
            _end_processes(procs, 0.0)
            raise
        except Exception as e:
            _end_processes(procs, 0.0)
            _destroy()
            raise TensorParallelError(f"tensor-parallel ranks did not meet at {rdv.addr}:{rdv.port} within "
                                      f"{options().tp_start_timeout:.0f} s: {_first_line(e)}") from e
        for m in loaded.model.modules():
            if isinstance(m, CollectiveModule):
                m.group = compute
        log.info("tensor parallel: %d ranks (%d on this node), backend %s", tp, rdv.local_world,
                 _compute_backend(loaded.device))
        return cls(rdv, procs, control, compute, stats, local_config(cfg, tp))

    def make_runner(self, model, backend, manager, device, kv_spec) -> "TPModelRunner":
        """Rank 0's runner; the workers build the same KV cache (their share of the heads) from kv_spec."""
        with self.guard():
            self._send(("init", kv_spec, exact_mode()))
            errs = [None] * self.size
            dist.all_gather_object(errs, None, group=self.control)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        if bad:
            self.failed = f"tensor-parallel rank {bad[0][0]} could not start: {bad[0][1]}"
            self.shutdown()
            raise TensorParallelError(self.failed)
        self.stats.reset()  # the init broadcast waited for the workers' start-up: not a step's cost
        if getattr(model, "alibi", None) is not None:
            backend.alibi = model.alibi  # the cache was wired before sharding: give it this rank's slopes
        return TPModelRunner(self, model, backend, manager, device)

    def _send(self, msg) -> None:
        t0 = time.perf_counter()
        dist.broadcast_object_list([msg], src=0, group=self.control)
        self.stats.broadcast_s += time.perf_counter() - t0

    @contextmanager
    def guard(self):
        """Turns a failed collective into TensorParallelError naming the rank that went away; ends the rest."""
        if self.failed:
            raise TensorParallelError(self.failed)
        try:
            yield
        except TensorParallelError:
            raise  # an inner guard has diagnosed it
        except Exception as e:
            self.failed = self._diagnose(e)
            self.shutdown()
            raise TensorParallelError(self.failed) from e

    def _diagnose(self, e: BaseException) -> str:
        deadline = time.monotonic() + 2.0  # a killed worker's exit code shows up a moment after its socket closes
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            time.sleep(0.05)
        dead = [(r, p) for r, p in zip(self.rdv.spawn_ranks, self.procs) if p.exitcode is not None]
        if dead:
            r, p = dead[0]
            return (f"tensor-parallel worker rank {r} (pid {p.pid}) {_exit_text(p.exitcode)}; "
                    f"the engine stopped")
        return f"lost a tensor-parallel rank ({_first_line(e)}); the engine stopped"

    def shutdown(self) -> None:
        """Tell the workers to stop (if they can still hear it), then make sure every local one has ended."""
        self._finalizer()


class TPModelRunner(ModelRunner):
    """Rank 0's runner: each step's plan goes to the other ranks, then every rank runs the same forward."""

    use_fused_decode = False  # the fused C step has no all-reduce: the eager decoder runs under TP

    def __init__(self, tp: TensorParallel, *args):
        super().__init__(*args)
        self.tp = tp

    def run_plan(self, p: StepPlan) -> torch.Tensor:
        with self.tp.guard():
            self.tp._send(("step", p))
            self.tp.stats.steps += 1
            return super().run_plan(p)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        with self.tp.guard():
            return super().logits(hidden, rows)
