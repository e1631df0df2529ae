"""TLS to the shared discovery store: ``rediss://``, the server verified, a client certificate.

Settings (``provider_config``, see ``SharedStoreConfig``), all files in PEM:

- ``store_tls_ca_file``: the authority that signed the server's certificate (default: the
  system's authorities);
- ``store_tls_cert_file`` and ``store_tls_key_file``: this engine's client certificate and its
  key, for a server started with ``tls-auth-clients yes`` (the key may sit in the certificate's
  file, then ``store_tls_key_file`` is left out);
- ``store_tls_check_hostname`` (default true): the certificate must name the host of
  ``discovery_store``.

The server's certificate is always verified (redis-py's ``ssl_cert_reqs="required"``); there
is no setting that turns verification off. They apply to a ``rediss://`` URL only (refused with
``redis://`` when the config is read).

NOTE: the files are read when the store is built at engine start-up, and a file that cannot
be read, is not PEM, or a key that does not match its certificate is a ``ConfigError`` naming
the setting. The handshake of the first ``PING`` (``semkv.store_credentials.check_at_start``)
then tells a certificate that does not verify, or a client certificate the server refuses,
apart from an unreachable server: the first two are start-up errors naming the settings
(``handshake_refusal``), the last degrades to local discovery as before.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Protocol

from semkv.config import ConfigError

# The server's alerts when it refuses this engine's certificate (or the lack of one).
_CLIENT_REFUSED = ("ALERT_UNKNOWN_CA", "ALERT_BAD_CERTIFICATE", "ALERT_CERTIFICATE_REQUIRED",
                   "ALERT_CERTIFICATE_UNKNOWN", "ALERT_ACCESS_DENIED", "ALERT_HANDSHAKE_FAILURE",
                   "ALERT_CERTIFICATE_EXPIRED", "ALERT_UNSUPPORTED_CERTIFICATE")


class TlsSettings(Protocol):
    """What this module reads of ``SharedStoreConfig``."""

    @property
    def discovery_store(self) -> str: ...
    @property
    def store_tls_ca_file(self) -> str | None: ...
    @property
    def store_tls_cert_file(self) -> str | None: ...
    @property
    def store_tls_key_file(self) -> str | None: ...
    @property
    def store_tls_check_hostname(self) -> bool: ...


def uses_tls(config: TlsSettings) -> bool:
    return config.discovery_store.startswith("rediss://")


def tls_arguments(config: TlsSettings) -> dict[str, Any]:
    """redis-py's ``ssl_*`` arguments for a ``rediss://`` store ({} otherwise), after loading
    every file once into a context as redis-py will: raises ``ConfigError`` naming the setting
    of a file that cannot be used."""
    if not uses_tls(config):
        return {}
    context = ssl.create_default_context()
    if config.store_tls_ca_file is not None:
        _readable("store_tls_ca_file", config.store_tls_ca_file)
        try:
            context.load_verify_locations(cafile=config.store_tls_ca_file)
        except ssl.SSLError as exc:
            raise ConfigError(f"provider_config.store_tls_ca_file={config.store_tls_ca_file!r}: "
                              f"not a PEM certificate authority ({_reason(exc)})") from None
    if config.store_tls_cert_file is not None:
        _readable("store_tls_cert_file", config.store_tls_cert_file)
        if config.store_tls_key_file is not None:
            _readable("store_tls_key_file", config.store_tls_key_file)
        try:
            context.load_cert_chain(config.store_tls_cert_file, config.store_tls_key_file)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"provider_config.store_tls_cert_file={config.store_tls_cert_file!r} with "
                f"{_key_said(config)}: not a PEM certificate and its matching key "
                f"({_reason(exc)})") from None
    return {"ssl_cert_reqs": "required", "ssl_ca_certs": config.store_tls_ca_file,
            "ssl_certfile": config.store_tls_cert_file, "ssl_keyfile": config.store_tls_key_file,
            "ssl_check_hostname": config.store_tls_check_hostname}


def handshake_refusal(exc: BaseException, config: TlsSettings) -> str | None:
    """Why the TLS handshake behind ``exc`` (a redis-py connection error) failed, naming the
    settings, or None when ``exc`` is no TLS refusal (unreachable, or not TLS at all)."""
    if not uses_tls(config):
        return None
    cause = _ssl_cause(exc)
    if cause is None:
        return None
    authority = (f"store_tls_ca_file={config.store_tls_ca_file!r}"
                 if config.store_tls_ca_file is not None
                 else "the system's certificate authorities (no store_tls_ca_file)")
    if isinstance(cause, ssl.SSLCertVerificationError):
        text = f"the server's certificate does not verify against {authority}"
        if "mismatch" in str(cause):  # "Hostname mismatch", "IP address mismatch"
            text = ("the server's certificate does not name the host of discovery_store "
                    "(store_tls_check_hostname=true)")
        return f"{text}: {_reason(cause)}"
    client = (f"store_tls_cert_file={config.store_tls_cert_file!r}"
              if config.store_tls_cert_file is not None else "no store_tls_cert_file")
    if isinstance(cause, ssl.SSLEOFError) or any(a in str(cause) for a in _CLIENT_REFUSED):
        return (f"the server refused this engine's client certificate ({client}; it trusts "
                f"the authority of its tls-ca-cert-file): {_reason(cause)}")
    if "WRONG_VERSION_NUMBER" in str(cause) or "RECORD_LAYER" in str(cause):
        return f"the server does not speak TLS on that port (a redis:// port?): {_reason(cause)}"
    return f"the TLS handshake failed ({authority}, {client}): {_reason(cause)}"


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    seen: BaseException | None = exc
    for _ in range(8):  # redis-py wraps the ssl error once or twice
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _readable(setting: str, path: str) -> None:
    try:
        with Path(path).open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"provider_config.{setting}={path!r}: cannot read it "
                          f"({type(exc).__name__})") from None


def _key_said(config: TlsSettings) -> str:
    return (f"store_tls_key_file={config.store_tls_key_file!r}"
            if config.store_tls_key_file is not None
            else "no store_tls_key_file (the key in the certificate's file)")


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "verify_message", None) or str(exc) or type(exc).__name__
    return str(reason).splitlines()[0][:160]
