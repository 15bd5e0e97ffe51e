"""The frontend's edge: what every HTTP request passes before a route reads it, and what catches it after.

- A body is JSON (415 otherwise: a `text/plain` POST is a CORS "simple request", which any web page in the
  user's browser may send to a loopback server without asking), of at most `max_body_bytes`: refused with a
  413 as soon as the declared length or the bytes read so far pass it, never after reading all of it.
- It is parsed by pydantic-core's parser, which refuses what Python's `json` takes: lone surrogates
  (`"\\ud800"`, which failed later as a 500 when encoded), NaN and Infinity, and nesting past 200 levels
  (a RecursionError, and a 500, in `json`).
- Anything a route didn't foresee is a 500 in OpenAI's error shape, and one log line naming where it
  happened: never a traceback, whose frames and message may quote the request's text.
- FastAPI's own refusals (404, 405) get OpenAI's error shape too.
- After a large body, freed heap goes back to the system (release_memory).
"""

from __future__ import annotations

import asyncio
import logging
import traceback

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from pipeline.heap import release_memory
from pipeline.openai_api.connections import BODY_TIMEOUT_S
from pipeline.openai_api.protocol import ProtocolError, shown_name

log = logging.getLogger("pipeline.openai_api")
JSON_TYPE = "application/json"
# A request line and its headers. uvicorn's h11 refuses a head still incomplete past this (h11's own default), but
# takes one that arrives whole in a single read (200 KB did on loopback): Guard refuses that one. Unbounded
# headers were vLLM's CVE-2025-48956.
HEAD_BYTES = 16 * 1024
MIN_BODY_BYTES = 1 << 20
BODY_PER_INPUT_BYTE = 4  # JSON escapes make a body longer than the text it carries (\u00e9 is 6 bytes for 2)
TRIM_AFTER_BYTES = 1 << 16  # a body this large leaves enough freed heap behind to hand back (release_memory)
ERROR_CHARS = 200  # of a library's own error message, quoted in ours


def default_max_body_bytes(max_input_bytes: int) -> int:
    """Room for a prompt as long as the engine takes, escaped, and the rest of the request; at least 1 MiB."""
    return max(MIN_BODY_BYTES, BODY_PER_INPUT_BYTE * max_input_bytes)


async def read_json(request: Request, max_body_bytes: int, timeout_s: float = BODY_TIMEOUT_S):
    """The request's body, parsed; refused with 415, 413, 408 (the whole body not there within `timeout_s`: a
    Content-Length larger than what is sent, a chunk that never ends) or 400 in OpenAI's shape."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != JSON_TYPE:
        raise ProtocolError(f"the request body must be sent as {JSON_TYPE} (got {kind or 'no Content-Type'}); set "
                            f"the header Content-Type: {JSON_TYPE}", status=415, code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(int(declared), max_body_bytes)
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > max_body_bytes:  # a chunked body declares no length: count it as it comes
                    raise _too_large(size, max_body_bytes, more=True)
                parts.append(part)
    except TimeoutError:
        raise ProtocolError(f"the request body did not arrive within {timeout_s:g} s ({size} bytes came); send the "
                            "whole body, as long as its Content-Length says", status=408,
                            code="request_timeout") from None
    try:
        return pydantic_core.from_json(b"".join(parts), allow_inf_nan=False)
    except ValueError as err:
        hint = " (\\ud800-\\udfff escapes come in pairs: one alone is no character)" if "surrogate" in str(err) or \
            "end of hex escape" in str(err) else ""
        raise ProtocolError(f"the request body is not valid JSON ({err}){hint}; send one JSON object in "
                            "UTF-8") from None


class ClientLeft(Exception):
    """The client closed its connection before its answer was ready: the work for it was cancelled."""


async def unless_client_leaves(request: Request, awaitable):
    """`awaitable`'s result; cancelled, raising ClientLeft, as soon as the client closes the connection. A whole
    answer writes nothing until it is done, so nothing else notices a client that gave up: 16 choices of 2000
    tokens were decoded for nobody while the queue filled. (A streamed answer, once it starts, is watched by
    Starlette's own listen_for_disconnect.) The body must have been read: this waits on the next ASGI message."""
    work = asyncio.ensure_future(awaitable)
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([work, left], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the route itself is cancelled (shutdown): so is the work
        work.cancel()
        raise
    finally:
        left.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientLeft


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _too_large(size: int, limit: int, more: bool = False) -> ProtocolError:
    return ProtocolError(f"the request body is {'at least ' if more else ''}{size} bytes, over this server's limit of "
                         f"{limit} (`pipeline serve --openai-max-body-bytes`); shorten the request", status=413,
                         code="request_too_large")


def where(err: BaseException) -> str:
    """Where an exception was raised, as file:line in function: no message, no source text."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"


def shown_error(err: BaseException) -> str:
    """A library's error message as ours quotes it: cut, since it may quote the request."""
    text = " ".join(str(err).split())
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


def internal_error() -> ProtocolError:
    return ProtocolError("the server failed this request; it goes on serving others. Retry, or report it with "
                         "the time it happened (the frontend's log has a line for it)", status=500,
                         type="internal_server_error")


def log_failure(method: str, path: str, err: BaseException) -> None:
    log.error("%s %s failed: %s at %s", method, path, type(err).__name__, where(err))


class Guard:
    """ASGI middleware around every request. A head over HEAD_BYTES is a 431. An exception no handler took
    becomes a 500 in OpenAI's shape and one log line (it sits inside Starlette's ServerErrorMiddleware, which
    would answer in plain text and re-raise to uvicorn, which logs the whole traceback). After a request whose
    body was large, what parsing and tokenizing it freed goes back to the system."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head = len(scope.get("raw_path", b"")) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > HEAD_BYTES:
            error = ProtocolError(f"the request's headers are {head} bytes, over this server's limit of {HEAD_BYTES}; "
                                  "send fewer or shorter ones", status=431, code="request_header_fields_too_large")
            return await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
        started, received = False, 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except Exception as err:  # noqa: BLE001  one request's failure, answered and logged in one line
            log_failure(scope.get("method", "?"), scope.get("path", "?"), err)
            if not started:
                error = internal_error()
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
        finally:
            if received > TRIM_AFTER_BYTES:
                await asyncio.to_thread(release_memory)


def install(app: FastAPI) -> None:
    """OpenAI's error shape for every refusal: ours, FastAPI's routing ones, and the unforeseen."""
    @app.exception_handler(ProtocolError)
    async def refused(request, err: ProtocolError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def routing(request, err: HTTPException):  # 404 no such route, 405 wrong method
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        error = ProtocolError(f"{request.method} {shown_name(request.url.path)}: {err.detail}",
                              status=err.status_code, type=kind)
        return JSONResponse(error.body(), status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(ClientLeft)
    async def left(request, err: ClientLeft):  # nobody reads it: uvicorn drops what is sent after a disconnect
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError):
        return JSONResponse(ProtocolError("the request is malformed; see the API's /openapi.json").body(),
                            status_code=400)

    app.add_middleware(Guard)
