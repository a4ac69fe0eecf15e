"""`TenantLRU`, the bounded per-tenant cache of the front end's grammar checks and schema
conversions and the worker's grammar verdicts, alphabet masks, DRY templates and long
tokenizations: a pure unit test."""
import threading

import pytest

from dispatcher.common.tenantlru import TenantLRU


def test_one_tenant_is_a_plain_least_recently_used_cache():
    lru = TenantLRU(3)
    for k in "abc":
        lru.put(None, k, k.upper())
    assert lru.get(None, "a") == "A"                 # a is the most recent now
    lru.put(None, "d", "D")                          # b goes
    assert ("b" not in {k for k in "abcd" if (None, k) in lru})
    assert [(None, k) in lru for k in "abcd"] == [True, False, True, True]
    assert len(lru) == 3 and lru.get(None, "b", "gone") == "gone"


def test_the_tenant_holding_the_most_loses_its_oldest():
    """A key sending many distinct items pushes out its own entries, never another
    key's while it holds more; values pushed out are handed to on_evict."""
    evicted = []
    lru = TenantLRU(4, on_evict=evicted.append)
    lru.put("victim", "v1", 1)
    lru.put("victim", "v2", 2)
    for i in range(50):
        lru.put("flood", i, i)
    assert lru.tenants() == {"victim": 2, "flood": 2}
    assert lru.get("victim", "v1") == 1 and lru.get("victim", "v2") == 2
    assert evicted == list(range(48))
    # tenants holding as many: the one whose oldest entry is oldest loses it
    lru.put("third", "t", 0)
    assert lru.tenants() == {"victim": 2, "flood": 1, "third": 1}
    assert len(lru) == 4 and sum(lru.tenants().values()) == 4


def test_the_entry_just_kept_is_never_the_one_pushed_out():
    lru = TenantLRU(2)
    for tenant in range(10):                         # ten tenants of one entry each
        lru.put(tenant, "k", tenant)
        assert lru.get(tenant, "k") == tenant
    assert lru.tenants() == {8: 1, 9: 1}


def test_setdefault_keeps_the_first_value_made_and_values_may_be_none():
    lru = TenantLRU(2)
    assert lru.setdefault("t", "k", "first") == "first"
    assert lru.setdefault("t", "k", "second") == "first"
    lru.put("t", "none", None)
    assert ("t", "none") in lru and lru.get("t", "none", "missing") is None
    with pytest.raises(ValueError):
        TenantLRU(0)


def test_threads_keep_the_counts_whole():
    lru = TenantLRU(16)

    def work(tenant):
        for i in range(2000):
            lru.put(tenant, i % 40, i)
            lru.get(tenant, (i * 7) % 40)
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(lru) == 16 == sum(lru.tenants().values()) == len(lru.values())
