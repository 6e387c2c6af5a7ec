"""The front: `FrontApp`, run by `pagedllm serve` itself or as the Ray Serve ingress `Front`. It takes every HTTP
request, hashes a generating request's prompt (its first blocks, as the replicas' prefix caches chain them) for
the router, and carries the request to an engine replica.

Answers come back as the replica's app made them. A replica whose engine died fails its in-flight requests: a
stream ends with an SSE error event, a whole answer with a 503; a whole answer that produced nothing is tried
once more on another replica, and the failed replica is avoided until Serve replaces it. `/metrics` gathers every
replica's metrics with a `replica` label (and the router's decisions), `/health` is 200 while any replica's
engine runs, and `/replicas/{i}/...` reaches replica `i` (in the order of their ids): `/replicas/0/kv` is its
KV page.
"""

import asyncio
import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from pagedllm.engine import tokenize_prompt
from pagedllm.entrypoints.llm import render_chat
from pagedllm.entrypoints.openai import protocol, tool_parsers
from pagedllm.entrypoints.openai.metrics import METRICS_CONTENT_TYPE
from pagedllm.entrypoints.openai.serving_common import ApiError
from pagedllm.entrypoints.ray_serve import state
from pagedllm.entrypoints.ray_serve.forward import ForwardedRequest, ResponseEnd, ResponseStart
from pagedllm.entrypoints.ray_serve.router import RoutingCounts, prompt_prefix

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "PagedLLMEngine"
REPLICA_HEADER = "x-pagedllm-replica"
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
_GENERATING = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest}
_ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_PER_REPLICA_S = 10.0  # how long /metrics and /health wait for one replica
_FAILURES = (RayActorError, BackPressureError)
RESPONSE_HOMES = 1_000_000  # stored responses' replicas remembered (a few hundred bytes each)

# ---- helpers ------------------------------------------------------------------------------------


async def _forwarded(request: Request, path: str | None = None) -> ForwardedRequest:
    scope = request.scope
    return ForwardedRequest(
        request.method, path or scope["path"], scope["query_string"], list(scope["headers"]), await request.body()
    )


def _prompt_tokens(tokenizer: Any, body: protocol.CompletionRequest | protocol.ChatCompletionRequest) -> list[int]:
    if isinstance(body, protocol.ChatCompletionRequest):
        offered = body.tools and body.tool_choice != "none"
        tools = [tool.model_dump() for tool in body.tools] if offered else None
        conversation, tools = tool_parsers.conversation(body.messages, tools, tokenizer.chat_template)
        template_kwargs = body.chat_template_kwargs
        rendered = render_chat(tokenizer, conversation, body.add_generation_prompt, tools, None, template_kwargs)
        return rendered["prompt_token_ids"]
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt else body.prompt
    if isinstance(prompt, list):  # token ids
        return list(prompt)
    return tokenize_prompt(tokenizer, prompt)[1]


def _is_stream(start: ResponseStart) -> bool:
    return any(name == b"content-type" and value.startswith(b"text/event-stream") for name, value in start.headers)


def _headers(start: ResponseStart) -> dict[str, str]:
    """The replica's headers, and which replica answered (`x-pagedllm-replica`)."""
    skip = {b"content-length", b"transfer-encoding", b"connection"}
    headers = {name.decode(): value.decode() for name, value in start.headers if name.lower() not in skip}
    return headers | {REPLICA_HEADER: start.replica}


async def _whole(rest: DeploymentResponseGenerator) -> tuple[bytes, ResponseEnd | None]:
    """The rest of an answer: its body, and the replica's end (None when the replica died meanwhile)."""
    chunks, end = [], None
    try:
        async for item in rest:
            if isinstance(item, ResponseEnd):
                end = item
            else:
                chunks.append(item)
    except _FAILURES:
        pass
    return b"".join(chunks), end


async def _streamed(rest: DeploymentResponseGenerator, replica: str) -> AsyncIterator[bytes]:
    """A stream's chunks; if the replica itself dies mid-stream, an SSE error event ends it."""
    try:
        async for item in rest:
            if not isinstance(item, ResponseEnd):
                yield item
    except _FAILURES as error:
        state.FAILED.add(replica)
        failure = ApiError(503, f"replica {replica} died while streaming: {error}", kind="server_error")
        yield f"data: {failure.body.model_dump_json()}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        rest.cancel()  # the client left early: the replica's app sees the disconnect and aborts


_RESPONSES = "/v1/responses"
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[0-9a-f]+)"')


class ResponseHomes:
    """Which replica stored each response (`/v1/responses` keeps them in its replica's memory): a continued
    conversation (`previous_response_id`) and `GET`/`DELETE`/`cancel` of a response go to that replica. Bounded,
    oldest out first, as the replicas' own stores are."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._homes: OrderedDict[str, str] = OrderedDict()

    def remember(self, head: bytes, replica: str) -> None:
        """`head`: the start of a /v1/responses answer (the response, or its stream's first event) naming its id."""
        found = _RESPONSE_ID.search(head)
        if found is None:
            return
        self._homes[found.group(1).decode()] = replica
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def home(self, request: ForwardedRequest) -> str | None:
        """The replica holding the response `request` reads or continues, if known."""
        if request.path == _RESPONSES and request.method == "POST":
            try:
                previous = json.loads(request.body).get("previous_response_id")
            except (ValueError, AttributeError):  # not a JSON object: the replica refuses it with its error
                return None
            return self._homes.get(previous) if isinstance(previous, str) else None
        if request.path.startswith(_RESPONSES + "/"):
            return self._homes.get(request.path.split("/")[3])
        return None


async def _sniffed(chunks: AsyncIterator[bytes], homes: ResponseHomes, replica: str) -> AsyncIterator[bytes]:
    """A Responses stream passed on, its id remembered from its first event."""
    first = True
    async for chunk in chunks:
        if first:
            homes.remember(chunk, replica)
            first = False
        yield chunk


def _unavailable(message: str) -> JSONResponse:
    response = ApiError(503, message, kind="server_error").response()
    response.headers["Retry-After"] = "1"
    return response


def _replica_died(replica: str) -> JSONResponse:
    return _unavailable(f"replica {replica}'s engine died while serving the request; retry")


class _Families:
    """A collector of metric families already gathered, for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def gather_metrics(expositions: dict[str, str], extra: list[Metric]) -> bytes:
    """Every replica's exposition (by replica id) as one, each sample labelled with its replica, then `extra`."""
    families: dict[str, Metric] = {}
    for replica, text in expositions.items():
        for family in text_string_to_metric_families(text):
            gathered = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            gathered.samples += [
                sample._replace(labels={"replica": replica, **sample.labels}) for sample in family.samples
            ]
    registry = CollectorRegistry()
    registry.register(_Families([*families.values(), *extra]))
    return generate_latest(registry)


def router_metrics(counts: RoutingCounts) -> list[Metric]:
    decisions = CounterMetricFamily(
        "pagedllm:router_decisions", "Requests the router sent by prefix, by load, or to a named replica", labels=["by"]
    )
    for how, count in counts.decisions.items():
        decisions.add_metric([how], count)
    routed = CounterMetricFamily(
        "pagedllm:router_requests", "Requests the router sent to each replica by prefix or load", labels=["replica"]
    )
    for replica, count in sorted(counts.per_replica.items()):
        routed.add_metric([replica], count)
    return [decisions, routed]


class FrontApp:
    """The front's HTTP side over a handle on the engine deployment, in whichever process holds the handle (and
    so the router): the Serve ingress `Front`, or `pagedllm serve`'s own process under uvicorn."""

    def __init__(self, engines: DeploymentHandle, block_size: int, described: dict[str, Any]) -> None:
        self.engines = engines
        self.block_size = block_size
        self._tokenizer, self._names = described["tokenizer"], described["served_model_names"]
        self._homes = ResponseHomes(RESPONSE_HOMES)
        # The replicas' own schema and docs answer /openapi.json and /docs (the catch-all forwards them).
        self.app = FastAPI(title="pagedllm on Ray", openapi_url=None, docs_url=None, redoc_url=None)
        self.app.add_api_route("/replicas/{index}/{path:path}", self.per_replica, methods=_METHODS)
        self.app.add_api_route("/health", self.health, methods=["GET"])
        self.app.add_api_route("/metrics", self.metrics, methods=["GET"])
        # Added last: FastAPI tries routes in order, and this one takes every path.
        self.app.add_api_route("/{path:path}", self.forward, methods=_METHODS)

    async def per_replica(self, request: Request, index: int, path: str) -> Response:
        replicas = self._replicas()
        if not 0 <= index < len(replicas):
            message = f"no replica {index}: {len(replicas)} are running"
            return ApiError(404, message, param="replica").response()
        forwarded = await _forwarded(request, path="/" + path)
        return await self._answer(forwarded, replica=replicas[index])

    async def _answer(self, request: ForwardedRequest, retry: bool = False, **routing: Any) -> Response:
        answer = await self._start(request, **routing)
        if isinstance(answer, Response):
            if retry:  # the replica died before answering; Serve's router has dropped it already
                return await self._answer(request, prefix=routing.get("prefix"))
            return answer
        start, rest = answer
        stores = request.path == _RESPONSES and request.method == "POST"
        if _is_stream(start):
            chunks = _streamed(rest, start.replica)
            if stores:
                chunks = _sniffed(chunks, self._homes, start.replica)
            return StreamingResponse(chunks, start.status, _headers(start))
        body, end = await _whole(rest)
        if stores and start.status == 200:
            self._homes.remember(body[:512], start.replica)
        dead = end is None or not end.engine_alive
        if dead:
            state.FAILED.add(start.replica)
        if dead and start.status >= 500:
            if retry:
                logger.warning("replica %s failed a request; trying another replica", start.replica)
                return await self._answer(request, avoid=[start.replica], prefix=routing.get("prefix"))
            return _replica_died(start.replica)
        return Response(body, start.status, _headers(start))

    async def _start(
        self, request: ForwardedRequest, **routing: Any
    ) -> tuple[ResponseStart, DeploymentResponseGenerator] | Response:
        try:
            stream = self.engines.options(stream=True).handle.remote(request, **routing)
            first = await stream.__anext__()
        except _FAILURES as error:
            return _unavailable(f"no replica could take the request: {error}")
        return first, stream

    async def _broadcast(self, request: ForwardedRequest) -> Response:
        """An adapter loaded or unloaded on every running replica; the first failure is the answer."""
        answers = [await self._answer(request, replica=replica) for replica in self._replicas()]
        failed = [answer for answer in answers if answer.status_code >= 400]
        return (failed or answers)[0] if answers else _unavailable("no replica is running")

    # ---- the router's input ------------------------------------------------------------------

    async def _prefix(self, request: ForwardedRequest) -> list[int] | None:
        """The prompt's leading block hashes, or None when the body is not one the replicas would run (they
        answer it with its error)."""
        kind = _GENERATING.get(request.path)
        if kind is None or request.method != "POST":
            return None
        try:
            body = kind.model_validate_json(request.body)
            token_ids = await asyncio.to_thread(_prompt_tokens, self._tokenizer, body)
        except Exception:  # an invalid request is the replica's to refuse, with the right error
            return None
        salt = json.dumps([body.cache_salt, body.model]) if body.model not in self._names else body.cache_salt
        return prompt_prefix(token_ids, self.block_size, salt)

    def _replicas(self) -> list[str]:
        router = state.ROUTERS.get(ENGINE_DEPLOYMENT)
        return router.replica_ids() if router is not None else []

    # ---- replicas together ------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        """200 while some replica's engine runs (the body lists each replica's), else 503."""
        replicas = self._replicas()
        # One replica after another: Serve gives the calls one HTTP request makes the same internal id, and routes
        # concurrent ones of them by it.
        states = [await self._replica_health(replica) for replica in replicas]
        alive = sum(state == "ok" or state == "overloaded" for state in states)
        body = {"status": "ok" if alive else "dead", "replicas": dict(zip(replicas, states, strict=True))}
        return JSONResponse(body, status_code=200 if alive else 503)

    async def _replica_health(self, replica: str) -> str:
        answer = await self._get(replica, "/health")
        return "unreachable" if answer is None else json.loads(answer)["status"]

    async def metrics(self) -> Response:
        """Every replica's metrics, each sample labelled with its replica, then the router's counts."""
        expositions = {}
        for replica in self._replicas():  # one after another, as in health()
            text = await self._get(replica, "/metrics")
            if text is not None:
                expositions[replica] = text.decode()
        router = state.ROUTERS.get(ENGINE_DEPLOYMENT)
        extra = router_metrics(router.counts) if router is not None else []
        return Response(gather_metrics(expositions, extra), media_type=METRICS_CONTENT_TYPE)

    async def _get(self, replica: str, path: str) -> bytes | None:
        """One replica's answer to a GET of `path`, or None if it did not answer within _PER_REPLICA_S."""
        try:
            return await asyncio.wait_for(self._fetch(replica, path), _PER_REPLICA_S)
        except TimeoutError:
            return None

    async def _fetch(self, replica: str, path: str) -> bytes | None:
        answer = await self._start(ForwardedRequest("GET", path, b"", [], b""), replica=replica)
        if isinstance(answer, Response):
            return None
        body, _ = await _whole(answer[1])
        return body

    async def forward(self, request: Request, path: str) -> Response:
        forwarded = await _forwarded(request)
        if forwarded.path in _ADAPTER_PATHS:
            return await self._broadcast(forwarded)
        home = self._homes.home(forwarded)
        if home is not None and home in self._replicas():
            return await self._answer(forwarded, replica=home)  # only that replica holds the conversation
        prefix = await self._prefix(forwarded)
        return await self._answer(forwarded, prefix=prefix, retry=True)


# Serve ships this class by value (its globals copied): the router's shared state is reached as `state.NAME`.
@serve.ingress()
class Front:
    """The Serve ingress (Serve's proxy in front of it): a `FrontApp` over the engine deployment."""

    async def __init__(self, engines: DeploymentHandle, block_size: int) -> None:
        # The first call also starts this process's router, which the aggregated routes list replicas through.
        self.front = FrontApp(engines, block_size, await engines.describe.remote())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.front.app
