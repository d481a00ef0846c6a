"""GPU check: the embedded engine, the FSDP2 and Megatron-core trainers and the weight sync on one device.

Prints one JSON object with the figures and writes it to --json:

* engine: the embedded engine's tokens/s, against HF ``generate`` on the same model, prompts and device;
* fsdp2: a train step (bf16 on CUDA) -- tokens/s, step time, peak memory; offload: the colocation round trip
  (device memory after ``offload()``, and training after it equal to a trainer that never offloaded);
* megatron: a Megatron-core train step, and its logprobs and loss against FSDP2's on the same batch;
* sync: CUDA-IPC and NCCL weight sync GB/s against a device copy and raw NCCL broadcasts (bench/gpu_sync.py).

The model is random-init, built from a config (nothing is downloaded): on CUDA Qwen3-0.6B's shape from
recipes/architectures/Qwen3-0.6B.json, ``--model moe`` a ~0.3B Qwen3-MoE. Run it through bench/gpu_check.sh on
a GPU machine (one H200: a few minutes); ``--device cpu --quick`` is the dry run of the same code with the tiny
MoE (tests/megatron_backend/test_gpu_check_script.py runs it).

    python bench/gpu_check.py                      # cuda, Qwen3-0.6B-shaped, bf16
    python bench/gpu_check.py --device cpu --quick # the tiny MoE, fp32, under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.models.builder import build_tiny, tiny_config
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.megatron.options import MegatronConfig
from miles_agent.types import Trajectory

# A mid-size MoE (Qwen3-MoE shape, random init): big enough that a GPU is busy, small enough to build in
# seconds with no download.
GPU_MODEL = dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=16,
                 num_experts_per_tok=4)


ARCHITECTURES = Path(__file__).resolve().parents[1] / "recipes" / "architectures"


def build_model(kind: str, dtype: torch.dtype):  # noqa: ANN201
    """(model, byte tokenizer): ``tiny`` (the tiny MoE), ``moe`` (GPU_MODEL) or ``0.6b`` (Qwen3-0.6B's config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    if kind == "moe":
        cfg = tiny_config("tiny-qwen3-moe", tok)
        for k, v in GPU_MODEL.items():
            setattr(cfg, k, v)
        cfg.num_experts = GPU_MODEL["num_local_experts"]
    elif kind == "0.6b":
        arch = json.loads((ARCHITECTURES / "Qwen3-0.6B.json").read_text())
        arch.pop("architectures")
        cfg = AutoConfig.for_model(arch.pop("model_type"), eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, **arch)
    if kind != "tiny":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        model.config.architectures = [type(model).__name__]
    return model.to(dtype).eval(), tok


def engine_model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """The weight-sync engine's model (same names and shapes), built in its own process."""
    return build_model(kind, dtype)[0]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def check_engine(model: Any, tok: Any, device: str, n: int, new: int) -> tuple[dict[str, Any], list[Trajectory]]:
    from miles_agent.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=n, device=device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(k),), generator=g).tolist()
               for k in torch.randint(48, 96, (n,), generator=g)]
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0)

    async def run() -> list[Any]:
        return list(await asyncio.gather(*[engine.generate(p, sampling) for p in prompts]))

    asyncio.run(run())  # warm-up (kernels, allocator)
    _reset_peak(device)
    _sync(device)
    t0 = time.perf_counter()
    outs = asyncio.run(run())
    _sync(device)
    dt = time.perf_counter() - t0
    asyncio.run(engine.shutdown())
    trajs = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        t = Trajectory(prompt_ids=p, group_id=str(i % 4))
        t.append_model(list(o.output_ids), list(o.output_logprobs), weight_version=0, turn=0)
        t.reward = float(i % 2)
        trajs.append(t.validate())
    tokens = sum(len(o.output_ids) for o in outs)
    return {"sequences": n, "generated_tokens": tokens, "tokens_per_s": tokens / dt,
            "peak_mem_gib": _peak_gib(device)}, trajs


def check_hf_generate(model: Any, tok: Any, device: str, n: int, new: int) -> dict[str, Any]:
    """HF ``generate`` on the same prompts as the engine check (left-padded batch), sampling ``new`` tokens each."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(48, 96, (n,), generator=g)]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    hf = copy.deepcopy(model).to(device)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0,
              top_k=0, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        hf.generate(ids[:, : width], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        _sync(device)
    dt = time.perf_counter() - t0
    del hf
    tokens = int((out.shape[1] - width) * n)
    return {"sequences": n, "generated_tokens": tokens, "tokens_per_s": tokens / dt}


def check_trainer(name: str, make: Any, trajs: list[Trajectory], device: str, steps: int
                  ) -> tuple[dict[str, Any], list[list[float]], dict[str, float]]:
    trainer = make()
    try:
        before = trainer.compute_logprobs(trajs)
        adv = [[(1.0 if t.reward else -0.5)] * t.response_length for t in trajs]  # non-zero mean loss
        first: dict[str, float] = {}
        times = []
        _reset_peak(device)
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            m = trainer.train_step(TrainBatch(trajs, adv))
            _sync(device)
            times.append(time.perf_counter() - t0)
            first = first or m
        tokens = sum(sum(t.loss_mask) for t in trajs)
        figures = {"backend": name, "step_time_s_median": sorted(times)[len(times) // 2],
                   "train_tokens_per_s": tokens / min(times), "peak_mem_gib": _peak_gib(device),
                   "loss_first_step": first.get("loss")}
        return figures, before, first
    finally:
        trainer.close()


def _allocated(device: str) -> float | None:
    import gc

    gc.collect()
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**30


def check_offload(make: Any, trajs: list[Trajectory], device: str) -> dict[str, Any]:
    """Colocation: ``offload()`` frees the trainer's device memory (allocated GiB before / after) and a
    step after ``reload()`` matches, bit for bit, the same step by a trainer that never offloaded."""
    batch = TrainBatch(trajs, [[(1.0 if t.reward else -0.5)] * t.response_length for t in trajs])
    plain = make()
    try:
        plain_losses = [plain.train_step(batch)["loss"] for _ in range(2)]
        plain_weights = {k: v.detach().to("cpu", copy=True) for k, v in plain.named_weights()}
    finally:
        plain.close()
    empty = _allocated(device)  # what this process holds with no trainer (the CUDA context is not counted)
    trainer = make()
    try:
        losses = [trainer.train_step(batch)["loss"]]
        held, resident = _allocated(device), trainer.memory.resident_bytes()
        out = trainer.offload()
        offloaded, resident_offloaded = _allocated(device), trainer.memory.resident_bytes()
        back = trainer.reload()
        reloaded = _allocated(device)
        losses.append(trainer.train_step(batch)["loss"])
        diff = max(float((v.detach().to("cpu") - plain_weights[k]).abs().max()) for k, v in trainer.named_weights())
    finally:
        trainer.close()
    figures: dict[str, Any] = {
        "trainer_state_gib": resident / 2**30, "resident_bytes_offloaded": resident_offloaded,
        "offload_s": out["offload_s"], "reload_s": back["reload_s"],
        "offload_gib_per_s": out["offload_bytes"] / 2**30 / max(out["offload_s"], 1e-9),
        "reload_gib_per_s": back["reload_bytes"] / 2**30 / max(back["reload_s"], 1e-9),
        "losses_match": losses == plain_losses, "weights_max_abs_diff_vs_no_offload": diff}
    if device.startswith("cuda"):
        figures.update(allocated_gib_without_trainer=empty, allocated_gib_trained=held,
                       allocated_gib_offloaded=offloaded, allocated_gib_reloaded=reloaded,
                       freed_fraction=(held - offloaded) / max(held - empty, 1e-12))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the tiny MoE, few sequences: the dry run")
    ap.add_argument("--model", choices=["0.6b", "moe", "tiny"], help="default: tiny with --quick, else 0.6b")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    device, quick = args.device, args.quick
    kind = args.model or ("tiny" if quick else "0.6b")
    # Megatron and FSDP2 run the same dtype, so their logprobs are comparable (bf16: to bf16's precision).
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    started = time.perf_counter()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.machine(),
                              "torch": torch.__version__, "quick": quick, "model": kind, "dtype": str(dtype)}
    model, tok = build_model(kind, dtype)
    report["model_params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    n, new = (8, 16) if quick else (64, 128)
    report["engine"], trajs = check_engine(model, tok, device, n=n, new=new)
    report["hf_generate"] = check_hf_generate(model, tok, device, n=n, new=new)
    report["engine"]["vs_hf_generate"] = report["engine"]["tokens_per_s"] / report["hf_generate"]["tokens_per_s"]
    train = TrainConfig(lr=1e-5, micro_batch_tokens=4096 if quick else 16384)
    algo = AlgoConfig()
    steps = 2 if quick else 5

    from miles_agent.trainers.fsdp2 import FSDP2Trainer

    fsdp, lp_fsdp, m_fsdp = check_trainer(
        "fsdp2", lambda: FSDP2Trainer(copy.deepcopy(model), tok, train, algo, device=device), trajs, device, steps)
    report["fsdp2"] = fsdp
    report["offload"] = check_offload(lambda: FSDP2Trainer(copy.deepcopy(model), tok, train, algo, device=device),
                                      trajs, device)
    try:
        from miles_agent.trainers.megatron.trainer import MegatronTrainer
    except ImportError as e:
        report["megatron"] = {"error": f"megatron-core not installed ({e})"}
    else:
        meg, lp_meg, m_meg = check_trainer(
            "megatron", lambda: MegatronTrainer(copy.deepcopy(model), tok, train, algo, device=device,
                                                megatron=MegatronConfig()), trajs, device, steps)
        diffs = [abs(a - b) for ra, rb in zip(lp_fsdp, lp_meg) for a, b in zip(ra, rb)]
        meg["logprob_max_abs_diff_vs_fsdp2"] = max(diffs)
        meg["loss_rel_diff_vs_fsdp2"] = abs(m_meg["loss"] - m_fsdp["loss"]) / max(abs(m_fsdp["loss"]), 1e-12)
        report["megatron"] = meg
    from gpu_sync import check_weight_sync

    report["sync"] = check_weight_sync(model.to(device), functools.partial(engine_model, kind, dtype), device,
                                       bucket_mb=16 if quick else 256, repeat=2 if quick else 3)
    report["wall_s"] = time.perf_counter() - started
    text = json.dumps(report, indent=2, default=float)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
