"""A NeMo Gym resources server written to its contract, for the adapter tests (nemo-gym itself needs
Python >= 3.13.14 and cannot be installed here).

What it mirrors, from NVIDIA-NeMo/Gym: the routes of ``SimpleResourcesServer``
(nemo_gym/base_resources_server.py: ``POST /seed_session``, ``POST /verify``) plus one route per tool,
the toy task of resources_servers/example_session_state_mgmt/app.py (a per-session counter with
``increment_counter`` / ``get_counter_value``, seeded by ``initial_count``, verified against
``expected_count``), the session cookie set on the first answer (nemo_gym/server_utils.py
``setup_session_middleware``), FastAPI's 422 on a body that fails its model, and the request/response
models: ``BaseVerifyRequest`` (``responses_create_params`` + ``response``), ``NeMoGymResponse`` output
items (nemo_gym/openai_utils.py) and ``BaseMultiRewardVerifyResponse`` (``reward`` + ``reward_components``).
Verify here scores two things: the counter reached ``expected_count``, and the final assistant message
states it.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from aiohttp import web
from openai.types.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

COOKIE = "SimpleResourcesServer___counter"  # NeMo Gym names its session cookie after the server


class OutputText(BaseModel):
    annotations: list[Any]
    text: str
    type: Literal["output_text"] = "output_text"


class OutputMessage(BaseModel):
    id: str
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    type: Literal["message"] = "message"


class FunctionToolCall(BaseModel):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(BaseModel):
    call_id: str
    output: str
    type: Literal["function_call_output"] = "function_call_output"


class GymResponse(Response):  # NeMoGymResponse: the Responses object with Gym's output item union
    output: list[OutputMessage | FunctionToolCall | FunctionCallOutput]


class CreateParams(BaseModel):  # the fields of NeMoGymResponseCreateParamsNonStreaming a row uses here
    model_config = ConfigDict(extra="forbid")
    input: str | list[dict[str, Any]]
    tools: list[dict[str, Any]] = []
    instructions: str | None = None


class SeedRequest(BaseModel):  # StatefulCounterSeedSessionRequest
    initial_count: int


class VerifyRequest(BaseModel):  # StatefulCounterVerifyRequest(BaseVerifyRequest)
    responses_create_params: CreateParams
    response: GymResponse
    expected_count: int


class IncrementRequest(BaseModel):
    count: int


class CounterServer:
    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.log: list[tuple[str, str, dict[str, Any]]] = []  # (session, route, body)
        self.verified: list[dict[str, Any]] = []  # every /verify request and the reward it got

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._session])
        for route, fn in (("/seed_session", self.seed_session), ("/verify", self.verify),
                          ("/increment_counter", self.increment_counter),
                          ("/get_counter_value", self.get_counter_value)):
            app.router.add_post(route, fn)
        return app

    @web.middleware
    async def _session(self, request: web.Request, handler):
        session = request.cookies.get(COOKIE) or uuid.uuid4().hex
        body = await request.json() if request.can_read_body else {}
        self.log.append((session, request.path, body))
        try:
            response = await handler(request, body, session)
        except ValidationError as e:  # FastAPI's answer to a body that fails its model
            response = web.json_response({"detail": e.errors(include_url=False, include_context=False)},
                                         status=422)
        response.set_cookie(COOKIE, session)
        return response

    async def seed_session(self, request: web.Request, body: dict[str, Any], session: str) -> web.Response:
        seed = SeedRequest.model_validate(body)
        self.counters.setdefault(session, seed.initial_count)
        return web.json_response({})

    async def increment_counter(self, request: web.Request, body: dict[str, Any], session: str) -> web.Response:
        inc = IncrementRequest.model_validate(body)
        self.counters[session] = self.counters.get(session, 0) + inc.count
        return web.json_response({"success": True})

    async def get_counter_value(self, request: web.Request, body: dict[str, Any], session: str) -> web.Response:
        return web.json_response({"count": self.counters.setdefault(session, 0)})

    async def verify(self, request: web.Request, body: dict[str, Any], session: str) -> web.Response:
        req = VerifyRequest.model_validate(body)
        counted = float(self.counters.get(session) == req.expected_count)
        messages = [o for o in req.response.output if isinstance(o, OutputMessage)]
        final = messages[-1].content[0].text if messages else ""
        stated = float(str(req.expected_count) in final)
        reward = (counted + stated) / 2
        self.verified.append({"request": body, "reward": reward})
        return web.json_response({**body, "reward": reward,
                                  "reward_components": {"count": counted, "answer": stated}})


ROW_TOOLS = [
    {"name": "increment_counter", "parameters": {"type": "object", "properties": {"count": {
        "type": "integer", "description": ""}}, "required": ["count"], "additionalProperties": False},
     "strict": True, "type": "function", "description": ""},
    {"name": "get_counter_value", "parameters": {"type": "object", "properties": {}, "required": [],
                                                 "additionalProperties": False},
     "strict": True, "type": "function", "description": ""},
]


def counter_row(text: str, initial: int, expected: int) -> dict[str, Any]:
    """A dataset row in the shape of example_session_state_mgmt/data/example.jsonl."""
    return {"responses_create_params": {"input": [{"content": text, "role": "user"}], "tools": ROW_TOOLS},
            "expected_count": expected, "initial_count": initial}
