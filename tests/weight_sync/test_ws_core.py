"""Buckets, flat packing, name maps and the checksum comparison behind every transport."""

from __future__ import annotations

import pytest
import torch

from miles_agent.transports import WeightMismatchError, prefix_map, tensor_checksum
from miles_agent.transports.core import (
    WeightSyncError,
    bucket_metadata,
    compare_checksums,
    flat_buckets,
    pack,
    unpack,
)


def test_pack_unpack_round_trips_mixed_dtypes_exactly():
    named = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.tensor([1, 2], dtype=torch.int8)),
             ("c", torch.tensor([0.5, -1.5], dtype=torch.bfloat16)), ("d", torch.ones(3, dtype=torch.float64))]
    out = []
    for bucket in flat_buckets(named, 1 << 20):
        flat, metas = pack(bucket)
        assert flat.dtype == torch.uint8 and flat.numel() == metas[-1].end_idx
        out += unpack(flat, metas)
    assert [n for n, _ in out] == ["a", "b", "c", "d"]
    for (n, t), (_, u) in zip(named, out):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t), n


def test_flat_buckets_split_where_a_dtype_would_be_misaligned():
    # 4 + 1 bytes, then a 2-byte bf16 at offset 5 would be misaligned: it starts a new bucket.
    named = [("f", torch.zeros(1)), ("i8", torch.zeros(1, dtype=torch.int8)), ("bf", torch.zeros(1, dtype=torch.bfloat16))]
    assert [[n for n, _ in b] for b in flat_buckets(named, 1 << 20)] == [["f", "i8"], ["bf"]]
    # Same-dtype tensors keep the plain size-bounded bucketing: 400 bytes each, 1000-byte buckets.
    same = [(f"w{i}", torch.zeros(100)) for i in range(5)]
    assert [len(b) for b in flat_buckets(same, 1000)] == [2, 2, 1]


def test_pack_reuses_a_large_enough_buffer_and_allocates_otherwise():
    buf = torch.zeros(64, dtype=torch.uint8)
    flat, _ = pack([("x", torch.ones(4))], out=buf)
    assert flat.data_ptr() == buf.data_ptr() and flat.numel() == 16
    big, _ = pack([("y", torch.ones(100))], out=buf)
    assert big.data_ptr() != buf.data_ptr() and big.numel() == 400


def test_metadata_rejects_unknown_dtype_by_name():
    with pytest.raises(WeightSyncError, match="'w'.*unknown dtype 'float99'"):
        bucket_metadata(["w"], ["float99"], [[2]])


def test_prefix_map_strips_then_adds():
    m = prefix_map(strip="_orig_mod.", add="")
    assert m("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert m("model.norm.weight") == "model.norm.weight"  # names without the prefix pass through
    assert prefix_map(strip="module.", add="model.")("module.layers.0.w") == "model.layers.0.w"


def test_checksum_is_byte_exact():
    t = torch.randn(10)
    u = t.clone()
    assert tensor_checksum(t) == tensor_checksum(u) and len(tensor_checksum(t)) == 16
    u[3] = torch.nextafter(u[3], torch.tensor(float("inf")))  # one ulp
    assert tensor_checksum(t) != tensor_checksum(u)


def test_compare_checksums_names_the_tensor_and_counts():
    expected = {"a": "1" * 16, "b": "2" * 16, "c": "3" * 16}
    compare_checksums(expected, dict(expected, extra="0" * 16), engine="engine 0", version=2)  # extras are fine
    with pytest.raises(WeightMismatchError, match=r"version 5: engine 1 holds different values for 'b' "
                                                  r"\(engine checksum 9999999999999999, trainer 2222222222222222\); "
                                                  r"2 of 3 tensors differ \(b, c\)"):
        compare_checksums(expected, {"a": "1" * 16, "b": "9" * 16}, engine="engine 1", version=5)
