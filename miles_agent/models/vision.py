"""Image inputs of a vision-language policy: PNG bytes -> ``pixel_values`` / ``image_grid_thw``, offline.

The processor is transformers' own Qwen2-VL image processor (the PIL backend, no torchvision), built from
its parameters rather than downloaded, so the engine, the trainer and the harness that counts placeholder
tokens all see one resize and one patching. A screenshot becomes ``grid_t * grid_h * grid_w / merge**2``
``<|image_pad|>`` tokens; ``max_pixels`` bounds that count (1024x768 at the default -> 54 tokens).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

PATCH = 16  # Qwen3-VL's patch size
MERGE = 2  # spatial merge: one LLM token per MERGE x MERGE patches
MIN_PIXELS = 4 * (PATCH * MERGE) ** 2
MAX_PIXELS = 64 * (PATCH * MERGE) ** 2


@lru_cache(maxsize=8)
def image_processor(max_pixels: int = MAX_PIXELS) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": max_pixels},
                                    patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2)


def _rgb(png: bytes) -> Any:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        return im.convert("RGB")


def pixel_inputs(pngs: Sequence[bytes], max_pixels: int = MAX_PIXELS) -> tuple[Any, Any]:
    """``(pixel_values [patches, 3*2*16*16] float32, image_grid_thw [images, 3] long)`` for the PNGs, in order."""
    out = image_processor(max_pixels)(images=[_rgb(p) for p in pngs], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def placeholder_count(png: bytes, max_pixels: int = MAX_PIXELS) -> int:
    """How many ``<|image_pad|>`` tokens the model reads this image as."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from miles_agent.types import png_size

    size = png_size(png)
    if size is None:
        from miles_agent.errors import UserError

        raise UserError("an image input is not a PNG; screenshots must be PNG bytes")
    w, h = size
    rh, rw = smart_resize(h, w, factor=PATCH * MERGE, min_pixels=MIN_PIXELS, max_pixels=max_pixels)
    return (rh // PATCH) * (rw // PATCH) // MERGE ** 2


def vision_token_ids(model_or_config: Any) -> tuple[int, int] | None:
    """``(image_token_id, spatial_merge_size)`` of a vision-language model, None for a text-only one."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if getattr(cfg, "vision_config", None) is None or getattr(cfg, "image_token_id", None) is None:
        return None
    return int(cfg.image_token_id), int(cfg.vision_config.spatial_merge_size)


def expand_images(ids: Sequence[int], image_token_id: int, pngs: Sequence[bytes], offset: int = 0,
                  max_pixels: int = MAX_PIXELS) -> tuple[list[int], list[Any]]:
    """A render's ids with its one ``<|image_pad|>`` per image (in order) widened to the image's placeholder
    count, and the `ImageInput`s over them (at ``offset`` + their position in the returned ids)."""
    from miles_agent.tito import image_inputs

    out: list[int] = []
    queue = list(pngs)
    for t in ids:
        if t == image_token_id:
            if not queue:
                from miles_agent.types import TrajectoryError

                raise TrajectoryError(f"the render holds more image placeholders than the {len(pngs)} images given")
            out.extend([t] * placeholder_count(queue.pop(0), max_pixels))
        else:
            out.append(t)
    return out, image_inputs(out, image_token_id, list(pngs), offset)


def suppressed_ids(model_or_config: Any) -> list[int]:
    """Ids a vision-language policy never writes: the image and video placeholders and vision markers. The
    engine's sampling and the trainer's log-softmax both mask them (a sampled placeholder would be read
    as an image slot), so the two see one distribution."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if vision_token_ids(cfg) is None:
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(cfg, n)) for n in names if getattr(cfg, n, None) is not None})


def mask_suppressed(logits: Any, ids: Any) -> Any:
    """``logits`` with the columns ``ids`` (a long tensor, or None) at a large negative value (finite, so an
    entropy's ``p * logit`` stays 0)."""
    if ids is None or not len(ids):
        return logits
    return logits.index_fill(-1, ids, -1e9)
