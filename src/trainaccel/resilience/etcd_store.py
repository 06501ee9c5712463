"""The job's store on an etcd cluster: a c10d `Store` that outlives the loss of any minority of its members.

torchrun keeps the job's store in one process on the first node, so losing that node ends every worker. etcd
replicates its keys on every member with Raft: with 3 members any one may go, the first node's included. This store
speaks etcd's v3 API through its HTTP gateway (etcd3gw, OpenStack's client; no v2 API, which etcd 3.6 removed) and
gives c10d's whole interface (Gloo's rendezvous, torch's barriers, trainaccel's heartbeats and roll call) over it:

- every request goes to one member and moves to the next when that member does not answer, for up to
  `unavailable_s`; then `StoreUnavailable` (a DistNetworkError, as a TCPStore's lost server) names the store;
- reads are linearizable (a member cut off from the majority answers nothing rather than old values);
- `add` and `append` are compare-and-swap loops whose every write carries a receipt, so that a write whose reply was
  lost with a member is never applied twice;
- `wait` watches the key (one stream per waiter, not a poll per rank).

Keys live under `/trainaccel/<job>/`: jobs sharing a cluster do not see each other's keys.
"""

from __future__ import annotations

import base64
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainaccel.config import STORE_SCHEME, parse_endpoints, store_url

# How long a request may find no member that answers before the store is declared lost: a leader election takes
# about a second (etcd's default election timeout), a member's restart a few; three heartbeats of the job's hang
# judge is the most a worker waits for its store anyway.
UNAVAILABLE_S = 15.0
# One request to one member: to connect (a dead host's SYN is otherwise retried for two minutes), then to answer
# (etcd itself gives up on a proposal after about 5 s without a leader and says so).
CONNECT_S = 2.0
REQUEST_S = 8.0
# A watch is renewed this often, so that a waiter whose member died moves to a live one.
WATCH_SLICE_S = 2.0
# etcd's default --max-txn-ops: the most operations in one transaction.
TXN_OPS = 128
# Receipts of `add` and `append` (a write's proof, read only after a reply was lost) live this long.
RECEIPT_TTL_S = 120


class StoreUnavailable(dist.DistNetworkError):
    """No member of the store answered for `unavailable_s`: as a TCPStore whose server is gone, not a wait's timeout
    (DistStoreError), which callers take for "not there yet"."""


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):  # c10d hands a value as a list of byte values on some paths
        return bytes(value)
    raise TypeError(f"a store value must be bytes or str, not {type(value).__name__}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range end for a prefix)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


def _session() -> Any:
    """A requests session whose every request has a connect timeout (etcd3gw's watch passes none)."""
    import requests  # (etcd3gw's own dependency: imported only where the store is used)

    class Session(requests.Session):
        def request(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = (CONNECT_S, None)
            return super().request(*args, **kwargs)

    return Session()


class EtcdStore(dist.Store):
    """c10d's Store over an etcd cluster's v3 API, keys under `/trainaccel/<job>/`; see the module docstring."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]] | str,
        job: str,
        timeout: timedelta = timedelta(seconds=300),
        unavailable_s: float = UNAVAILABLE_S,
    ) -> None:
        super().__init__()
        try:
            import etcd3gw  # noqa: F401
        except ImportError:
            raise ImportError("the job's store on etcd needs etcd3gw: pip install 'trainaccel[etcd]'") from None
        if isinstance(endpoints, str):
            endpoints = parse_endpoints(endpoints)
        if not endpoints:
            raise ValueError("the job's store on etcd needs at least one member's address")
        if not job or "/" in job:
            raise ValueError(f"invalid job name {job!r} for the store; accepted: a non-empty name without '/'")
        self.endpoints = [(str(host), int(port)) for host, port in endpoints]
        self.job = job
        self.unavailable_s = unavailable_s
        self.set_timeout(timeout)
        self._root = f"/trainaccel/{job}/".encode()
        self._kv = self._root + b"kv/"
        self._local = threading.local()  # each thread its own HTTP sessions (requests' are not thread-safe)
        self._member = random.randrange(len(self.endpoints))  # spread the job's clients over the members
        self._lease: tuple[int, float] | None = None  # the receipts' lease: (id, when it was granted)
        self._lease_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EtcdStore({self.describe()}, job={self.job!r})"

    def describe(self) -> str:
        """What a message names: the members' addresses."""
        return "etcd at " + self.url.removeprefix(STORE_SCHEME)

    @property
    def url(self) -> str:
        """The store's address as `--store` takes it."""
        return store_url(self.endpoints)

    # --- transport: one member at a time, the next when it does not answer ---

    def _client(self, member: int) -> Any:
        import etcd3gw

        clients = self._local.__dict__.setdefault("clients", {})
        if member not in clients:
            host, port = self.endpoints[member]
            clients[member] = etcd3gw.Etcd3Client(
                host=host, port=port, timeout=(CONNECT_S, REQUEST_S), api_path="/v3/", session=_session()
            )
        return clients[member]

    def _retrying(self, attempt: Callable[[Any], Any]) -> Any:
        """`attempt(client)` on one member, then the next while none answers, up to `unavailable_s` in all."""
        from etcd3gw import exceptions

        deadline = time.monotonic() + self.unavailable_s
        pause = 0.05
        while True:
            member = self._member
            try:
                return attempt(self._client(member))
            except exceptions.Etcd3Exception as error:
                last = error
            if time.monotonic() > deadline:
                detail = (str(last.detail_text or "") or str(last)).strip().replace("\n", " ")[:200]
                raise StoreUnavailable(
                    f"the job's store ({self.describe()}) did not answer for {self.unavailable_s:g} s: a majority "
                    f"of its members is lost or cut off ({type(last).__name__}: {detail})"
                )
            if self._member == member:  # another thread may have moved on already
                self._member = (member + 1) % len(self.endpoints)
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause = min(pause * 2, 1.0)

    def _post(self, path: str, payload: dict) -> dict:
        return self._retrying(lambda client: client.post(client.get_url(path), json=payload))

    def _key(self, key: str | bytes) -> bytes:
        return self._kv + (key if isinstance(key, bytes) else key.encode())

    def _range(self, key: bytes, **options: Any) -> dict:
        return self._post("/kv/range", {"key": _b64(key), **options})

    def _txn(self, txn: dict) -> dict:
        return self._post("/kv/txn", txn)

    def _receipt_lease(self) -> int:
        """The lease receipts are written under, renewed well before it ends."""
        with self._lease_lock:
            if self._lease is None or time.monotonic() - self._lease[1] > RECEIPT_TTL_S / 2:
                granted = self._post("/lease/grant", {"TTL": RECEIPT_TTL_S, "ID": 0})
                self._lease = (int(granted["ID"]), time.monotonic())
            return self._lease[0]

    # --- c10d's Store ---

    def set(self, key: str, value: Any) -> None:
        self._post("/kv/put", {"key": _b64(self._key(key)), "value": _b64(_bytes(value))})

    def get(self, key: str) -> bytes:
        found = self._range(self._key(key)).get("kvs")
        if found:
            return _unb64(found[0].get("value"))
        self.wait([key])
        return _unb64(self._range(self._key(key))["kvs"][0].get("value"))

    def _update(self, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        """Apply `change` (current value, None if missing -> new value) atomically; the new value.

        Each write carries a receipt and is made only while its receipt is missing: a write retried after its
        reply was lost with a member finds the receipt instead of applying twice.
        """
        full = self._key(key)
        receipt = self._root + b"receipt/" + uuid.uuid4().hex.encode()
        lease = self._receipt_lease()
        unwritten = {"key": _b64(receipt), "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        while True:
            kvs = self._range(full).get("kvs")
            new = change(_unb64(kvs[0].get("value")) if kvs else None)
            if kvs:
                same = {"key": _b64(full), "target": "MOD", "result": "EQUAL", "mod_revision": kvs[0]["mod_revision"]}
            else:
                same = {"key": _b64(full), "target": "CREATE", "result": "EQUAL", "create_revision": 0}
            result = self._txn(
                {
                    "compare": [same, unwritten],
                    "success": [
                        {"request_put": {"key": _b64(full), "value": _b64(new)}},
                        {"request_put": {"key": _b64(receipt), "value": _b64(new), "lease": lease}},
                    ],
                    "failure": [{"request_range": {"key": _b64(receipt)}}],
                }
            )
            if result.get("succeeded"):
                return new
            written = result["responses"][0]["response_range"].get("kvs")
            if written:  # applied by an attempt whose reply was lost
                return _unb64(written[0].get("value"))
            time.sleep(random.uniform(0, 0.01))  # another writer came first: read again

    def add(self, key: str, amount: int) -> int:
        def change(current: bytes | None) -> bytes:
            return str(int(current or b"0") + amount).encode()

        return int(self._update(key, change))

    def append(self, key: str, value: Any) -> None:
        extra = _bytes(value)
        self._update(key, lambda current: (current or b"") + extra)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """TCPStore's semantics: set `desired` if the value is `expected` (or missing and `expected` empty);
        return the value now (`expected` when the key is missing and `expected` is not empty, as TCPStore does)."""
        expected, desired = _bytes(expected), _bytes(desired)
        full = self._key(key)
        if expected:
            compare = {"key": _b64(full), "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        else:
            compare = {"key": _b64(full), "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        result = self._txn(
            {
                "compare": [compare],
                "success": [{"request_put": {"key": _b64(full), "value": _b64(desired)}}],
                "failure": [{"request_range": {"key": _b64(full)}}],
            }
        )
        if result.get("succeeded"):
            return desired
        kvs = result["responses"][0]["response_range"].get("kvs")
        return _unb64(kvs[0].get("value")) if kvs else expected

    def check(self, keys: list[str]) -> bool:
        compares = [
            {"key": _b64(self._key(key)), "target": "CREATE", "result": "GREATER", "create_revision": 0} for key in keys
        ]
        return all(
            self._txn({"compare": compares[i : i + TXN_OPS], "success": [], "failure": []}).get("succeeded", False)
            for i in range(0, len(compares), TXN_OPS)
        )

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        from etcd3gw import exceptions

        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        for key in keys:
            full = self._key(key)
            while True:
                found = self._range(full, count_only=True)
                if int(found.get("count", 0)):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(
                        f"waiting for key {key!r} in the job's store ({self.describe()}) timed out after {limit:g} s"
                    )
                revision = int(found["header"]["revision"]) + 1  # nothing written since is missed
                try:
                    self._client(self._member).watch_once(
                        full, timeout=min(left, WATCH_SLICE_S), start_revision=revision
                    )
                except exceptions.WatchTimedOut:
                    pass
                except Exception:  # the member went: the next read moves on  # noqa: BLE001
                    time.sleep(0.05)

    def delete_key(self, key: str) -> bool:
        return int(self._post("/kv/deleterange", {"key": _b64(self._key(key))}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        return int(self._range(self._kv, range_end=_b64(_prefix_end(self._kv)), count_only=True).get("count", 0))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        values = []
        for i in range(0, len(keys), TXN_OPS):
            ranges = [{"request_range": {"key": _b64(self._key(key))}} for key in keys[i : i + TXN_OPS]]
            result = self._txn({"compare": [], "success": ranges, "failure": []})
            for response in result["responses"]:
                values.append(_unb64(response["response_range"]["kvs"][0].get("value")))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        puts = [
            {"request_put": {"key": _b64(self._key(key)), "value": _b64(_bytes(value))}}
            for key, value in zip(keys, values, strict=True)
        ]
        for i in range(0, len(puts), TXN_OPS):
            self._txn({"compare": [], "success": puts[i : i + TXN_OPS], "failure": []})

    def clone(self) -> EtcdStore:
        return EtcdStore(self.endpoints, self.job, self.timeout, self.unavailable_s)
