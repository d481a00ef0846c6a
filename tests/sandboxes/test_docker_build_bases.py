"""Which images a task's Dockerfile depends on: they key its build cache beside the context's bytes."""

from __future__ import annotations

from miles_agent.sandboxes._docker_build import base_images


def test_bases_are_the_from_and_copy_from_images_but_not_the_files_own_stages(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "ARG V=3.13\n"
        "FROM --platform=linux/amd64 python:3.13-slim AS builder\n"
        "RUN echo hi\n"
        "FROM python:${V}-slim\n"  # resolved only at build: left out
        "COPY --from=builder /x /x\n"
        "COPY --from=ghcr.io/astral-sh/uv:0.8.15 /uv /uvx /bin/\n"
        "COPY --from=0 /y /y\n"
        "from Builder as final\n"
        "FROM scratch\n")
    assert base_images(dockerfile) == ["python:3.13-slim", "ghcr.io/astral-sh/uv:0.8.15"]
