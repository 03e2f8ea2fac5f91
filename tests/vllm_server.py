"""A real ``vllm serve`` process for the server tests (``test_engine_serve.py``,
``test_engine_soak.py``): a free loopback port, an HTTP GET that never raises, waiting for
``/health``, and stopping the server's whole process group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """``(status, body)``; status 0 when nothing answers (connection refused, timeout)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout: float) -> None:
    """Return once ``GET /health`` answers 200; fail the test (with the log's tail) if the
    server exits or is not healthy within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"`vllm serve` exited with {proc.returncode}:\n{log_path.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"`vllm serve` not healthy after {timeout:.0f} s:\n{log_path.read_text()[-6000:]}")
        if http_get(f"{base}/health")[0] == 200:
            return
        time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (vLLM shuts its engine processes down), then SIGKILL the server's process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the session started for the server
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)



@contextlib.contextmanager
def serving(model: str, speculative_config: dict, flags: list[str], log_path: Path):
    """``vllm serve model --speculative-config ...`` on a free local port, output to ``log_path``:
    yields ``(process, base_url)`` (started, not yet healthy) and stops the server on exit."""
    port = free_port()
    cmd = [str(Path(sysconfig.get_path("scripts")) / "vllm"), "serve", model,
           "--speculative-config", json.dumps(speculative_config),
           "--host", "127.0.0.1", "--port", str(port), *flags]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
