"""The tiny Qwen3-VL policy: the embedded engine and the FSDP2 trainer run one forward over the same image+text
inputs (HF's vision tower, DeepStack and M-RoPE), so the sampled tokens' logprobs agree in fp32."""

from __future__ import annotations

import asyncio
import copy
import io

import pytest
import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import FinishReason, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny, load_hf, save_hf
from miles_agent.models.vision import expand_images, placeholder_count
from miles_agent.tito import ChatRenderer
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory


def screenshot(seed: int, size: tuple[int, int] = (320, 240)) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm():
    return build_tiny("tiny-qwen3-vl", seed=0)


async def episode(engine: EmbeddedEngine, tok, pngs: list[bytes], seed: int, turns: int = 3) -> Trajectory:
    """A multi-turn trajectory: a screenshot in the opening user turn, one more in every tool result."""
    pad = engine.model.config.image_token_id
    renderer = ChatRenderer(tok)
    messages = [{"role": "system", "content": "Operate the desktop."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click Send."}]}]
    ids, images = expand_images(renderer.prompt_ids(messages), pad, pngs[:1])
    traj = Trajectory(prompt_ids=ids, images=images)
    for turn in range(turns):
        sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed + turn)
        c = await engine.generate(list(traj.tokens), sampling, images=traj.images)
        traj.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn)
        if turn == turns - 1:
            break
        stop = c.finish_reason is FinishReason.STOP
        text = tok.decode(c.output_ids[:-1] if stop else c.output_ids)
        messages.append({"role": "assistant", "content": text})
        tool = {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": f"clicked {turn}"}]}
        obs = renderer.observation_ids(messages, [tool], tok.decode(c.output_ids[-1:]) if stop else "")
        messages.append(tool)
        obs, new = expand_images(obs, pad, pngs[turn + 1:turn + 2])
        traj.append_observation(obs, turn + 1, new)
    traj.reward = 0.0
    return traj.validate()


def test_engine_and_trainer_logprobs_match_on_images_and_text(vlm):
    model, tok = vlm
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4)
    trainer = FSDP2Trainer(copy.deepcopy(model), tok, TrainConfig(micro_batch_tokens=4096, lr=3e-3), AlgoConfig())
    shots = [screenshot(i) for i in range(3)] + [screenshot(9, (256, 192))]

    async def both():  # two episodes batched together in the engine, with different images
        return await asyncio.gather(episode(engine, tok, shots[:3], seed=1),
                                    episode(engine, tok, [shots[3], shots[0], shots[1]], seed=7))

    trajs = asyncio.run(both())
    assert [len(t.images) for t in trajs] == [3, 3] and trajs[0].num_turns == 3
    assert [im.end - im.start for im in trajs[0].images] == [placeholder_count(s) for s in shots[:3]]
    trained = trainer.compute_logprobs(trajs)
    for t, lp in zip(trajs, trained):
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        diff = max(abs(lp[i] - t.rollout_logprobs[i]) for i in sampled)
        assert diff < 1e-4, diff
    # The images are inputs of that forward: another screenshot in the same place changes the logprobs.
    swapped = copy.deepcopy(trajs[0])
    swapped.images[1] = type(swapped.images[1])(swapped.images[1].start, swapped.images[1].end,
                                                swapped.images[1].token_id, screenshot(5))
    other = trainer.compute_logprobs([swapped.validate()])[0]
    assert max(abs(a - b) for a, b in zip(other, trained[0])) > 1e-3

    # One policy-gradient step through the images: the sampled tokens move with their advantage's sign,
    # and the vision tower trains too (its gradient comes through the image features and DeepStack).
    vision_before = {k: v.clone() for k, v in trainer.named_weights() if ".visual." in k}
    metrics = trainer.train_step(TrainBatch(trajs, [[1.0] * trajs[0].response_length,
                                                    [-1.0] * trajs[1].response_length]))
    after = trainer.compute_logprobs(trajs)

    def mean_sampled(rows, i):
        return sum(r * m for r, m in zip(rows[i], trajs[i].loss_mask)) / sum(trajs[i].loss_mask)
    assert mean_sampled(after, 0) > mean_sampled(trained, 0) and mean_sampled(after, 1) < mean_sampled(trained, 1)
    assert metrics["logprob_mismatch_max"] < 1e-4
    moved = [k for k, v in trainer.named_weights() if k in vision_before and not torch.equal(v, vision_before[k])]
    assert any("patch_embed" in k for k in moved) and any("deepstack" in k for k in moved)
    trainer.close()


def test_engine_rejects_images_that_do_not_match_the_placeholders(vlm):
    model, tok = vlm
    engine = EmbeddedEngine(model, tok, max_batch_size=2)
    pad = model.config.image_token_id
    ids, images = expand_images(tok.encode("a<|image_pad|>b", add_special_tokens=False), pad, [screenshot(0)])

    async def ask(**kw):
        return await engine.generate(ids, SamplingParams(max_new_tokens=2), **kw)

    with pytest.raises(ValueError, match="placeholder ids but its images cover 0"):
        asyncio.run(ask())
    bad = [type(images[0])(images[0].start, images[0].end + 1, pad, images[0].data)]
    with pytest.raises(ValueError, match="not a run of image placeholder ids"):
        asyncio.run(ask(images=bad))
    text_model, text_tok = build_tiny("tiny-qwen3")
    with pytest.raises(ValueError, match="text-only model"):
        asyncio.run(EmbeddedEngine(text_model, text_tok).generate([1, 2], SamplingParams(), images=images))


def test_vlm_checkpoint_round_trips(vlm, tmp_path):
    model, tok = vlm
    save_hf(model, tok, tmp_path / "vlm")
    again, tok2 = load_hf(tmp_path / "vlm")
    assert type(again).__name__ == "Qwen3VLForConditionalGeneration"
    assert tok2.convert_tokens_to_ids("<|image_pad|>") == again.config.image_token_id == model.config.image_token_id
    ids, _ = expand_images(tok.encode("x<|image_pad|>y", add_special_tokens=False), model.config.image_token_id,
                           [screenshot(1)])
    from miles_agent.models.vision import pixel_inputs

    pixels, grid = pixel_inputs([screenshot(1)])
    x = torch.tensor([ids])
    kw = dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(x == model.config.image_token_id).int())
    with torch.no_grad():
        assert torch.equal(model(x, **kw).logits, again(x, **kw).logits)
