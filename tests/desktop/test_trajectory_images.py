"""Images in TITO trajectories: stored beside the ids, their placeholder spans checked by validate()."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from miles_agent.tito import image_inputs
from miles_agent.types import ImageInput, Trajectory, TrajectoryError, png_size

PAD = 9  # the image placeholder id


def png(width: int, height: int, shade: int = 0) -> bytes:
    raw = b"".join(b"\0" + bytes([shade, 0, 0]) * width for _ in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def traj_with_images() -> Trajectory:
    prompt = [1, 2, PAD, PAD, PAD, 3]
    t = Trajectory(prompt_ids=prompt, images=[ImageInput(2, 5, PAD, png(4, 3))])
    t.append_model([4, 5], [-0.1, -0.2], weight_version=0, turn=0)
    t.append_observation([6, PAD, PAD, 7], turn=1, images=[ImageInput(1, 3, PAD, png(2, 2, 200))])
    t.append_model([8], [-0.3], weight_version=0, turn=1)
    t.reward = 1.0
    return t


def test_observation_images_land_at_their_placeholder_tokens_and_validate():
    t = traj_with_images().validate()
    assert [(im.start, im.end) for im in t.images] == [(2, 5), (9, 11)]
    assert t.tokens[9:11] == [PAD, PAD] and t.loss_mask == [1, 1, 0, 0, 0, 0, 1]
    assert (t.images[1].width, t.images[1].height) == (2, 2)


def test_serialization_round_trips_images_through_json():
    t = traj_with_images()
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict()))).validate()
    assert [im.data for im in back.images] == [im.data for im in t.images]
    assert [(im.start, im.end, im.sha256) for im in back.images] == [(im.start, im.end, im.sha256) for im in t.images]
    assert "images" not in Trajectory(prompt_ids=[1]).to_dict()  # text-only dumps are unchanged


@pytest.mark.parametrize("breakage, message", [
    (lambda t: t.tokens.__setitem__(10, 7), "not all its placeholder id"),
    (lambda t: setattr(t.images[1], "end", 12), "not all its placeholder id"),
    (lambda t: setattr(t.images[1], "data", png(3, 2)), "size or sha256"),
    (lambda t: setattr(t.images[1], "data", png(2, 2, 1)), "size or sha256"),
    (lambda t: t.images.reverse(), "out of order"),
    (lambda t: setattr(t.images[1], "end", 99), "outside"),
])
def test_validate_names_a_placeholder_span_that_does_not_match_its_image(breakage, message):
    t = traj_with_images()
    breakage(t)
    with pytest.raises(TrajectoryError, match=message):
        t.validate()


def test_an_image_span_over_sampled_tokens_is_refused():
    t = Trajectory(prompt_ids=[1])
    t.append_model([PAD, PAD], [-0.1, -0.1], weight_version=0, turn=0)
    t.images.append(ImageInput(1, 3, PAD, png(1, 1)))
    t.reward = 0.0
    with pytest.raises(TrajectoryError, match="sampled"):
        t.validate()


def test_image_inputs_finds_each_expanded_pad_run_in_order_and_counts_them():
    ids = [1, PAD, PAD, 2, PAD, 3]
    a, b = png(1, 1), png(2, 1)
    ims = image_inputs(ids, PAD, [a, b], offset=10)
    assert [(im.start, im.end, im.data) for im in ims] == [(11, 13, a), (14, 15, b)]
    with pytest.raises(TrajectoryError, match="2 image placeholder runs in the ids for 1 images"):
        image_inputs(ids, PAD, [a])


def test_png_size_reads_the_header_and_rejects_other_bytes():
    assert png_size(png(7, 5)) == (7, 5)
    assert png_size(b"GIF89a....") is None
