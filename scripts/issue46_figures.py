#!/usr/bin/env python3
"""Issue 46's before/after figures for one or more checkouts: items 1 (a big body stalls the server),
2 (SIGTERM / Ctrl-C with streams open) and 10 (a tensor-parallel script without a main guard).

Each --repo runs its own code (PYTHONPATH=REPO) under --python (default: this interpreter, e.g. the shared
venv's), and gets one column of the table:

    .venv/bin/python scripts/issue46_figures.py --repo /tmp/i46-before --repo . [--json out.json]

The client side uses only the standard library. Every process this script starts runs in its own session and is
killed (its whole group) when the script leaves, whatever way it leaves, so no server is left running.
"""
from __future__ import annotations

import argparse
import atexit
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MODEL = "kv46"  # --served-model-name, so requests never depend on how a checkout names the built-in model
GUARD = 'if __name__ == "__main__":'
CLI = "import sys; from kvinfer.cli import run; sys.argv[0] = 'kvinfer'; sys.exit(run())"

_children: list[subprocess.Popen] = []


def _kill_all() -> None:
    for p in _children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the server and any workers it spawned
            except ProcessLookupError:
                pass
            p.wait()


atexit.register(_kill_all)


def _leave(sig, _frame):
    raise SystemExit(128 + sig)  # runs the finally blocks and atexit, which kill the children


def _start(argv: list[str], env: dict, cwd: str, stderr_path: str) -> subprocess.Popen:
    with open(stderr_path, "wb") as err:
        p = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=err, start_new_session=True)
    _children.append(p)
    return p


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
    try:  # workers it left behind in its group (a TP rank) go too
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _env(repo: str) -> dict:
    env = dict(os.environ, PYTHONPATH=repo, PYTHONUNBUFFERED="1")
    env.pop("KVINFER_TP_START_TIMEOUT", None)  # item 10 is measured with each checkout's own default
    return env


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---------------------------------------------------------------------------------------------------------------
# A server


class Server:
    def __init__(self, repo: str, python: str, threads: int, workdir: str, tag: str, extra: list[str] = ()):
        self.stderr_path = os.path.join(workdir, f"serve-{tag}.stderr")
        argv = [python, "-c", CLI, "serve", "--host", "127.0.0.1", "--port", "0", "--threads", str(threads),
                "--served-model-name", MODEL, *extra]
        self.proc = _start(argv, _env(repo), workdir, self.stderr_path)
        self.port = None

    def stderr(self) -> str:
        with open(self.stderr_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait_ready(self, timeout: float) -> None:
        """The port from the server's own 'serving ... on http://HOST:PORT' line, then /health answering 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.stderr()[-2000:]}")
            if self.port is None:
                m = re.search(r"serving .* on http://[^\s]+:(\d+)", self.stderr())
                if m:
                    self.port = int(m.group(1))
            if self.port is not None:
                try:
                    status, _, _ = request(self.port, "GET", "/health", timeout=5)
                    if status == 200:
                        return
                except OSError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout:.0f} s: {self.stderr()[-2000:]}")

    def close(self) -> None:
        _stop(self.proc)


def request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 120):
    """(status, headers, body) of one request on a fresh connection."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def stream_completion(port: int, max_tokens: int, on_token=None, stop: threading.Event | None = None,
                      timeout: float = 300) -> dict:
    """One streamed /v1/completions; how it ended: tokens, an error event, [DONE], or the connection dropped."""
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time, in a small village by the sea,",
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    res = {"status": None, "tokens": 0, "error": False, "done": False, "finish": None, "dropped": False}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        res["status"] = r.status
        if r.status != 200:
            r.read()
            return res
        while True:
            line = r.readline()
            if not line:
                res["dropped"] = not res["done"]
                return res
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                res["done"] = True
                continue
            obj = json.loads(data)
            if "error" in obj:
                res["error"] = True
                continue
            for ch in obj.get("choices", []):
                if ch.get("text"):
                    res["tokens"] += 1
                    if on_token is not None:
                        on_token(time.monotonic())
                if ch.get("finish_reason"):
                    res["finish"] = ch["finish_reason"]
            if stop is not None and stop.is_set():
                return res
    except (OSError, http.client.HTTPException, ValueError):
        res["dropped"] = not res["done"]
        return res
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------------------------
# Item 1: /health and a stream's pace while big chat bodies arrive back to back


def big_chat_body(size: int) -> bytes:
    """A chat request of about `size` bytes whose user message is ordinary words (so it is tokenized as text)."""
    rng = random.Random(46)
    words = ("the quick brown fox jumps over a lazy dog while seven bright stars shine on quiet water and "
             "distant mountains hold their snow through every long summer afternoon").split()
    head = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]})
    need = size - len(head)
    parts, n = [], 0
    while n < need:
        w = rng.choice(words) + (". " if rng.random() < 0.08 else " ")
        parts.append(w)
        n += len(w)
    text = "".join(parts)[:need]
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}).encode()
    assert abs(len(body) - size) < 16, len(body)
    return body


def item1(srv: Server, n_bodies: int, body_bytes: int, quiet_s: float) -> dict:
    port = srv.port
    stop = threading.Event()
    health: list[tuple[float, float]] = []  # (start time, latency)
    gaps: list[tuple[float, float]] = []  # (time of the later token, gap to the one before, same stream)
    tokens: list[tuple[float, int]] = []  # (arrival time, 1) of every streamed token
    first_token = threading.Event()

    def poll_health():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                request(port, "GET", "/health", timeout=120)
                health.append((t0, time.monotonic() - t0))
            except OSError:
                health.append((t0, float("inf")))
            time.sleep(0.02)

    def streams():
        while not stop.is_set():
            last = [None]

            def on_token(t):
                tokens.append((t, 1))
                if last[0] is not None:
                    gaps.append((t, t - last[0]))
                last[0] = t
                first_token.set()
            stream_completion(port, 400, on_token, stop)

    threads = [threading.Thread(target=poll_health, daemon=True), threading.Thread(target=streams, daemon=True)]
    for t in threads:
        t.start()
    first_token.wait(120)
    time.sleep(1.0)  # past the stream's first steps
    q0 = time.monotonic()
    time.sleep(quiet_s)
    q1 = b0 = time.monotonic()
    body = big_chat_body(body_bytes)
    posts = []
    for _ in range(n_bodies):
        t0 = time.monotonic()
        try:
            status, _, reply = request(port, "POST", "/v1/chat/completions", body, timeout=300)
            if status != 200:
                try:  # the error's code says how far the body got (a 400 for its length: parsed and tokenized)
                    status = f"{status} {json.loads(reply)['error'].get('code') or ''}".strip()
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass
        except OSError as e:
            status = type(e).__name__
        posts.append((status, time.monotonic() - t0))
    b1 = time.monotonic()
    stop.set()
    for t in threads:
        t.join(30)

    def window(xs, a, b):
        return [v for t, v in xs if a <= t <= b]

    out = {"body_bytes": len(body), "n_bodies": n_bodies,
           "body_status": sorted({str(s) for s, _ in posts}),
           "body_s_mean": statistics.mean(d for _, d in posts) if posts else None,
           "bodies_s": b1 - b0}
    for name, (a, b) in (("quiet", (q0, q1)), ("bodies", (b0, b1))):
        h = window(health, a, b)
        g = window(gaps, a, b)
        out[name] = {"health_n": len(h), "health_p50": _pct(h, 0.5), "health_p99": _pct(h, 0.99),
                     "health_max": max(h) if h else None,
                     "gap_n": len(g), "gap_p50": _pct(g, 0.5), "gap_p99": _pct(g, 0.99),
                     "gap_max": max(g) if g else None, "tokens_per_s": len(window(tokens, a, b)) / (b - a)}
    return out


# ---------------------------------------------------------------------------------------------------------------
# Item 2: SIGTERM and SIGINT with streams running


def _traceback_lines(text: str) -> tuple[int, int]:
    """(tracebacks, lines in them): from each 'Traceback' line to the exception line that closes it."""
    blocks = lines = 0
    inside = False
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            blocks += 1
            inside = True
            lines += 1
        elif inside:
            lines += 1
            if line and not line[0].isspace():
                inside = False
    return blocks, lines


def item2(repo: str, python: str, threads: int, workdir: str, sig: int, n_streams: int, max_tokens: int,
          exit_cap: float, ready_timeout: float) -> dict:
    srv = Server(repo, python, threads, workdir, f"sig{sig}")
    try:
        srv.wait_ready(ready_timeout)
        port = srv.port
        results: list[dict] = [None] * n_streams
        started = [threading.Event() for _ in range(n_streams)]

        def one(i):
            results[i] = stream_completion(port, max_tokens, lambda t: started[i].set(), timeout=exit_cap + 60)
            started[i].set()

        ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n_streams)]
        for t in ts:
            t.start()
        deadline = time.monotonic() + 180
        for e in started:
            e.wait(max(0.0, deadline - time.monotonic()))
        streaming = sum(1 for i, e in enumerate(started) if e.is_set() and results[i] is None)
        time.sleep(1.0)
        err_at = len(srv.stderr().splitlines())
        t_sig = time.monotonic()
        os.kill(srv.proc.pid, sig)

        time.sleep(0.5)  # a new request while shutting down
        try:
            status, headers, _ = request(port, "POST", "/v1/completions",
                                         json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode(),
                                         timeout=30)
            retry_after = {k.lower(): v for k, v in headers.items()}.get("retry-after")
            new_req = f"{status}" + (f" Retry-After: {retry_after}" if retry_after else " (no Retry-After)")
        except ConnectionRefusedError:
            new_req = "connection refused"
        except (OSError, http.client.HTTPException) as e:
            new_req = type(e).__name__

        try:
            code = srv.proc.wait(exit_cap)
            exit_s = time.monotonic() - t_sig
            exited = f"{exit_s:.1f}"
        except subprocess.TimeoutExpired:
            srv.close()
            code, exit_s, exited = None, None, f">{exit_cap:.0f} (killed)"
        for t in ts:
            t.join(10)
        ends = {"finished": 0, "error+[DONE]": 0, "error, no [DONE]": 0, "dropped": 0, "other": 0}
        for r in results:
            if r is None or r["dropped"] and not r["error"]:
                ends["dropped"] += 1
            elif r["error"]:
                ends["error+[DONE]" if r["done"] else "error, no [DONE]"] += 1
            elif r["done"] and r["finish"]:
                ends["finished"] += 1
            else:
                ends["other"] += 1
        after = "\n".join(srv.stderr().splitlines()[err_at:])
        tb, tb_lines = _traceback_lines(after)
        return {"streams": n_streams, "streaming_at_signal": streaming, "exit_code": code, "exit_s": exit_s,
                "exit": exited, "ends": ends, "new_request": new_req, "tracebacks": tb,
                "traceback_lines": tb_lines, "stderr_lines_after_signal": len(after.splitlines())}
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------------------------
# Item 10: LLM(tensor_parallel_size=N) from a script without a main guard


def item10(repo: str, python: str, workdir: str, cap: float, tp: int) -> dict:
    d = os.path.join(workdir, "tp_script")
    os.makedirs(d, exist_ok=True)
    script = os.path.join(d, "no_guard.py")
    with open(script, "w") as f:
        f.write("from kvinfer import LLM\n"
                f"llm = LLM(tensor_parallel_size={tp}, kv_cache_memory='16MiB', max_model_len=128)\n"
                "print('started')\n")
    p = _start([python, script], _env(repo), d, os.path.join(d, "stderr"))
    t0 = time.monotonic()
    try:
        code = p.wait(cap)
        wall = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        code, wall = None, None
    finally:
        _stop(p)
    with open(os.path.join(d, "stderr"), "rb") as f:
        err = f.read().decode("utf-8", "replace")
    last = next((ln for ln in reversed(err.splitlines()) if ln.strip()), "")
    # The failure the user reads is the last line; multiprocessing's own advice in a worker's traceback higher up
    # does not count. Still running at the cap, there is no failure message yet.
    names = None if code is None else ("__name__ ==" in last)
    return {"exit_code": code, "seconds": wall,
            "result": f"{wall:.1f} s, exit {code}" if code is not None else f">{cap:.0f} s (timed out)",
            "names_guard": names, "guard_anywhere_in_stderr": "__name__ ==" in err, "last_line": last[:300]}


# ---------------------------------------------------------------------------------------------------------------


def measure(repo: str, args, workdir: str) -> dict:
    rev = subprocess.run(["git", "-C", repo, "log", "-1", "--format=%h"], capture_output=True,
                         text=True).stdout.strip() or os.path.basename(repo)
    res = {"repo": repo, "commit": rev}
    items = set(args.items.split(","))
    if "1" in items:
        res["load_1"] = _load()
        srv = Server(repo, args.python, args.threads, workdir, "item1")
        try:
            srv.wait_ready(args.ready_timeout)
            res["item1"] = item1(srv, args.bodies, args.body_bytes, args.quiet_s)
        finally:
            srv.close()
    if "2" in items:
        res["load_2"] = _load()
        for name, sig in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
            res[name] = item2(repo, args.python, args.threads, workdir, sig, args.streams, args.max_tokens,
                              args.exit_cap, args.ready_timeout)
    if "10" in items:
        res["load_10"] = _load()
        res["item10"] = item10(repo, args.python, workdir, args.tp_timeout, args.tp)
        res["item10"]["tp"] = args.tp
    return res


def _ms(x):
    return "-" if x is None else ("inf" if x == float("inf") else f"{x * 1000:.0f}")


def rows(r: dict) -> list[tuple[str, str]]:
    out = [("commit", r["commit"])]
    if "item1" in r:
        i = r["item1"]
        out.append(("1: load avg (1/5/15 min) at start", r["load_1"]))
        for ph, label in (("quiet", "no bodies"), ("bodies", f"{i['n_bodies']} x {i['body_bytes'] / 1e6:.1f} MB")):
            p = i[ph]
            out.append((f"1: /health p50/p99/max ms, {label}",
                        f"{_ms(p['health_p50'])} / {_ms(p['health_p99'])} / {_ms(p['health_max'])} "
                        f"(n={p['health_n']})"))
            out.append((f"1: token gap p50/p99/max ms, {label}",
                        f"{_ms(p['gap_p50'])} / {_ms(p['gap_p99'])} / {_ms(p['gap_max'])} (n={p['gap_n']})"))
            out.append((f"1: stream tokens/s received, {label}", f"{p['tokens_per_s']:.1f}"))
        out.append(("1: body answer, mean s per body", f"{','.join(i['body_status'])}, {i['body_s_mean']:.2f}"))
    for name, label in (("sigterm", "SIGTERM"), ("sigint", "SIGINT")):
        if name in r:
            s = r[name]
            if name == "sigterm":
                out.append(("2: load avg at start", r["load_2"]))
            out.append((f"2: {label}: exit code, s to exit", f"{s['exit_code']}, {s['exit']}"))
            e = s["ends"]
            out.append((f"2: {label}: {s['streams']} streams ({s['streaming_at_signal']} streaming at the signal) ended",
                        ", ".join(f"{v} {k}" for k, v in e.items() if v) or "-"))
            out.append((f"2: {label}: new request meanwhile", s["new_request"]))
            out.append((f"2: {label}: stderr after it: tracebacks (their lines), all lines",
                        f"{s['tracebacks']} ({s['traceback_lines']}), {s['stderr_lines_after_signal']}"))
    if "item10" in r:
        t = r["item10"]
        out.append(("10: load avg at start", r["load_10"]))
        out.append((f"10: TP={t['tp']} without main guard fails after", t["result"]))
        out.append(("10: its last stderr line names the guard",
                    {True: "yes", False: "no", None: "- (no failure yet)"}[t["names_guard"]]))
    return out


def table(results: list[dict]) -> str:
    cols = [rows(r) for r in results]
    labels = [k for k, _ in cols[0]]
    w0 = max(len(k) for k in labels)
    ws = [max(len(v) for _, v in c) for c in cols]
    lines = []
    for j, k in enumerate(labels):
        lines.append("| " + k.ljust(w0) + " | " + " | ".join(c[j][1].ljust(w) for c, w in zip(cols, ws)) + " |")
        if j == 0:
            lines.append("|" + "-" * (w0 + 2) + "|" + "|".join("-" * (w + 2) for w in ws) + "|")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", action="append", required=True,
                    help="checkout to measure (its kvinfer runs with PYTHONPATH=REPO); repeat for more columns")
    ap.add_argument("--python", default=sys.executable, help="interpreter with kvinfer's dependencies")
    ap.add_argument("--items", default="1,2,10", help="which items to measure (default 1,2,10)")
    ap.add_argument("--threads", type=int, default=2, help="serve --threads (default 2)")
    ap.add_argument("--bodies", type=int, default=10, help="item 1: chat bodies posted back to back")
    ap.add_argument("--body-bytes", type=int, default=3_900_000,
                    help="item 1: size of each body, under the server's 4 MiB limit so it is parsed")
    ap.add_argument("--quiet-s", type=float, default=5.0, help="item 1: seconds measured with no bodies first")
    ap.add_argument("--streams", type=int, default=20, help="item 2: streams open at the signal")
    ap.add_argument("--max-tokens", type=int, default=4000, help="item 2: max_tokens of each stream")
    ap.add_argument("--exit-cap", type=float, default=90, help="item 2: seconds to wait for the exit, then kill")
    ap.add_argument("--tp", type=int, default=3,
                    help="item 10: tensor_parallel_size (the built-in model's 9 heads and 3 KV heads take 3, not 2)")
    ap.add_argument("--tp-timeout", type=float, default=120, help="item 10: seconds before giving up")
    ap.add_argument("--ready-timeout", type=float, default=600,
                    help="seconds for a server to answer /health (the first start compiles the kernels)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGHUP, _leave)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="issue46-") as workdir:
            for repo in args.repo:
                repo = os.path.abspath(repo)
                print(f"measuring {repo} ...", file=sys.stderr, flush=True)
                results.append(measure(repo, args, workdir))
    finally:
        _kill_all()
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
