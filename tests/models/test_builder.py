"""Tiny models from configs, HF save/load round trips, and clear errors for folders that are not checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny, load_hf, save_hf


@pytest.mark.parametrize("arch, cls", [("tiny-qwen3", "Qwen3ForCausalLM"), ("tiny-qwen3-moe", "Qwen3MoeForCausalLM")])
def test_save_load_round_trip(arch, cls, tmp_path):
    model, tok = build_tiny(arch, seed=3)
    assert type(model).__name__ == cls and model.config.vocab_size == len(tok)
    save_hf(model, tok, tmp_path / "ckpt")
    again, tok2 = load_hf(tmp_path / "ckpt")
    x = torch.randint(0, 256, (2, 17))
    assert torch.equal(model(x).logits, again(x).logits)
    assert tok2.encode("a<tool_call>b", add_special_tokens=False) == tok.encode("a<tool_call>b", add_special_tokens=False)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["architectures"] == [cls]
    save_hf(again, tok2, tmp_path / "ckpt")  # overwriting goes through a temp folder, then a rename
    assert not (tmp_path / "ckpt.tmp").exists() and not (tmp_path / "ckpt.old").exists()


def test_seeded_init_is_reproducible():
    a, _ = build_tiny("tiny-qwen3", seed=1)
    b, _ = build_tiny("tiny-qwen3", seed=1)
    c, _ = build_tiny("tiny-qwen3", seed=2)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_bad_checkpoint_folders(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_hf(tmp_path / "missing")
    with pytest.raises(UserError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(UserError, match="not valid JSON"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(UserError, match="no weights"):
        load_hf(tmp_path)
    with pytest.raises(UserError, match="unknown model arch"):
        build_tiny("gpt-17")
