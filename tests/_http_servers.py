"""A real aiohttp server, on a free loopback port, whose behaviour tests switch at will.

It runs its own event loop in a background thread, so both threaded and asyncio
tests can call it. Modes:

- ``ok``: 200 with JSON ``{"server": name, "path": path, "echo": <request JSON or null>}``
- ``fail``: 500
- ``reject``: 400 (the request itself is refused)
- ``hang``: never answers until the server stops (clients must time out)
- ``gate``: holds the request until :meth:`release`, then answers like ``ok``

``hits`` counts every request received, whatever the mode.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

from tests.servers import free_port

MODES = ("ok", "fail", "reject", "hang", "gate")


class ControlledServer:
    def __init__(self, name: str = "server") -> None:
        self.name = name
        self.port = free_port()
        self.mode = "ok"
        self.hits = 0
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._gate: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> ControlledServer:
        self._thread.start()
        self._run(self._start())
        return self

    async def _start(self) -> None:
        self._gate = asyncio.Event()
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.Response:
        with self._cond:
            self.hits += 1
            mode = self.mode
            self._cond.notify_all()
        assert self._gate is not None and self._stopping is not None
        if mode == "fail":
            return web.Response(status=500, text=f"{self.name}: injected failure")
        if mode == "reject":
            return web.Response(status=400, text=f"{self.name}: bad request")
        if mode == "hang":
            await self._stopping.wait()
            return web.Response(status=503)
        if mode == "gate":
            gate = asyncio.ensure_future(self._gate.wait())
            stop = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait({gate, stop}, return_when=asyncio.FIRST_COMPLETED)
            gate.cancel()
            stop.cancel()
        body = await request.read()
        echo = json.loads(body) if body else None
        return web.json_response({"server": self.name, "path": request.path, "echo": echo})

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        with self._cond:
            self.mode = mode

    def release(self) -> None:
        """Answer every request held in ``gate`` mode (and later ones at once)."""
        assert self._gate is not None
        self._loop.call_soon_threadsafe(self._gate.set)

    def wait_for_hits(self, n: int, timeout_s: float = 30.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.hits >= n, timeout_s):
                raise AssertionError(f"{self.name}: expected {n} requests, got {self.hits}")

    def stop(self) -> None:
        if self._runner is not None:
            assert self._stopping is not None
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._run(self._runner.cleanup())
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class ManualClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
