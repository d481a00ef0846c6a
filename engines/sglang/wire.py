"""SGLang's ``/generate`` wire format, both ways, with no HTTP in it (so it is tested byte for byte).

Request: `GenerateReqInput` (sglang/srt/managers/io_struct.py) -- ``input_ids``, ``sampling_params``,
``return_logprob``, ``return_routed_experts``, ``image_data`` (base64 PNG data URLs). Response (tokenizer_manager.py, non-streaming):
``{"text", "output_ids", "meta_info"}`` with ``meta_info`` keys ``finish_reason`` (``{"type": "stop",
"matched": ...}``, ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``; None while
unfinished), ``prompt_tokens``, ``completion_tokens``, ``weight_version`` (a string), ``weight_versions``
(spans ``{"version", "start", "end"}`` over output tokens), ``output_token_logprobs`` as
``[logprob, token_id, text]`` triples, and ``routed_experts``: base64 of the int32 array
``(prompt_tokens + completion_tokens - 1, layers, top_k)`` in C order (the detokenizer's
``_b64_encode_per_request``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from miles_agent.engine import Completion, FinishReason, SamplingParams

PNG_DATA_URL = "data:image/png;base64,"


def decode_image_data(items: Sequence[str]) -> list[bytes]:
    """``image_data`` entries back to image bytes (base64, with or without a data-URL prefix)."""
    return [base64.b64decode(s.split(",", 1)[1] if s.startswith("data:") else s) for s in items]


class GenerateResponseError(ValueError):
    """A ``/generate`` response that does not have SGLang's shape (or contradicts itself)."""


def generate_payload(input_ids: list[int], sampling: SamplingParams, *, return_routed_experts: bool,
                     images: Sequence[Any] = ()) -> dict:
    """SGLang's ``/generate`` body. ``images`` (`ImageInput`s, in token order) go as ``image_data``, SGLang's
    multimodal field: one base64 data URL per image, beside ``input_ids`` that already hold each image's
    expanded placeholder run (token in, token out: the server does not re-tokenize)."""
    payload: dict[str, Any] = {"input_ids": [int(t) for t in input_ids], "sampling_params": sampling.to_sglang(),
                               "return_logprob": True}
    if images:
        payload["image_data"] = [PNG_DATA_URL + base64.b64encode(im.data).decode("ascii") for im in images]
    if return_routed_experts:
        payload["return_routed_experts"] = True
    if sampling.lora_path is not None:  # GenerateReqInput.lora_path: the loaded adapter serving this request
        payload["lora_path"] = sampling.lora_path
    return payload


def encode_routed_experts(routed: np.ndarray) -> str:
    """What SGLang's detokenizer sends: base64 of the int32 bytes."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(data: str, rows: int, top_k: int | None = None, layers: int | None = None) -> np.ndarray:
    """The int32 ``(rows, layers, top_k)`` array from SGLang's base64 string. The payload carries no shape:
    ``rows`` comes from the token counts, and one of ``layers`` / ``top_k`` from the model config."""
    flat = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    if rows <= 0:
        raise GenerateResponseError(f"routed_experts for {rows} rows (prompt + output - 1) makes no sense")
    if flat.size % rows:
        raise GenerateResponseError(f"routed_experts holds {flat.size} ids, not a multiple of its {rows} rows "
                                    "(prompt_tokens + completion_tokens - 1)")
    per_row = flat.size // rows
    if layers is None and top_k is None:
        raise GenerateResponseError("decoding routed_experts needs the MoE layer count or top_k of the model")
    if layers is None:
        assert top_k is not None
        layers = per_row // top_k
    top_k = per_row // layers if top_k is None else top_k
    if layers * top_k != per_row:
        raise GenerateResponseError(f"routed_experts has {per_row} ids per token, not layers x top_k = "
                                    f"{layers} x {top_k}; does the model config match the server's model?")
    return flat.reshape(rows, layers, top_k).copy()


def finish_reason(meta: dict[str, Any]) -> tuple[FinishReason, Any]:
    """(our FinishReason, what matched or the abort message) from ``meta_info["finish_reason"]``."""
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or "type" not in fr:
        raise GenerateResponseError(f"meta_info.finish_reason must be a dict with a 'type', got {fr!r}")
    kind = fr["type"]
    if kind == "stop":
        return FinishReason.STOP, fr.get("matched")
    if kind == "length":
        return FinishReason.LENGTH, fr.get("length")
    if kind == "abort":
        return FinishReason.ABORT, fr.get("message")
    raise GenerateResponseError(f"unknown finish_reason type {kind!r}")


def as_version(value: Any, fallback: int) -> int:
    """SGLang's weight versions are strings (a server started without one reports e.g. "default"):
    an integer string is ours, anything else means "the version the client last set"."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback


def parse_generate_response(body: dict[str, Any], *, prompt_len: int, want_routed: bool,
                            routed_top_k: int | None = None, routed_layers: int | None = None,
                            current_version: int = 0) -> Completion:
    """A `Completion` from one non-streaming ``/generate`` response body."""
    try:
        output_ids = [int(t) for t in body["output_ids"]]
        meta = body["meta_info"]
    except (KeyError, TypeError) as e:
        raise GenerateResponseError(f"/generate response lacks output_ids / meta_info: {e!r}") from e
    reason, detail = finish_reason(meta)
    triples = meta.get("output_token_logprobs") or []
    if len(triples) != len(output_ids):
        raise GenerateResponseError(f"output_token_logprobs has {len(triples)} entries for {len(output_ids)} "
                                    "output tokens (was return_logprob sent?)")
    logprobs = []
    for i, (entry, tok) in enumerate(zip(triples, output_ids, strict=True)):
        if int(entry[1]) != tok:
            raise GenerateResponseError(f"output_token_logprobs[{i}] is for token {entry[1]}, output_ids has {tok}")
        logprobs.append(float(entry[0]))
    prompt_tokens = int(meta.get("prompt_tokens", prompt_len))
    spans = meta.get("weight_versions") or []
    version = as_version(meta.get("weight_version"), current_version)
    out_meta: dict[str, Any] = {"rid": meta.get("id"), "retractions": int(meta.get("num_retractions", 0) or 0),
                                "weight_versions": [(as_version(s["version"], version), int(s["start"]))
                                                    for s in spans] or [(version, 0)]}
    if reason is FinishReason.STOP and detail is not None:
        out_meta["matched_stop"] = detail
    if reason is FinishReason.ABORT:
        out_meta["abort_message"] = detail
    routed = None
    if want_routed:
        data = meta.get("routed_experts")
        if data:
            routed = decode_routed_experts(data, prompt_tokens + len(output_ids) - 1, routed_top_k, routed_layers)
        else:  # SGLang omits it when the request was aborted before its prefill
            out_meta["routed_experts_missing"] = True
    return Completion(output_ids=output_ids, output_logprobs=logprobs, finish_reason=reason,
                      weight_version=version, prompt_tokens=prompt_tokens, routed_experts=routed, meta=out_meta)
