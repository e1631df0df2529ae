import json
import logging

from semkv.log import get_logger, redact_payloads


def test_redaction_processor_drops_payloads():
    event = redact_payloads(None, "info", {
        "event": "lookup", "request_id": "r1", "token_ids": [1, 2, 3],
        "prompt": "secret words", "scores": list(range(100)), "note": "x" * 500, "n": 3,
    })
    assert event["request_id"] == "r1" and event["n"] == 3
    for key in ("token_ids", "prompt", "scores", "note"):
        assert event[key].startswith("<redacted"), key


def test_logger_output_carries_no_payload(caplog):
    caplog.set_level(logging.INFO, logger="semkv")
    secret = "the quick brown fox jumps over the lazy dog " * 4
    get_logger("semkv.test").info("lookup", text=secret, token_ids=[101, 2023, 2003], donors=2)
    joined = "\n".join(r.getMessage() for r in caplog.records)
    assert "lookup" in joined and "donors" in joined
    assert "quick brown" not in joined and "2023" not in joined
    assert json.loads(caplog.records[-1].getMessage())["donors"] == 2


def test_no_log_call_writes_a_reason_the_guard_would_redact():
    """The guard replaces any string field over ``MAX_STRING`` characters by its length; a
    reason written as one long literal reaches the operator as ``<redacted len=...>`` (two
    warnings did: ``lmcache_server_unauthenticated``'s and the TLS handshake's). Read from the
    source: every literal keyword of a ``log.<level>(...)`` call fits."""
    import ast
    from pathlib import Path

    from semkv.log import MAX_STRING

    root = Path(__file__).resolve().parents[1]
    too_long = []
    for path in [p for d in ("semkv", "adapters", "providers") for p in (root / d).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("debug", "info", "warning", "error", "exception")
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("log", "logger")):
                continue
            too_long += [f"{path.relative_to(root)}:{node.lineno} {kw.arg}" for kw in node.keywords
                         if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)
                         and len(kw.value.value) > MAX_STRING]
    assert not too_long, too_long
