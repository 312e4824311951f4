"""`streams bench ingest`: does one tenant posting large batches at full speed slow another tenant's
single sends? One run, side by side: tenant B's single-send latency at the ingest API (request to
202, the broker's acknowledgement included) idle, then while tenant A posts batches of
`batch_size` sends from `blasters` concurrent clients as fast as the API answers. Loopback only.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import time
import uuid

import httpx
import orjson

from ..config import StackConfig
from ..cpu_priority import lower_own_priority
from ..ingest.bulk import die_with_parent
from .bench_blast import _email
from .fleet import OUTSIDE_WORLD_NICE, Fleet, free_port


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class LeanClient:
    """One keep-alive HTTP/1.1 connection that posts a prepared request and reads the answer: the
    measuring client costs ~0.1 ms of CPU per request where httpx costs a few, so the figure is the
    API's (B's client stands for a machine of its own)."""

    def __init__(self, base: str, key: str):
        self.host, self.port = base.removeprefix("http://").split(":")
        body = orjson.dumps(_email("transactional"))
        self.request = (f"POST /v1/sends HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {key}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
        assert self.reader is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
        return int(lines[0].split()[1]), await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def _singles(client: LeanClient, n: int, per_s: float) -> list[float]:
    """n single sends, one every 1/per_s seconds (pacing a load generator), each timed."""
    out: list[float] = []
    started = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        status, body = await client.post()
        if status != 202:
            raise RuntimeError(f"a single send was refused: {status} {body[:200]!r}")
        out.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(max(0.0, started + (i + 1) / per_s - time.perf_counter()))
    return out


async def _blast(client: httpx.AsyncClient, key: str, batch_size: int, stop, counts) -> None:
    body = orjson.dumps({"sends": [_email("marketing")] * batch_size})  # encoded once: the client is not measured
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    while not stop.is_set():
        r = await client.post("/v1/sends/batch", content=body, headers=headers)
        if r.status_code == 202:
            with counts.get_lock():
                counts.value += batch_size
        elif r.status_code not in (429, 503):
            raise RuntimeError(f"a batch was refused: {r.status_code} {r.text[:200]}")


def _blaster_process(base: str, key: str, batch_size: int, blasters: int, stop, counts, parent: int) -> None:
    """Tenant A's clients, in a process of their own at the outside world's nice value (they stand for
    another machine): their work shares neither the measuring process's event loop nor our CPU share.
    A session of its own, so that its nice value holds against the API's sessions too: a Ctrl-C no
    longer reaches it, so the parent stops it, and the kernel does if the parent dies."""
    os.setsid()
    die_with_parent(parent)
    lower_own_priority(OUTSIDE_WORLD_NICE)
    async def main() -> None:
        limits = httpx.Limits(max_connections=blasters)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
            await asyncio.gather(*(_blast(client, key, batch_size, stop, counts) for _ in range(blasters)))

    asyncio.run(main())


async def _measure(base: str, singles_key: str, blaster_key: str, n: int, per_s: float, batch_size: int,
                   blasters: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Value("q", 0)
    client = LeanClient(base, singles_key)
    blaster = None
    try:
        await _singles(client, 20, per_s)  # warm up the connection and the producer
        idle = await _singles(client, n, per_s)
        process = ctx.Process(target=_blaster_process,
                              args=(base, blaster_key, batch_size, blasters, stop, counts, os.getpid()))
        process.start()
        blaster = process
        await asyncio.sleep(2.0)  # let the blast reach full speed before measuring
        t0 = time.perf_counter()
        loaded = await _singles(client, n, per_s)
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        if blaster is not None:
            blaster.join(60)
            if blaster.is_alive():
                blaster.terminate()
                blaster.join(10)
        await client.close()
    return {"idle": idle, "loaded": loaded, "blast_sends": counts.value, "blast_s": elapsed}


def run(n: int = 2000, per_s: float = 50.0, batch_size: int = 500, blasters: int = 4, progress=print) -> dict:
    stamp = uuid.uuid4().hex[:6]
    log_dir = StackConfig.from_env().home / "bench" / f"ingest-{stamp}"
    with Fleet(f"ingest{stamp}.", log_dir, base_env={**os.environ, "LOG_LEVEL": "ERROR"}, forget=True) as fleet:
        fleet.create_topics(("email",))
        port = free_port()
        fleet.start("api", "api", "--port", str(port))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # the API answers once uvicorn listens
            try:
                httpx.get(f"{base}/openapi.json", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        keys = fleet.runtime.api_keys()
        singles_key, blaster_key = keys.create("tenant", "shop"), keys.create("tenant", "blaster")
        progress(f"tenant shop: {n} single sends at {per_s:g}/s idle, then again while tenant blaster posts "
                 f"batches of {batch_size} from {blasters} clients")
        m = asyncio.run(_measure(base, singles_key, blaster_key, n, per_s, batch_size, blasters))
    idle_p99, loaded_p99 = _pct(m["idle"], 0.99), _pct(m["loaded"], 0.99)
    return {
        "benchmark": "ingest-isolation",
        "single_sends_per_phase": n, "single_sends_per_s": per_s,
        "blast": {"batch_size": batch_size, "clients": blasters,
                  "sends_accepted": m["blast_sends"], "sends_per_s": round(m["blast_sends"] / m["blast_s"])},
        "single_send_ms": {
            "idle": {"p50": round(statistics.median(m["idle"]), 2), "p99": round(idle_p99, 2)},
            "under_blast": {"p50": round(statistics.median(m["loaded"]), 2), "p99": round(loaded_p99, 2)},
        },
        "p99_ratio_under_blast_to_idle": round(loaded_p99 / idle_p99, 2) if idle_p99 else None,
        "target": "p99 under blast <= 2x idle",
        "outside_world_nice": OUTSIDE_WORLD_NICE, "bulk_process_nice": fleet.runtime.config.ingest_bulk_nice,
    }
