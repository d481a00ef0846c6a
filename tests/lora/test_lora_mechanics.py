"""LoRA mechanics, fast: peft in the FSDP2 trainer, adapter-only sync, per-request unmerged adapters in the
embedded engine, peft-format export, routing of tasks to adapters."""

from __future__ import annotations

import asyncio
import copy
import json
import random

import pytest
import torch

from miles_agent.config import AlgoConfig, TrainConfig, load_config
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded import lora as engine_lora
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.trainers.lora_options import LoraSection
from miles_agent.types import Trajectory

peft = pytest.importorskip("peft")


def trajectories(task_ids: list[str], seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i, task in enumerate(task_ids):
        t = Trajectory(prompt_ids=[rng.randrange(60, 200) for _ in range(4)], task_id=task, group_id=task)
        t.append_model([rng.randrange(60, 200) for _ in range(5)], [-1.0] * 5, weight_version=0, turn=0)
        t.reward = float(i % 2)
        out.append(t.validate())
    return out


def lora_trainer(lora: LoraSection, lr: float = 1e-2) -> FSDP2Trainer:
    model, tok = build_tiny("tiny-qwen3", seed=0)
    return FSDP2Trainer(model, tok, TrainConfig(lr=lr, grad_clip=0.0), AlgoConfig(), lora=lora)


def step(trainer: FSDP2Trainer, trajs: list[Trajectory]) -> dict[str, float]:
    for t, lp in zip(trajs, trainer.compute_logprobs(trajs)):
        t.rollout_logprobs = lp
    return trainer.train_step(TrainBatch(trajs, [[1.0 if t.reward else -1.0] * t.response_length for t in trajs]))


def engine_for(lora: LoraSection) -> EmbeddedEngine:
    model, tok = build_tiny("tiny-qwen3", seed=0)
    rows = engine_lora.install(model, lora.names, lora.rank, lora.scaling, lora.targets)
    engine = EmbeddedEngine(model, tok, max_batch_size=8)
    engine_lora.attach(engine, rows)
    return engine


def test_only_the_adapter_trains_and_only_the_adapter_is_synced():
    lora = LoraSection(rank=4)
    trainer = lora_trainer(lora)
    full_bytes = sum(p.numel() * p.element_size() for p in build_tiny("tiny-qwen3")[0].parameters())
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in trainer.model.parameters())
    assert trainable and all(".lora_" in n for n in trainable) and n_train < 0.05 * n_all
    before = {n: p.detach().full_tensor().clone() for n, p in trainer.model.named_parameters()}
    metrics = step(trainer, trajectories(["t0", "t1", "t2", "t3"]))
    assert metrics["grad_norm"] > 0
    # AdamW state for the adapter parameters only; the base weights did not move
    state_ids = {id(p) for p in trainer.optimizer.state}
    for n, p in trainer.model.named_parameters():
        moved = not torch.equal(before[n], p.detach().full_tensor())
        assert (id(p) in state_ids) == (".lora_B" in n or ".lora_A" in n) and (moved <= (".lora_" in n)), n
    assert any(not torch.equal(before[n], p.detach().full_tensor()) for n, p in trainer.model.named_parameters()
               if ".lora_B" in n)
    sent = list(trainer.named_weights())
    assert sent and all(".lora_" in n and n.startswith("model.layers.") for n, _ in sent)
    sent_bytes = sum(t.numel() * t.element_size() for _, t in sent)
    assert sent_bytes < 0.05 * full_bytes, (sent_bytes, full_bytes)
    trainer.close()


def test_engine_applies_the_synced_adapter_like_peft():
    lora = LoraSection(rank=4)
    trainer = lora_trainer(lora, lr=5e-2)
    trajs = trajectories(["t0", "t1", "t2", "t3"])
    step(trainer, trajs)
    step(trainer, trajs)
    engine = engine_for(lora)
    base = asyncio.run(engine.score(trajs[0].tokens, logprob_start_len=1))
    engine.runner.load_weights(list(trainer.named_weights()))  # the sync, by name, unchanged
    tuned = asyncio.run(engine.score(trajs[0].tokens, logprob_start_len=1))
    want = trainer.compute_logprobs(trajs[:1])[0]
    n = trajs[0].response_length
    assert max(abs(a - b) for a, b in zip(tuned.input_token_logprobs[-n:], want)) < 1e-4
    assert max(abs(a - b) for a, b in zip(base.input_token_logprobs[-n:], want)) > 1e-3  # the adapter did change the policy
    trainer.close()


def test_each_request_uses_its_own_adapter_in_one_batch():
    lora = LoraSection(rank=4, adapters=["a", "b"])
    engine = engine_for(lora)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in engine.model.modules():
            if isinstance(m, engine_lora.LoraLinear):
                m.lora_B["a"].weight.normal_(0, 0.5)  # "b" stays zero: the base model
    prompt = [61, 62, 63, 64]
    greedy = {k: SamplingParams(max_new_tokens=6, temperature=0.0, lora_path=k) for k in ("a", "b")}

    async def alone(name):
        return (await engine.generate(prompt, greedy[name])).output_logprobs

    async def together():
        return await asyncio.gather(*(engine.generate(prompt, greedy[k]) for k in ("a", "b", "a", "b")))

    solo = {k: asyncio.run(alone(k)) for k in ("a", "b")}
    base = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0)))
    mixed = asyncio.run(together())
    assert solo["a"] != solo["b"] and base.output_logprobs == pytest.approx(solo["b"], abs=1e-5)
    for out, k in zip(mixed, ("a", "b", "a", "b")):
        assert out.output_logprobs == pytest.approx(solo[k], abs=1e-5)
    with pytest.raises(ValueError, match="not loaded"):
        asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=2, lora_path="c")))


def test_saved_adapter_loads_in_peft_unchanged(tmp_path):
    lora = LoraSection(rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj")
    trainer = lora_trainer(lora, lr=5e-2)
    trajs = trajectories(["t0", "t1", "t2", "t3"])
    step(trainer, trajs)
    want = trainer.compute_logprobs(trajs)
    trainer.save_hf(tmp_path / "final")
    folder = tmp_path / "final" / "default"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    base, _ = build_tiny("tiny-qwen3", seed=0)  # the tiny Qwen3 from its config and seed
    loaded = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    from safetensors.torch import load_file

    keys = load_file(str(folder / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.model.layers.") for k in keys)
    with torch.no_grad():
        for t, row in zip(trajs, want):
            ids = torch.tensor([t.tokens])
            logp = torch.log_softmax(loaded(input_ids=ids).logits[0, :-1].float(), -1)
            got = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[-t.response_length:]
            assert got.tolist() == pytest.approx(row, abs=1e-4)
    trainer.close()


def test_two_adapters_each_step_on_their_own_trajectories():
    lora = LoraSection(rank=4, adapters=["add", "mul"], routes={"add-": "add", "mul-": "mul"})
    trainer = lora_trainer(lora)
    snapshot = lambda: {n: t.clone() for n, t in trainer.named_weights()}  # noqa: E731
    before = snapshot()
    metrics = step(trainer, trajectories(["add-1", "add-1", "add-2", "add-2"]))
    after = snapshot()
    moved = {n.split(".lora_B.")[1].split(".")[0] for n in after if ".lora_B." in n and not torch.equal(before[n], after[n])}
    assert moved == {"add"} and trainer.step == 1 and "lora/add/grad_norm" in metrics
    metrics = step(trainer, trajectories(["add-1", "add-1", "mul-2", "mul-2"]))
    assert trainer.step == 2 and {"lora/add/grad_norm", "lora/mul/grad_norm"} <= set(metrics)
    trainer.close()


def test_routes_and_options_are_checked():
    lora = LoraSection(rank=2, adapters=["a", "b"], routes={"x-": "b", "x-long-": "a"})
    assert [lora.route(t) for t in ("x-1", "x-long-1", "y-1")] == ["b", "a", "a"]
    with pytest.raises(UserError, match="not in lora.adapters"):
        LoraSection(rank=2, adapters=["a"], routes={"x": "b"})
    with pytest.raises(UserError, match="lora.rank"):
        LoraSection(rank=-1)
    with pytest.raises(UserError, match="no linear layer called"):
        lora_trainer(LoraSection(rank=2, target_modules="qkv_proj"))
    cfg = load_config("tiny-cpu", {"lora.rank": 8, "lora.adapters": ["a", "b"]})
    assert cfg.lora.enabled and cfg.lora.names == ["a", "b"]


def test_arith_tools_family_ids_route_each_family_to_its_adapter():
    from miles_agent.build import build_env

    cfg = load_config("tiny-cpu", {"env.options": {"family_ids": True, "num_tasks": 64}, "lora.rank": 4,
                                   "lora.adapters": ["plus", "times"],
                                   "lora.routes": {"plus-": "plus", "times-": "times"}})
    tasks = build_env(cfg).tasks()
    routed = {t.id: cfg.lora.route(t.id) for t in tasks}
    assert all((routed[t.id] == "times") == ("*" in t.info["expr"]) for t in tasks)
    assert 10 < sum(r == "times" for r in routed.values()) < 54  # both families are well represented
    plain = load_config("tiny-cpu", {"env.options": {"num_tasks": 64}})
    assert [t.id for t in build_env(plain).tasks()][:2] == ["train-0", "train-1"]  # off by default
    assert [t.info for t in build_env(plain).tasks()] == [t.info for t in tasks]  # the same tasks


def test_megatron_refuses_lora_in_one_line():
    pytest.importorskip("megatron.core")
    from miles_agent.trainers.megatron.trainer import MegatronTrainer

    model, tok = build_tiny("tiny-qwen3")
    with pytest.raises(UserError, match="Megatron-Bridge"):
        MegatronTrainer(copy.deepcopy(model), tok, TrainConfig(), AlgoConfig(), lora=LoraSection(rank=4))


def test_checkpoint_resumes_every_adapter_and_exports_each_in_peft_format(tmp_path):
    lora = LoraSection(rank=4, adapters=["add", "mul"], routes={"add-": "add", "mul-": "mul"})
    trainer = lora_trainer(lora)
    step(trainer, trajectories(["add-1", "add-1", "mul-2", "mul-2"]))
    trainer.save_checkpoint(tmp_path / "ckpt")
    saved = {n: t.clone() for n, t in trainer.named_weights()}
    after_save = step(trainer, trajectories(["add-1", "add-1", "mul-2", "mul-2"], seed=1))
    trainer.close()
    for name in ("add", "mul"):
        assert (tmp_path / "ckpt" / "lora" / name / "adapter_model.safetensors").is_file()
    resumed = lora_trainer(lora)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1
    got = dict(resumed.named_weights())
    assert got.keys() == saved.keys() and all(torch.equal(got[n], saved[n]) for n in saved)
    again = step(resumed, trajectories(["add-1", "add-1", "mul-2", "mul-2"], seed=1))  # same optimizer state
    assert again["lora/add/grad_norm"] == pytest.approx(after_save["lora/add/grad_norm"], rel=1e-5)
    resumed.close()


def test_each_exported_adapter_loads_in_plain_peft_and_scores_like_its_trainer_adapter(tmp_path):
    lora = LoraSection(rank=4, alpha=8.0, adapters=["add", "mul"], routes={"add-": "add", "mul-": "mul"})
    trainer = lora_trainer(lora, lr=5e-2)
    trajs = trajectories(["add-1", "add-1", "mul-2", "mul-2"])
    step(trainer, trajs)
    step(trainer, trajs)
    want = trainer.compute_logprobs(trajs)  # each row through its own task's adapter
    trainer.save_hf(tmp_path / "final")
    trainer.close()
    base, _ = build_tiny("tiny-qwen3", seed=0)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "final" / "add"), adapter_name="add")
    loaded.load_adapter(str(tmp_path / "final" / "mul"), adapter_name="mul")
    loaded.eval()

    def score(adapter: str, t: Trajectory) -> list[float]:
        loaded.set_adapter(adapter)
        ids = torch.tensor([t.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(loaded(input_ids=ids).logits[0, :-1].float(), -1)
        return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[-t.response_length:].tolist()

    for t, row in zip(trajs, want):
        own, other = lora.route(t.task_id), {"add": "mul", "mul": "add"}[lora.route(t.task_id)]
        assert score(own, t) == pytest.approx(row, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(score(other, t), row)) > 1e-3  # the two adapters differ
