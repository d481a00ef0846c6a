"""GPU check: the embedded engine, the FSDP2 trainer and the Megatron-core trainer on one device.

Prints one JSON object with the figures (tokens/s, step times, peak memory) and the cross-backend
checks (Megatron vs FSDP2 logprobs and loss on the same batch), and the colocation offload check
(the FSDP2 trainer's device memory after ``offload()``, and training after the round trip against a
trainer that never offloaded). Run it through bench/gpu_check.sh on
a GPU machine; ``--device cpu --quick`` runs the same code here (CI proves it works).

    python bench/gpu_check.py                      # cuda, a ~0.3B random-init Qwen3-MoE-shaped model
    python bench/gpu_check.py --device cpu --quick # the tiny MoE, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import platform
import time
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


def build_model(quick: bool, device: str, dtype: torch.dtype):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    if not quick:
        cfg = tiny_config("tiny-qwen3-moe", tok)
        for k, v in GPU_MODEL.items():
            setattr(cfg, k, v)
        cfg.num_experts = GPU_MODEL["num_local_experts"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        model.config.architectures = [type(model).__name__]
    return model.to(dtype).eval(), tok


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
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device, quick = args.device, args.quick
    dtype = torch.float32  # one dtype on both backends, so their logprobs are comparable
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.machine(),
                              "torch": torch.__version__, "quick": quick}
    model, tok = build_model(quick, device, dtype)
    report["model_params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    report["engine"], trajs = check_engine(model, tok, device, n=8 if quick else 64, new=16 if quick else 128)
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
    print(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    main()
