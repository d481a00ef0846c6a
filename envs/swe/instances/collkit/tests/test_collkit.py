from collkit.dicts import deep_merge
from collkit.lru import LRUCache
from collkit.seq import binary_search, dedupe, flatten, group_by


def test_flatten_numbers():
    assert flatten([1, [2, [3]], (4,)]) == [1, 2, 3, 4]


def test_dedupe_no_repeats():
    assert sorted(dedupe([3, 1, 3])) == [1, 3]


def test_group_by_single_items():
    assert set(group_by([1, 2, 3], lambda x: x % 2)) == {0, 1}


def test_binary_search_missing():
    assert binary_search([1, 3, 5], 4) == -1


def test_binary_search_middle():
    assert binary_search([1, 3, 5], 3) == 1


def test_deep_merge_flat():
    assert deep_merge({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}


def test_lru_capacity():
    cache = LRUCache(2)
    for k in "abc":
        cache.put(k, k)
    assert len(cache) == 2
