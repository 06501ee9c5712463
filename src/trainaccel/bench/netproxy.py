"""A TCP proxy that adds latency: a remote store's round trips on loopback, where the kernel has no netem.

Every chunk is forwarded `delay` seconds after it arrived, in each direction, so a request and
its answer take 2 x `delay` more (order and bytes unchanged). `refuse(n)` cuts the open
connections and the next `n` as they open, to test retries. Runs on its own thread, or as
`python -m trainaccel.bench.netproxy --upstream HOST:PORT --delay-ms 10`.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time


class DelayProxy:
    """Forward 127.0.0.1:`port` to `upstream`, delaying each direction by `delay` seconds."""

    def __init__(self, upstream: tuple[str, int], delay: float = 0.0, port: int = 0, host: str = "127.0.0.1"):
        if delay < 0:
            raise ValueError(f"invalid delay={delay!r}; accepted: seconds >= 0")
        self.upstream, self.delay, self.host, self.port = upstream, delay, host, port
        self.connections = 0  # accepted, refused ones included
        self._refuse = 0
        self._open: set[asyncio.BaseTransport] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def refuse(self, count: int) -> None:
        """Cut every open connection, and the next `count` as soon as they open."""
        self._refuse = count
        if self._loop is not None:
            for transport in list(self._open):
                self._loop.call_soon_threadsafe(transport.abort)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=512)

        async def forward() -> None:
            while True:
                due, chunk = await queue.get()
                if chunk is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(forward())
        try:
            while chunk := await reader.read(1 << 20):  # large reads: fewer Python-level hops per byte
                await queue.put((time.monotonic() + self.delay, chunk))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put((0.0, None))
            try:
                await sender
            except (ConnectionError, OSError):
                pass
            try:
                writer.close()
            except (ConnectionError, OSError, RuntimeError):
                pass

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self._refuse > 0:
            self._refuse -= 1
            client_writer.transport.abort()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.transport.abort()
            return
        ends = (client_writer.transport, server_writer.transport)
        self._open.update(ends)
        try:
            await asyncio.gather(self._pump(client_reader, server_writer), self._pump(server_reader, client_writer))
        finally:
            self._open.difference_update(ends)

    async def _serve(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        await self._stop.wait()
        self._server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # the connections' pumps: ended here, so nothing is left pending in a closed loop
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self._server.wait_closed()

    def start(self) -> DelayProxy:
        """Serve on a daemon thread; returns once the port is open."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete,
            args=(self._serve(ready),),
            name="trainaccel-netproxy",
            daemon=True,
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"the proxy to {self.upstream} did not open a port in 10 s")
        return self

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainaccel.bench.netproxy", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--port", type=int, default=0, help="port to listen on, 127.0.0.1 (default: any free one)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="milliseconds added each way (default 0)")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    proxy = DelayProxy((host or "127.0.0.1", int(port)), args.delay_ms / 1e3, args.port).start()
    print(proxy.port, flush=True)  # the caller reads the port from the first line
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    proxy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
