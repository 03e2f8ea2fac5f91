"""The client-side race that failed the soak in CI (tests/test_engine_soak.py, ``_client``).

httpcore's connection pool (1.0.9 here) hands an idle keep-alive connection to a waiting
request, and before that request's task runs and marks the connection active, another task's
pass over the pool finds the same connection idle past ``keepalive_expiry`` and closes it. The
request then writes (the write error is swallowed) and reads a socket closed on the client's
side: ``ReadError <- ReadError <- ClosedResourceError <- IndexError: pop from an empty deque``,
the chain CI printed. No server is at fault: here the server is a bare uvicorn app that streams
three 10-byte chunks.

The window is the time between the hand-over and the task's next turn on the event loop, so the
clients spin ``--busy`` seconds per chunk (the soak's clients parse JSON, the servers share the
two cores) and the expiry is set near an idle connection's life. With ``--keepalive 0`` no idle
connection is kept (each request gets a new loopback connection) and the race has nothing to
close::

    .venv/bin/python docs/measurements/cpu/soak_client_pool_race_2026_12_02.py --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import platform
import random
import time

import httpx
import uvicorn


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for _ in range(3):
        await asyncio.sleep(0.002)
        await send({"type": "http.response.body", "body": b"x" * 10, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _chain(e: BaseException) -> str:
    names = []
    while e is not None:
        names.append(type(e).__name__)
        e = e.__cause__ or e.__context__
    return " <- ".join(names)


async def _run(args, keepalive: int, seed: int) -> collections.Counter:
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=args.port, log_level="error"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    rng, errors = random.Random(seed), collections.Counter()
    todo = iter(range(args.requests))
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=keepalive,
                          keepalive_expiry=args.expiry)  # fmt: skip
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker() -> None:
            for _ in todo:
                try:
                    async with client.stream("GET", f"http://127.0.0.1:{args.port}/") as r:
                        async for _ in r.aiter_bytes():
                            end = time.perf_counter() + args.busy
                            while time.perf_counter() < end:
                                pass
                except httpx.HTTPError as e:
                    errors[_chain(e)] += 1
                await asyncio.sleep(rng.uniform(0, 0.02))

        await asyncio.gather(*(worker() for _ in range(args.clients)))
    server.should_exit = True
    await serving
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--expiry", type=float, default=0.005, help="keepalive_expiry, seconds")
    p.add_argument("--busy", type=float, default=0.0005, help="client CPU work per chunk, seconds")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}; httpx {httpx.__version__}; "
          f"requests {args.requests}, clients {args.clients}, expiry {args.expiry}s, busy {args.busy}s")  # fmt: skip
    for keepalive in (args.clients, 0):
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            errors = asyncio.run(_run(args, keepalive, seed=rep))
            print(f"max_keepalive_connections={keepalive:3d} repeat {rep}: {sum(errors.values()):3d} failed "
                  f"({time.perf_counter() - t0:.1f} s) {dict(errors)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
