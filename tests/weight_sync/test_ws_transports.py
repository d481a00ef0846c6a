"""Each transport pushes the tiny model's weights from this process (the trainer) to an engine in another
process; the check mode passes, the engine samples like the trainer's model, corruption is caught by name."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch

from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.process import EngineProcess, tiny_model_fn
from miles_agent.models.builder import build_tiny
from miles_agent.transports import (
    DiskTransport,
    DistributedTransport,
    SharedMemoryTransport,
    WeightMismatchError,
    WeightSyncError,
    prefix_map,
)

PROMPT = list(range(40, 52))
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
KINDS = ["shm", "distributed", "distributed-flat", "disk", "distributed-buckets"]  # distributed: streamed
VICTIM = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def engines():
    """Two engine processes (tiny-qwen3, seed 0) for the module, forked before this process starts any
    thread. Fork starts each in about a second once this process has imported transformers (building a
    model does); spawn would re-import everything."""
    build_tiny("tiny-qwen3")
    with EngineProcess(tiny_model_fn(seed=0), start_method="fork", num_threads=1) as first, \
            EngineProcess(tiny_model_fn(seed=0), start_method="fork", num_threads=1) as second:
        yield first, second


@pytest.fixture
def engine(engines):
    return engines[0]


def make(kind: str, engine, tmp_path, **kw):
    if kind == "shm":
        return SharedMemoryTransport([engine], **kw)
    if kind.startswith("distributed"):  # an engine process takes a streamed push unless told per bucket
        return DistributedTransport([engine], backend="gloo", flatten=kind.endswith("flat"),
                                    stream=False if kind.endswith("buckets") else None, **kw)
    return DiskTransport([engine], root=tmp_path / "weights", **kw)


def trainer_weights(seed: int) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]:
    model, _ = build_tiny("tiny-qwen3", seed=seed)
    with torch.no_grad():  # the tiny init leaves norms at constants; make every tensor seed-specific
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.01)
    return model, list(model.state_dict().items())


@torch.no_grad()
def greedy(model: torch.nn.Module) -> list[int]:
    """The trainer-side reference: argmax decoding with full forwards (no KV cache, no engine code)."""
    ids = list(PROMPT)
    for _ in range(GREEDY.max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


@pytest.mark.parametrize("kind", KINDS)
def test_push_to_engine_process_checks_and_samples_like_the_trainer(kind, engine, tmp_path):
    seed = 10 + KINDS.index(kind)  # weights no earlier test pushed, so a no-op transfer fails the check
    model, named = trainer_weights(seed)

    async def run():
        tr = make(kind, engine, tmp_path, bucket_bytes=256 << 10, check=True)
        m1 = await tr.push(named, version=seed)
        m2 = await tr.push(named, version=seed + 100)  # the second push reuses group / staging / folder
        out = await engine.generate(PROMPT, GREEDY)
        await tr.close()
        return m1, m2, out, await engine.weight_version()

    m1, m2, out, version = asyncio.run(run())
    assert m1.get("sync_streamed", 0) == (kind == "distributed")
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert m1["sync_bytes"] == total and m1["sync_buckets"] > 5  # 3.4 MB in 256 KiB buckets
    assert m1["sync_checked_tensors"] == len(named) == m2["sync_checked_tensors"]
    assert version == seed + 100 and out.weight_version == seed + 100
    assert out.output_ids == greedy(model)
    if kind == "disk":  # versioned folders, the newest two kept, no temporary folder left
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [f"v{seed:08d}", f"v{seed + 100:08d}"]


def _perturb_tensor(outgoing):
    """Wrap the distributed transport's outgoing(): VICTIM goes on the wire with one value changed."""
    def corrupted(name, t, device):
        t = outgoing(name, t, device)
        return t.clone().index_add_(0, torch.tensor([0]), torch.full_like(t[:1], 1e-3)) if name == VICTIM else t
    return corrupted


def _perturb_flat(pack):
    """Wrap a transport's pack(): after the trainer hashed the tensors, flip one value of VICTIM in transit."""
    def corrupted(bucket, out=None):
        flat, metas = pack(bucket, out=out)
        for m in metas:
            if m.name == VICTIM:
                flat[m.start_idx:m.start_idx + 4].view(torch.float32).add_(1e-3)
        return flat, metas
    return corrupted


def _perturb_file(save_file):
    """Wrap safetensors' save_file: after the shard is written, change one byte of VICTIM's data on disk."""
    def corrupted(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        if VICTIM in tensors:
            with open(path, "r+b") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                start = json.loads(f.read(n))[VICTIM]["data_offsets"][0]
                f.seek(8 + n + start + 1)
                b = f.read(1)
                f.seek(8 + n + start + 1)
                f.write(bytes([b[0] ^ 0x10]))
    return corrupted


@pytest.mark.parametrize("kind", KINDS)
def test_check_mode_catches_a_corrupted_transfer_by_name(kind, engine, tmp_path, monkeypatch):
    import miles_agent.transports.disk as disk
    import miles_agent.transports.dist as dist
    import miles_agent.transports.shm as shm

    if kind == "disk":
        from safetensors.torch import save_file
        monkeypatch.setattr("safetensors.torch.save_file", _perturb_file(save_file))
    elif kind in ("distributed", "distributed-buckets"):
        monkeypatch.setattr(dist, "outgoing", _perturb_tensor(dist.outgoing))
    else:
        module = shm if kind == "shm" else dist
        monkeypatch.setattr(module, "pack", _perturb_flat(module.pack))
    assert disk  # imported so the patched safetensors function is what the writer looks up
    _, named = trainer_weights(20)

    async def run():
        tr = make(kind, engine, tmp_path, bucket_bytes=256 << 10, check=True)
        try:
            await tr.push(named, version=7)
        finally:
            await tr.close()

    with pytest.raises(WeightMismatchError, match=rf"version 7: engine 0 \({kind.split('-')[0]} transport\) holds different "
                                                  rf"values for '{VICTIM}'.*1 of {len(named)} tensors differ"):
        asyncio.run(run())


def test_name_map_strips_the_trainer_prefix(engine, tmp_path):
    model, named = trainer_weights(30)
    wrapped = [(f"_orig_mod.{n}", t) for n, t in named]  # e.g. a torch.compile'd trainer module

    async def run(name_map):
        tr = SharedMemoryTransport([engine], check=True, name_map=name_map)
        await tr.push(wrapped, version=30)
        return await engine.generate(PROMPT, GREEDY)

    with pytest.raises(WeightSyncError, match="no parameter named '_orig_mod.model.embed_tokens.weight'"):
        asyncio.run(run(None))
    out = asyncio.run(run(prefix_map(strip="_orig_mod.")))
    assert out.weight_version == 30 and out.output_ids == greedy(model)


def test_distributed_load_error_comes_back_without_hanging_and_the_group_survives(engine, tmp_path):
    model, named = trainer_weights(40)

    async def run():
        tr = DistributedTransport([engine], backend="gloo", check=True, timeout_s=60)
        with pytest.raises(WeightSyncError, match=r"engine 0: .*no parameter named 'bogus.weight'"):
            await tr.push([("bogus.weight", torch.zeros(3))], version=1)
        assert tr.group is not None  # the broadcast completed; only the load failed
        await tr.push(named, version=41)
        out = await engine.generate(PROMPT, GREEDY)
        await tr.close()
        return out

    out = asyncio.run(run())
    assert out.weight_version == 41 and out.output_ids == greedy(model)


@pytest.mark.parametrize("kind", ["shm", "distributed"])
def test_two_engine_processes_both_get_the_weights(kind, engines):
    """Engine i joins the group as rank 1 + i (world size 3); every engine is checked."""
    model, named = trainer_weights(50 + KINDS.index(kind))

    async def run():
        tr = (SharedMemoryTransport(list(engines), check=True) if kind == "shm"
              else DistributedTransport(list(engines), backend="gloo", check=True))
        await tr.push(named, version=60)
        outs = [await e.generate(PROMPT, GREEDY) for e in engines]
        await tr.close()
        return outs

    outs = asyncio.run(run())
    assert [o.weight_version for o in outs] == [60, 60]
    assert outs[0].output_ids == outs[1].output_ids == greedy(model)


def test_a_streamed_push_is_one_request_and_loads_what_cannot_go_straight_in(engine, monkeypatch):
    """Many buckets, one request to the engine process; bf16 tensors for an fp32 engine are received into
    buffers and loaded (cast) while the next bucket arrives, fp32 ones land straight in the parameters."""
    model, named = trainer_weights(70)
    sent = [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(named)]
    with torch.no_grad():  # what the engine should then hold: every other tensor rounded through bf16
        model.load_state_dict({n: t.float() for n, t in sent})
    calls: list[str] = []
    call = engine.call

    async def recorded(method, **kwargs):
        calls.append(method)
        return await call(method, **kwargs)

    monkeypatch.setattr(engine, "call", recorded)

    async def run():
        tr = DistributedTransport([engine], backend="gloo", bucket_bytes=128 << 10)
        stats = await tr.push(sent, version=71)
        out = await engine.generate(PROMPT, GREEDY)
        await tr.close()
        return stats, out

    stats, out = asyncio.run(run())
    assert stats["sync_streamed"] == 1 and stats["sync_buckets"] > 10
    assert calls.count("receive_weights_stream") == 1 and "update_weights_from_distributed" not in calls
    assert out.weight_version == 71 and out.output_ids == greedy(model)


def test_a_load_that_fails_mid_stream_receives_the_rest_and_the_group_survives(engine):
    """A bad tensor in the middle of a streamed push: the engine still receives every later bucket (the
    trainer is never left in a broadcast), the error names the tensor, and the next push works."""
    model, named = trainer_weights(80)
    middle = len(named) // 2
    bad = [*named[:middle], ("bogus.weight", torch.zeros(3)), *named[middle:]]

    async def run():
        tr = DistributedTransport([engine], backend="gloo", bucket_bytes=128 << 10, timeout_s=60)
        with pytest.raises(WeightSyncError, match=r"engine 0: .*no parameter named 'bogus.weight'"):
            await tr.push(bad, version=81)
        assert tr.group is not None  # every broadcast completed; only a load failed
        stats = await tr.push(named, version=82)
        out = await engine.generate(PROMPT, GREEDY)
        await tr.close()
        return stats, out

    stats, out = asyncio.run(run())
    assert stats["sync_streamed"] == 1
    assert out.weight_version == 82 and out.output_ids == greedy(model)


def test_engines_that_cannot_take_a_stream_get_per_bucket_requests(engine):
    class PerBucketOnly:  # e.g. an SGLang server's client: no receive_weights_stream
        pass

    assert DistributedTransport([engine]).stream
    assert not DistributedTransport([engine, PerBucketOnly()]).stream  # one wire protocol per group
    assert not DistributedTransport([engine], flatten=True).stream
    with pytest.raises(ValueError, match=r"engines \[1\] do not .*leave stream unset"):
        DistributedTransport([engine, PerBucketOnly()], stream=True)
    with pytest.raises(ValueError, match="set flatten=False"):
        DistributedTransport([engine], flatten=True, stream=True)
