from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from miles_agent.models.builder import build_tiny


def tiny_hf_checkpoint(arch: str, tmp: Path, seed: int = 0):  # noqa: ANN201
    """(model, HF checkpoint tensors as written to disk) for a tiny architecture, randomized so that
    norms and embeddings are not all-ones (a layout bug must change the logits)."""
    model, tok = build_tiny(arch, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=g))
    model.save_pretrained(tmp)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(tmp).glob("*.safetensors")):
        tensors.update(load_file(f))
    return model, tensors
