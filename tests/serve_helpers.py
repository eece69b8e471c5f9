# tests/serve_helpers.py
#
# Helpers for the tests of `dflash serve`: a tiny model with a long context (so that a request
# can be kept running long enough to be disconnected), an in-process uvicorn server on a free
# 127.0.0.1 port in a thread, reading values out of /metrics, and waiting for a condition.
from __future__ import annotations

import contextlib
import pathlib
import socket
import threading
import time
from typing import Callable, Dict, Iterator, Optional

LONG_CONTEXT = 8192


def write_long_context_model(out_dir: pathlib.Path) -> pathlib.Path:
    """The llama_gqa geometry with 8192 positions: a 6000-token request runs for a while."""
    from tests.fixtures.tiny_models import write_tiny_model

    return write_tiny_model(out_dir, max_position_embeddings=LONG_CONTEXT, seed=3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """Serves `app` with uvicorn on a free 127.0.0.1 port in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="uvicorn to start")
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def wait_until(condition: Callable[[], bool], *, what: str, deadline_s: float = 60.0, poll_s: float = 0.01) -> None:
    """Polls `condition` until it holds; fails naming `what` after a generous deadline (a hang
    guard, not a speed requirement)."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def metrics(base_url: str) -> Dict[str, float]:
    """/metrics as {'name{label="v",...}': value} (samples, labels sorted as exposed)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metric(base_url: str, key: str, default: Optional[float] = None) -> float:
    values = metrics(base_url)
    if key not in values and default is not None:
        return default
    return values[key]


def all_blocks_free(base_url: str) -> bool:
    m = metrics(base_url)
    return (m["dflash_kv_cache_free_blocks"] == m["dflash_kv_cache_blocks"]
            and m["dflash_num_requests_running"] == 0 and m["dflash_num_requests_waiting"] == 0)
