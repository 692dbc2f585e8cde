"""``funcspec serve`` in a subprocess, for the server's tests: start it on a port the OS picks, talk to it over raw
HTTP (one keep-alive connection, or a bare socket), stop it with signals and read its exit code and log."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

READY = re.compile(r"funcspec serve: engine ready .* on http://([\d.]+):(\d+)")
# NOTE: one intra-op thread, as the test process: two processes on two cores must not fight over them.
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Served:
    """A running ``funcspec serve`` process: its ``host``, ``port``, ``log`` file and ``proc``."""

    def __init__(self, args: list[str], log: Path, env: Optional[dict] = None, timeout: float = 120):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "funcspec.cli", "serve", *args, "--port", "0"],
                                         stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **ENV, **(env or {})})
        deadline = time.monotonic() + timeout
        while not (found := READY.search(log.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        self.host, self.port = found.group(1), int(found.group(2))
        while self.status("GET", "/health") != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)

    def connection(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def status(self, method: str, path: str, headers: Optional[dict] = None) -> int:
        """A request's status on a fresh connection (-1 when nothing answers)."""
        try:
            conn = self.connection(timeout=5)
            conn.request(method, path, headers=headers or {})
            return conn.getresponse().status
        except OSError:
            return -1

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        """The exit code, once the process ended (killed, and the test failed, if it outlives ``timeout``)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the server outlived {timeout} s:\n{self.log.read_text()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


JSON = {"Content-Type": "application/json"}


def post(conn: http.client.HTTPConnection, path: str, body, headers: Optional[dict] = None):
    """POST ``body`` (bytes as they are, anything else as JSON) on ``conn`` with ``headers`` as given (default: a
    JSON content type); ``(status, body bytes, response)``."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers=headers if headers is not None else JSON)
    response = conn.getresponse()
    return response.status, response.read(), response


def sse_events(raw: bytes) -> list:
    """A server-sent event stream's ``data:`` payloads, JSON-decoded (``[DONE]`` kept as the string)."""
    events = []
    for line in raw.decode().split("\n\n"):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def openai_error(raw: bytes) -> dict:
    """The ``error`` object of an OpenAI error body, checked to have exactly OpenAI's four fields."""
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err
