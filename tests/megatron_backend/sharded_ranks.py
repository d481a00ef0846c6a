"""Run by test_sharding.py in N gloo processes: each builds its rank's real GPTModel, loads the slice
``sharding.shard`` assigns it (strictly: same names, same shapes), optionally runs a tensor-parallel
forward, and saves what it holds for the parent to merge."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, hf_dir: str, sizes_csv: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_agent.trainers.megatron import cpu_compat
    from miles_agent.trainers.megatron.bridge import arch_spec, hf_to_megatron
    from miles_agent.trainers.megatron.model import ParallelSizes, build_gpt, padded_vocab
    from miles_agent.trainers.megatron.sharding import RankCoords, shard

    cpu_compat.enable()
    tp, pp, ep = (int(x) for x in sizes_csv.split(","))
    sizes = ParallelSizes(tensor=tp, pipeline=pp, expert=ep)
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    at = RankCoords(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_expert_model_parallel_rank(), 0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    hf = {k: v for f in sorted(Path(hf_dir).glob("*.safetensors")) for k, v in load_file(f).items()}
    spec = arch_spec(model.config)
    gpt = build_gpt(spec, sizes)
    own = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    mine = shard(hf_to_megatron(hf, spec, padded_vocab(spec, tp)), spec, sizes, at)
    assert set(mine) == set(own), (sorted(set(mine) ^ set(own)))
    for k in own:
        assert mine[k].shape == own[k].shape, (k, mine[k].shape, own[k].shape)
    gpt.load_state_dict(mine, strict=False)
    result = {"coords": at, "state": {k: v.clone() for k, v in gpt.state_dict().items()
                                      if not k.endswith("_extra_state")}}
    if pp == 1:  # a tensor/expert-parallel forward must give the HF logits
        gpt.eval()
        ids = torch.randint(0, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
        causal = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)[None, None]
        with torch.no_grad():
            local = gpt(ids, torch.arange(10).expand(2, -1), causal)
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            result["logits"] = torch.cat(parts, -1)[..., : spec.vocab_size]
            result["hf_logits"] = model(input_ids=ids).logits
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
