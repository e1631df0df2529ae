import threading

import pytest

from semkv.leases import LeaseTable, UnknownDonorError


def test_acquire_validate_release():
    table = LeaseTable()
    gen = table.publish("d")
    lease = table.acquire("d")
    assert lease.generation == gen and table.validate(lease) and table.is_leased("d")
    assert table.release(lease.lease_id)
    assert not table.release(lease.lease_id)  # idempotent
    assert not table.validate(lease)
    assert table.live_count() == 0


def test_leased_donor_cannot_be_retired():
    table = LeaseTable()
    table.publish("d")
    lease = table.acquire("d")
    assert not table.try_retire("d")
    table.release(lease.lease_id)
    assert table.try_retire("d")
    with pytest.raises(UnknownDonorError):
        table.acquire("d")
    assert table.live_count() == 0


def test_stale_generation_detected():
    table = LeaseTable()
    first = table.publish("d")
    lease = table.acquire("d")
    table.publish("d")  # content rewritten
    assert not table.validate(lease)
    with pytest.raises(UnknownDonorError):
        table.acquire("d", generation=first)
    table.release(lease.lease_id)
    assert table.live_count() == 0


def test_unknown_donor():
    with pytest.raises(UnknownDonorError):
        LeaseTable().acquire("nobody")


def test_release_all():
    table = LeaseTable()
    table.publish("a")
    table.publish("b")
    table.acquire("a")
    table.acquire("b")
    assert table.release_all() == 2 and table.live_count() == 0


def test_thread_safety_no_lost_leases():
    table = LeaseTable()
    for i in range(8):
        table.publish(f"d{i}")
    errors = []

    def worker(n):
        try:
            for k in range(500):
                lease = table.acquire(f"d{(n + k) % 8}")
                assert table.validate(lease)
                assert not table.try_retire(lease.donor_id)
                assert table.release(lease.lease_id)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert table.live_count() == 0
    assert all(table.try_retire(f"d{i}") for i in range(8))
