"""Credentials of the shared discovery store (Redis ``AUTH``, ACL users), kept out of configs.

The shared store holds every tenant's prompt token ids (a donor record is its tokens), so a
production store requires a password. The config never holds the secret, only where it is:

- ``store_username``: the ACL user (default: the server's ``default`` user);
- ``store_password_env``: the name of an environment variable holding the password, or
  ``store_password_file``: a file holding it (its first line; a file other users may read or
  write is refused at start-up). One of the two, never both; a URL carrying
  ``user:password@`` is refused.

The secret is read once, when the store is built at engine start-up, and handed to redis-py
only: no config dump, log line or error message contains it. At start-up the store sends one
``PING``: a server that refuses the credentials (wrong password, unknown user, none where it
asks for one) is a start-up error naming these settings; an unreachable server is not (the
store degrades to local discovery, see ``semkv.discovery_store``); over TLS, a certificate
that does not verify or a client certificate the server refuses is a start-up error too
(``semkv.store_tls``). With a password configured,
a second ``PING`` without credentials tells whether the server is open to anyone who reaches
it (Redis accepts any password for a user that has none): a warning,
``discovery_store_unprotected``. A plain ``redis://`` store beyond loopback is warned about too
(``discovery_store_in_clear``): the password and the token ids cross the network unencrypted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from semkv.config import ConfigError
from semkv.log import get_logger
from semkv.net import is_loopback
from semkv.store_tls import TlsSettings, handshake_refusal, uses_tls

log = get_logger("semkv.store")
OTHERS = stat.S_IROTH | stat.S_IWOTH  # a password file with either bit is refused


class CredentialSettings(TlsSettings, Protocol):
    """What this module reads of ``SharedStoreConfig``."""

    @property
    def store_username(self) -> str | None: ...
    @property
    def store_password_env(self) -> str | None: ...
    @property
    def store_password_file(self) -> str | None: ...


def store_password(config: CredentialSettings) -> str | None:
    """The password the settings point at (None: none configured); raises ``ConfigError``
    naming the setting when it points at nothing."""
    if config.store_password_env is not None:
        value = os.environ.get(config.store_password_env, "")
        if not value:
            raise ConfigError(
                f"provider_config.store_password_env={config.store_password_env!r}: that "
                "environment variable is not set, or empty, in the engine's environment")
        return value
    if config.store_password_file is not None:
        path = Path(config.store_password_file)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)  # a symlink's target (a mounted secret)
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"provider_config.store_password_file={config.store_password_file!r}: cannot "
                f"read it ({type(exc).__name__})") from None
        if mode & OTHERS:
            raise ConfigError(
                f"provider_config.store_password_file={config.store_password_file!r}: other "
                f"users may read or write it (mode {mode:04o}); make it 0600 or 0400 (0440 "
                "for a group the engine's user is in; Kubernetes: the secret volume's "
                "defaultMode)")
        if not lines or not lines[0]:
            raise ConfigError(f"provider_config.store_password_file="
                              f"{config.store_password_file!r}: its first line is empty")
        return lines[0]
    return None


def client_credentials(config: CredentialSettings) -> dict[str, Any]:
    """redis-py's ``username`` and ``password`` arguments (only those configured)."""
    out: dict[str, Any] = {}
    password = store_password(config)
    if password is not None:
        out["password"] = password
    if config.store_username is not None:
        out["username"] = config.store_username
    return out


def describe(config: CredentialSettings) -> str:
    """The settings in use, for an error message (never the secret)."""
    said = [f"store_username={config.store_username!r}" if config.store_username else
            "no store_username (the server's default user)"]
    if config.store_password_env is not None:
        said.append(f"store_password_env={config.store_password_env!r}")
    elif config.store_password_file is not None:
        said.append(f"store_password_file={config.store_password_file!r}")
    else:
        said.append("no store_password_env or store_password_file (no password sent)")
    return ", ".join(said)


def warn_if_in_clear(store_url: str, config: CredentialSettings) -> bool:
    """Warns ``discovery_store_in_clear`` (and returns True) for a plain ``redis://`` store on
    a host other than loopback: the password (``AUTH``, when one is configured) and every
    tenant's prompt token ids cross the network readable, and alterable, by whoever is on the
    path. ``rediss://`` (TLS) and ``unix://`` sockets are not warned about."""
    if urlsplit(store_url).scheme != "redis" or is_loopback(urlsplit(store_url).hostname or ""):
        return False
    password = config.store_password_env is not None or config.store_password_file is not None
    log.warning("discovery_store_in_clear", store=store_url, password_sent=password,
                why="plain TCP: " + ("the password and " if password else "")
                    + "every tenant's prompt token ids cross the network in clear",
                fix="rediss:// with store_tls_* settings (docs/deployment.md)")
    return True


def check_at_start(client: Any, store_url: str, config: CredentialSettings,
                   anonymous: Callable[[], Any] | None = None) -> bool:
    """One ``PING``: raises ``ConfigError`` when the server refuses the credentials; returns
    whether the server answered (False: unreachable now, the store retries later).
    ``anonymous`` builds a client without credentials (asked when a password is configured)."""
    import redis

    try:
        client.ping()
    except (redis.AuthenticationError, redis.ResponseError) as exc:
        # a reply error that is not about credentials (NOAUTH, WRONGPASS, AUTH ...) is no refusal
        if not isinstance(exc, redis.AuthenticationError) and not (
                "AUTH" in str(exc) or "WRONGPASS" in str(exc)):
            raise
        raise ConfigError(
            f"provider_config.discovery_store={store_url!r} refused the credentials "
            f"({describe(config)}): {_reason(exc)}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        refusal = handshake_refusal(exc, config)
        if refusal is not None:
            raise ConfigError(
                f"provider_config.discovery_store={store_url!r}: {refusal}") from None
        if uses_tls(config) and "handshake" in str(exc.__context__ or exc):
            log.warning("discovery_store_tls_handshake_timeout", store=store_url,
                        why="the server accepted the connection but not the TLS handshake "
                            "in time",
                        likely="a redis:// (plain) port, or a stalled server",
                        then="local discovery until it answers")
        return False
    if anonymous is not None and (config.store_password_env or config.store_password_file):
        probe = anonymous()
        try:
            probe.ping()
            log.warning("discovery_store_unprotected", store=store_url,
                        why="the server answers without credentials: anyone who reaches it "
                            "reads every tenant's prompt tokens",
                        fix="requirepass, or an ACL with the default user off")
        except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError, OSError):
            pass  # refused without credentials: protected
        finally:
            probe.close()
    return True


def _reason(exc: BaseException) -> str:
    """The server's words, cut short (they never contain the password)."""
    return str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
