"""The persistent KV tiers: a directory of block files (LRU within a quota, shared safely by processes) and Redis."""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

from kvinfer.kv.tiers import OnceLog, Tier, decode_record, encode_record

SUFFIX = ".kvb"


class DiskTier(Tier):
    """One file per block, `<fingerprint>-<block hash>.kvb`: a header naming the fingerprint and the block, the
    payload's CRC-32, the payload. Written to a temporary name and renamed into place, so a reader (this process or
    another sharing the directory) sees a whole file or none. Over the quota, the least recently used files go
    first (a hit touches its file's mtime); files other processes wrote are found by rescanning the directory."""

    name = "disk"
    persistent = True
    RESCAN_SECONDS = 5.0

    def __init__(self, directory: str | Path, quota: int, fp: bytes, payload_bytes: int):
        super().__init__()
        self.dir = Path(directory)
        self.quota = quota
        self.fp = fp
        self.payload_bytes = payload_bytes
        self.prefix = fp.hex()[:32] + "-"
        self.label = f"disk {self.dir}"
        self._log = OnceLog("disk")
        self._lock = threading.Lock()
        self.index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self.used = 0
        self._scanned = 0.0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._rescan()

    def held(self):
        """Block files in the directory (this process's and others' it has seen), and their bytes."""
        with self._lock:
            return len(self.index), self.used

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{self.prefix}{key.hex()}{SUFFIX}"

    def _rescan(self) -> None:
        entries = []
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    if e.name.endswith(SUFFIX):
                        try:
                            st = e.stat()
                        except FileNotFoundError:
                            continue
                        entries.append((st.st_mtime, e.name, st.st_size))
        except OSError as e:
            self.stats.errors += 1
            self._log("scan", "cannot list %s: %s", self.dir, e)
            return
        entries.sort()
        self.index = OrderedDict((name, size) for _, name, size in entries)
        self.used = sum(self.index.values())
        self._scanned = time.monotonic()

    def get(self, key: bytes):
        p = self._path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.stats.errors += 1
            self._log("read", "cannot read %s: %s", p, e)
            return None
        payload, why = decode_record(data, self.fp, key, self.payload_bytes)
        if payload is None:
            self.stats.errors += 1
            self._log(why, "%s is %s", p, why)
            self._drop(p.name)
            return None
        try:
            os.utime(p)  # most recently used
        except OSError:
            pass
        with self._lock:
            if p.name in self.index:
                self.index.move_to_end(p.name)
        return payload

    def contains(self, key: bytes) -> bool:
        return self._path(key).exists()

    def _drop(self, name: str) -> None:
        try:
            (self.dir / name).unlink()
        except OSError:
            pass
        with self._lock:
            self.used -= self.index.pop(name, 0)

    def put(self, key: bytes, payload) -> None:
        p = self._path(key)
        if p.exists():
            return
        record = encode_record(self.fp, key, payload)
        n = len(record)
        if n > self.quota:
            return
        with self._lock:
            if self.used + n > self.quota and time.monotonic() - self._scanned > self.RESCAN_SECONDS:
                self._rescan()  # other processes' files, and files they removed
            while self.used + n > self.quota and self.index:
                name, size = self.index.popitem(last=False)
                self.used -= size
                try:
                    (self.dir / name).unlink()
                    self.stats.evictions += 1
                except OSError:
                    pass
        tmp = self.dir / f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(record)
            os.replace(tmp, p)
        except OSError as e:
            self.stats.errors += 1
            self._log("write", "cannot write %s: %s", p, e)
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        with self._lock:
            self.index[p.name] = n
            self.used += n
        self.stats.bytes_out += n


class RedisTier(Tier):
    """Blocks in a Redis server under `kvinfer:<fingerprint>:<block hash>` (Redis's own maxmemory policy bounds
    it), shared by every engine of the same model. Each call has a short socket timeout; after a failure the tier
    rests for a few seconds, so a down or slow server costs a request at most one timeout, never a failure."""

    name = "redis"
    persistent = True
    batch = 16
    REST_SECONDS = 2.0

    def __init__(self, url: str, fp: bytes, payload_bytes: int, timeout: float = 0.25):
        super().__init__()
        self.url = url
        self.fp = fp
        self.payload_bytes = payload_bytes
        self.label = f"redis {url}"
        self.prefix = b"kvinfer:" + fp.hex().encode() + b":"
        self._log = OnceLog("redis")
        self._down_until = 0.0
        self.client = None
        try:
            import redis

            self._errors = (redis.RedisError, OSError)
            self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                               retry_on_timeout=False)
        except ImportError:
            self._log("import", "the redis package is not installed (pip install 'kvinfer[redis]')")
        except ValueError as e:
            self._log("url", "bad URL %s: %s", url, e)

    def _usable(self) -> bool:
        return self.client is not None and time.monotonic() >= self._down_until

    def _fail(self, e: BaseException) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.REST_SECONDS
        self._log("down", "%s unreachable or slow: %s", self.url, e)

    def get_many(self, keys: Sequence[bytes]) -> list:
        if not self._usable():
            return [None] * len(keys)
        try:
            values = self.client.mget([self.prefix + k for k in keys])
        except self._errors as e:
            self._fail(e)
            return [None] * len(keys)
        out = []
        for k, v in zip(keys, values):
            payload = None
            if v is not None:
                payload, why = decode_record(v, self.fp, k, self.payload_bytes)
                if payload is None:
                    self.stats.errors += 1
                    self._log(why, "the value of block %s is %s", k.hex(), why)
            out.append(payload)
        return out

    def get(self, key: bytes):
        return self.get_many([key])[0]

    def contains(self, key: bytes) -> bool:
        if not self._usable():
            return False
        try:
            return bool(self.client.exists(self.prefix + key))
        except self._errors as e:
            self._fail(e)
            return False

    def put(self, key: bytes, payload) -> None:
        if not self._usable():
            return
        record = encode_record(self.fp, key, payload)
        try:
            self.client.set(self.prefix + key, record)
        except self._errors as e:
            self._fail(e)
            return
        self.stats.bytes_out += len(record)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass


def open_disk(directory: str, quota: int, fp: bytes, payload_bytes: int) -> DiskTier:
    """The disk tier; a directory that cannot be created or read at start-up is refused naming it (once running, a
    failing disk is logged and its blocks recomputed: a tier never stops a running engine)."""
    try:
        return DiskTier(directory, quota, fp, payload_bytes)
    except OSError as e:
        from kvinfer.errors import ValidationError

        raise ValidationError("kv_cache_dir", directory, f"cannot use it: {e.strerror or e}") from None
