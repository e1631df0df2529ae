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
