"""Where shards live: local paths, or URLs through fsspec (s3://, gs://, az://, http(s)://, ...).

Remote shards are read in large blocks of whole records, prefetched ahead and kept in a local
cache folder that the DataLoader workers of a node share (each block is downloaded once per
node). Every remote call is bounded by a timeout and retried with backoff; the last error names
the object and the byte range.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import random
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

# Errors that another try cannot fix: the object is not there, or we may not read it.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, NotImplementedError)
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "http": "http"}
# Byte units for sizes given as text (block_size, cache_limit, pack --shard-size).
BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class StorageError(OSError):
    """A remote read or write failed after its retries; the message names the object and byte range."""


def _refused(error: Exception) -> bool:
    """An HTTP answer that a retry would only repeat: a 4xx status other than timeout and too-many-requests."""
    status = getattr(error, "status", None)
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)


def is_url(path: str | os.PathLike) -> bool:
    """True for `scheme://...` other than `file://` (local paths, plain or as file:// URLs, read through mmap)."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: str | os.PathLike) -> Path:
    """A local path, from a plain path or a file:// URL."""
    text = str(path)
    return Path(text[len("file://") :]) if text.startswith("file://") else Path(text)


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def parse_bytes(value: int | str, what: str) -> int:
    """`8MB`, `256MiB`, `1GB` or a number of bytes; raises naming `what` and the accepted forms."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    text = str(value).strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :].strip()
    try:
        size = float(number) * BYTE_UNITS[unit or "b"]
    except (ValueError, KeyError):
        size = 0
    if isinstance(value, bool) or size < 1:
        raise ValueError(
            f"invalid {what}={value!r}; accepted: bytes as a number or with a unit "
            "(B, KB, MB, GB, KiB, MiB, GiB), e.g. 8MB"
        )
    return int(size)


class Store:
    """One fsspec file system for a URL's protocol, made afresh in each process (fsspec's async ones are not fork-safe).

    `storage_options` go to fsspec as its libraries take them (credentials, endpoint_url, ...).
    Each call is bounded by `timeout` seconds and tried `retries` more times with exponential backoff.
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, retries: int = 5, timeout: float = 60.0
    ):
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"invalid retries={retries!r}; accepted: an integer >= 0")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"invalid timeout={timeout!r}; accepted: seconds > 0")
        self.protocol = str(url).split("://", 1)[0].lower()
        self.storage_options = dict(storage_options or {})
        self.retries, self.timeout = retries, float(timeout)
        self._fs: Any = None
        self._pid = -1
        _ = self.fs  # fail here, with the extra to install, rather than in a loader worker

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            try:
                import fsspec
            except ImportError:
                raise ImportError(self._missing()) from None
            try:
                self._fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options)
            except ImportError as error:
                raise ImportError(f"{self._missing()} ({error})") from None
            except ValueError as error:  # an unknown protocol
                raise ValueError(f"cannot open {self.protocol}:// URLs: {error}") from None
            self._pid = os.getpid()
        return self._fs

    def _missing(self) -> str:
        extra = _EXTRAS.get(self.protocol.rstrip("s") if self.protocol == "https" else self.protocol, "remote")
        return f"reading {self.protocol}:// URLs needs fsspec and its backend: pip install 'trainaccel[{extra}]'"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"], state["_pid"] = None, -1  # each process opens its own
        return state

    def call(self, method: str, *args: Any, what: str, **kwargs: Any) -> Any:
        """`fs.<method>(*args)` bounded by the timeout and retried; raises StorageError naming `what`."""
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                return self._bounded(method, *args, **kwargs)
            except _PERMANENT:
                raise
            except Exception as error:  # network errors come as many types (aiohttp, botocore, OSError)
                if _refused(error):
                    raise StorageError(errno.EACCES, f"{what}: {type(error).__name__}: {error}") from error
                if attempt == self.retries:
                    raise StorageError(
                        errno.EIO,
                        f"{what}: failed {attempt + 1} times over {time.monotonic() - started:.1f} s, "
                        f"last: {type(error).__name__}: {error}",
                    ) from error
                time.sleep(min(0.25 * 2**attempt, 8.0) * random.uniform(0.75, 1.25))
        raise AssertionError("unreachable")

    def _bounded(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fs = self.fs
        if getattr(fs, "async_impl", False):  # the coroutine itself is cancelled at the deadline
            import fsspec.asyn

            return fsspec.asyn.sync(fs.loop, getattr(fs, f"_{method}"), *args, timeout=self.timeout, **kwargs)
        return getattr(fs, method)(*args, **kwargs)

    def read(self, url: str, start: int | None = None, end: int | None = None, about: str = "") -> bytes:
        """The object's bytes [start, end), or all of it; `about` adds to the error message (which records)."""
        span = "" if start is None else f" bytes {start}-{end}"
        return self.call("cat_file", url, start=start, end=end, what=f"reading {url}{span}{about}")

    def exists(self, url: str) -> bool:
        return bool(self.call("exists", url, what=f"looking for {url}"))

    def glob(self, pattern: str) -> list[str]:
        found = self.call("glob", pattern, what=f"listing {pattern}")
        return sorted(f"{self.protocol}://{p}" if "://" not in p else p for p in found)

    def put(self, local: Path, url: str) -> None:
        self.call("put_file", str(local), url, what=f"uploading {local} to {url}")

    def write_bytes(self, url: str, data: bytes) -> None:
        self.call("pipe_file", url, data, what=f"writing {url}")

    def remove(self, url: str) -> None:
        try:
            self.call("rm_file", url, what=f"removing {url}")
        except FileNotFoundError:
            pass


def plan_blocks(index: np.ndarray, block_size: int) -> np.ndarray:
    """The first record of each block: consecutive records, at least `block_size` bytes each (the last may be less)."""
    starts, filled = [0], 0
    for number, size in enumerate(index[:, 1].tolist()):
        if filled >= block_size:
            starts.append(number)
            filled = 0
        filled += size
    return np.array(starts if len(index) else [], dtype=np.int64)


class BlockCache:
    """A folder of downloaded blocks that the processes of one node share, bounded by evicting whole shards.

    Without `folder`, a temporary folder is made and removed when the object that made it is
    collected (in the process that made it). Blocks are written once under a lock file and
    renamed into place; readers map them. A shard's other blocks are fetched ahead once one is read,
    on `prefetch` background threads per process (0: none).
    """

    def __init__(self, folder: str | os.PathLike | None = None, limit: int | str = "1GB", prefetch: int = 2):
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"invalid prefetch={prefetch!r}; accepted: an integer >= 0 (threads reading ahead)")
        self.limit = parse_bytes(limit, "cache_limit")
        self.prefetch = prefetch
        if folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="trainaccel-blocks-"))
            self._cleanup = weakref.finalize(self, _remove_if_owner, self.folder, os.getpid())
        else:
            self.folder = Path(folder)
            self.folder.mkdir(parents=True, exist_ok=True)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._maps: OrderedDict[Path, mmap.mmap | bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: set[Path] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "limit": self.limit, "prefetch": self.prefetch}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # a forked loader worker: nothing of the parent's threads or maps
            self._reset()

    def block(self, key: str, number: int, fetch: Any, rest: Any) -> memoryview:
        """Block `number` of shard `key`, fetched with `fetch()` when no process of this node has it yet.

        When this process maps a block for the first time, the blocks `rest()` lists (key, number,
        fetch) are fetched ahead: the shard's others, since a sampler's window reads a shard's
        records in random order, then the next shard's.
        """
        self._check_process()
        path = self.folder / key / f"block-{number:06d}"
        with self._lock:
            data = self._maps.get(path)
            if data is not None:
                self._maps.move_to_end(path)
        if data is None:
            data = self._load(path, fetch, wait=True)
            with self._lock:
                self._maps[path] = data
                while len(self._maps) > 64:  # mapped blocks per process; evicted files stay valid while mapped
                    self._maps.popitem(last=False)
            if self.prefetch:
                for later_key, later, later_fetch in rest():
                    self._read_ahead(self.folder / later_key / f"block-{later:06d}", later_fetch)
        return memoryview(data)

    def _read_ahead(self, path: Path, fetch: Any) -> None:
        with self._lock:
            if path in self._maps or path in self._ahead or path.exists():
                return
            self._ahead.add(path)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max(1, self.prefetch), thread_name_prefix="trainaccel-prefetch")
        self._pool.submit(self._ahead_task, path, fetch)

    def _ahead_task(self, path: Path, fetch: Any) -> None:
        try:
            self._load(path, fetch, wait=False)
        except Exception:  # a read-ahead that fails is retried, and reported, by the read that needs it
            pass
        finally:
            with self._lock:
                self._ahead.discard(path)

    def _load(self, path: Path, fetch: Any, wait: bool) -> mmap.mmap | bytes | None:
        """The block's contents (None unless `wait`), downloading it under its lock when no process has yet."""
        data = None
        for _ in range(8):  # another process may evict the shard's folder at any moment: start over
            try:
                if path.exists():
                    return self._open(path) if wait else None
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(f"{path}.lock", "a+b") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
                    except BlockingIOError:  # another process is fetching it
                        return None
                    if path.exists():
                        continue
                    if data is None:
                        data = fetch()
                    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
                    tmp.write_bytes(data)
                    os.replace(tmp, path)
                self._evict(keep=path.parent)
                return data if wait else None
            except FileNotFoundError:
                continue
        if not wait:
            return None
        return data if data is not None else fetch()  # the cache keeps losing it: serve it from memory

    def _open(self, path: Path) -> mmap.mmap | bytes:
        with open(path, "rb") as f:
            os.utime(path.parent)  # the shard's last use, for eviction
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""

    def _evict(self, keep: Path) -> None:
        """Remove the least recently used shards' blocks until the folder is within the limit."""
        shards = []
        total = 0
        for key in os.scandir(self.folder):
            if not key.is_dir():
                continue
            for shard in _scandir(key.path):
                try:
                    size = sum(e.stat().st_size for e in _scandir(shard.path) if e.is_file())
                    shards.append((shard.stat().st_mtime, shard.path, size))
                    total += size
                except FileNotFoundError:  # evicted by another process meanwhile
                    continue
        for _, folder, size in sorted(shards):
            if total <= self.limit:
                break
            if Path(folder) != keep:
                shutil.rmtree(folder, ignore_errors=True)
                total -= size

    def close(self) -> None:
        """Stop read-ahead and unmap this process's blocks (the folder stays)."""
        if self._pid == os.getpid() and self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._reset()


def _scandir(folder: str) -> list[os.DirEntry]:
    try:
        return [e for e in os.scandir(folder) if not e.name.startswith(".")]
    except FileNotFoundError:
        return []


def _remove_if_owner(folder: Path, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


class RemoteSource:
    """A remote shard's bytes, served from its blocks in a BlockCache: the source behind a remote RecordFile."""

    def __init__(self, url: str, store: Store, cache: BlockCache, index: np.ndarray, block_size: int, tag: str = ""):
        self.url, self.store, self.cache, self.index = url, store, cache, index
        self.next: RemoteSource | None = None  # the shard read after this one, from the sampler's plan
        self.starts = plan_blocks(index, block_size)
        end = int(index[-1, 0] + index[-1, 1]) if len(index) else 0
        # The cache key changes when the object does (size, or the manifest's checksum): no stale blocks.
        digest = hashlib.sha256(f"{url}|{end}|{tag}".encode()).hexdigest()[:16]
        self.key = f"{digest}/{url.rstrip('/').rsplit('/', 1)[-1]}"

    def _span(self, block: int) -> tuple[int, int]:
        first = int(self.starts[block])
        last = int(self.starts[block + 1]) - 1 if block + 1 < len(self.starts) else len(self.index) - 1
        return int(self.index[first, 0]), int(self.index[last, 0] + self.index[last, 1])

    def _fetcher(self, block: int) -> Any:
        start, end = self._span(block)
        first = int(self.starts[block])
        last = int(self.starts[block + 1]) - 1 if block + 1 < len(self.starts) else len(self.index) - 1
        about = f" (records {first} to {last})"

        def fetch() -> bytes:
            data = self.store.read(self.url, start, end, about)
            if len(data) != end - start:
                raise StorageError(
                    errno.EIO,
                    f"reading {self.url} bytes {start}-{end}{about}: got {len(data)} bytes, "
                    f"expected {end - start}; the object is shorter than its index says",
                )
            return data

        return fetch

    def read(self, number: int, offset: int, size: int) -> memoryview:
        """The framed bytes of record `number` (at `offset`, `size` long)."""
        block = int(np.searchsorted(self.starts, number, side="right")) - 1

        def rest() -> list[tuple[str, int, Any]]:
            own = [(self.key, b, self._fetcher(b)) for b in [*range(block + 1, len(self.starts)), *range(block)]]
            following = self.next  # then the next shard of the plan, so that its first read does not wait
            after = (
                [(following.key, b, following._fetcher(b)) for b in range(len(following.starts))] if following else []
            )
            return own + after

        data = self.cache.block(self.key, block, self._fetcher(block), rest)
        base = self._span(block)[0]
        return data[offset - base : offset - base + size]
