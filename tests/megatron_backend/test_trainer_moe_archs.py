"""The Megatron trainer on DeepSeek-V3-style (MLA) and GLM-4.5-style tiny models computes what the FSDP2
trainer computes on the same HF model: same logprobs, same loss and gradient norm, the same updated weights
(router and expert bias included), and save_hf writes a checkpoint transformers loads back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_megatron_trainer import trajectories
from tiny_moe_models import deepseek_config, glm_config

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.models.builder import load_hf
from miles_agent.models.tokenizer import build_byte_tokenizer
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.trainers.megatron.options import MegatronConfig
from miles_agent.trainers.megatron.trainer import MegatronTrainer

CONFIGS = {"deepseek-v3": deepseek_config, "glm-4.5": glm_config}


def _model(arch: str, tok):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    cfg = CONFIGS[arch]()
    cfg.vocab_size = len(tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.rand(b.shape))
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.copy_(0.3 * torch.randn(p.shape))
    return model


@pytest.mark.parametrize("arch", CONFIGS)
def test_megatron_trainer_matches_fsdp2(arch, tmp_path):
    tok = build_byte_tokenizer()
    train = TrainConfig(lr=0.1, adam_eps=1.0, micro_batch_tokens=24)
    algo = AlgoConfig(entropy_coef=0.01)
    trainers = []
    try:
        trainers.append(MegatronTrainer(_model(arch, tok), tok, train, algo, temperature=0.8,
                                        megatron=MegatronConfig()))
        trainers.insert(0, FSDP2Trainer(_model(arch, tok), tok, train, algo, temperature=0.8))
        fsdp, meg = trainers
        trajs = trajectories()
        for a, b in zip(fsdp.compute_logprobs(trajs), meg.compute_logprobs(trajs)):
            assert a == pytest.approx(b, abs=2e-5)
        adv = [[(1.0 if i % 2 else -0.5)] * t.response_length for i, t in enumerate(trajs)]
        m1, m2 = fsdp.train_step(TrainBatch(trajs, adv)), meg.train_step(TrainBatch(trajs, adv))
        for k in ("loss", "pg_loss", "entropy", "grad_norm"):
            if k in m1:
                assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
        w1, w2 = dict(fsdp.named_weights()), dict(meg.named_weights())
        assert set(w1) == set(w2)
        initial = _model(arch, tok).state_dict()
        moved = 0
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)
            moved += int(not torch.equal(w2[k], initial[k]))
        assert moved > len(w1) // 2  # the step really changed the weights, identically
        bias = next(k for k in w2 if k.endswith("e_score_correction_bias"))
        assert torch.equal(w2[bias], initial[bias])  # a checkpoint value: the RL step leaves it alone
        meg.save_hf(tmp_path / "hf")
        reloaded, _ = load_hf(tmp_path / "hf")
        for k, v in reloaded.state_dict().items():
            assert torch.equal(v, w2[k]), k
    finally:
        for t in trainers[::-1]:
            t.close()
        assert not dist.is_initialized()


@pytest.mark.parametrize("recipe", ["deepseek-v3", "kimi-k2", "glm-4.5-air"])
def test_recipe_models_convert_and_only_the_cpu_moe_pipeline_limit_stops_them_here(recipe):
    """The real models' architectures have converters, their tensor/expert layout fits the converted tensors
    (MLA's latent dims included), and what stops these recipes on this CPU machine is only that pipeline
    parallelism with MoE needs Megatron's alltoall dispatcher, which needs CUDA."""
    import json
    from pathlib import Path

    import transformers

    from miles_agent.config import RECIPES_DIR, load_config
    from miles_agent.errors import UserError
    from miles_agent.trainers.megatron.bridge import arch_spec
    from miles_agent.trainers.megatron.model import ParallelSizes

    cfg = load_config(recipe)
    arch_file = RECIPES_DIR / "architectures" / f"{Path(cfg.model.hf_checkpoint).name}.json"
    dims = json.loads(arch_file.read_text())
    config_cls = {"DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
                  "Glm4MoeForCausalLM": transformers.Glm4MoeConfig}[dims["architectures"][0]]
    spec = arch_spec(config_cls(**dims))  # the other fields: transformers' defaults, which are these models'
    m = cfg.megatron
    assert m.pipeline_parallel > 1
    ParallelSizes(tensor=m.tensor_parallel, expert=m.expert_parallel).check(spec, cfg.train.world_size)
    tok = build_byte_tokenizer()
    with pytest.raises(UserError, match="pipeline_parallel > 1 with an MoE model needs .*CUDA") as refused:
        tiny = _model("deepseek-v3" if "Deepseek" in dims["architectures"][0] else "glm-4.5", tok)
        MegatronTrainer(tiny, tok, TrainConfig(), AlgoConfig(), megatron=m)
    assert "conversion" not in str(refused.value)
