"""One request to the served `ensemble`, as an async stream of chunks, over gRPC.

The ensemble has a decoupled step, so Triton serves it over the streaming RPC only (as
pipeline.client.ensemble explains). This is that client's asyncio twin for the HTTP frontend: one gRPC
channel for the process, one stream per request, so an error is the request's own. Closing a stream early (the HTTP
client left) stops its request without cancelling the stream: the `stop_request` model is asked to stop the request
by its id, the gate ends it with its final response, and the stream is read to that end. Cancelling a stream as its
last response goes out is what the bundled tritonserver 2.51 can die of (docs/reliability.md), so a cancel is left
for a repository without that model, or a stop whose end doesn't come within STOP_WITHIN_S.

tritonclient's asyncio client can't ask for the empty final response (it refuses `triton_*` request
parameters), and without it a decoupled stream's end is never seen; so the request is built with
tritonclient's own helper, that flag set on it, and sent on the protobuf stub tritonclient generates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from pipeline.client.ensemble import (BUSY_RETRY_S, CHANNEL_OPTIONS, ENSEMBLE, READY_EVERY_S, STOP_MODEL, STOP_WITHIN_S,
                                      Chunk, RequestOptions, build_inputs, chunk_of, grpc_target, request_id,
                                      stop_inputs)
from pipeline.policy.serving_gate import BUSY_PREFIX, STOPPING_PREFIX

_ENSEMBLE_PREFIX = f"in ensemble '{ENSEMBLE}', "


class EnsembleError(Exception):
    """The ensemble refused the request (`refused`: its one line is the client's to read), or the server
    could not be reached or was lost (`refused` False)."""

    def __init__(self, message: str, refused: bool):
        super().__init__(message)
        self.message, self.refused = message, refused

    @property
    def busy(self) -> bool:
        """Refused by the gate or the engine as busy (serving_gate.busy_message): a 503 the client may retry."""
        return self.message.startswith(BUSY_PREFIX)

    @property
    def lost(self) -> bool:
        """A request failed by a dead engine stub, just before the supervisor restarts the server: resumable."""
        return "is not healthy" in self.message

    @property
    def stopping(self) -> bool:
        """Refused by a server that is being stopped (pipeline.triton.drain): retried elsewhere, as a busy one's."""
        return self.message.startswith(STOPPING_PREFIX)


class Ensemble:
    """The ensemble on one tritonserver. Create and use inside one event loop."""

    def __init__(self, url: str, model: str = ENSEMBLE, resume_s: float = 120.0):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.target = grpc_target(url)
        self.model = model
        # An answer cut off by a lost server waits this long for it to be ready again and resumes from the tokens it
        # has (pipeline.client.ensemble.ClientOptions.resume_s); 0: it fails at once.
        self.resume_s = resume_s
        self.resumed = 0  # answers resumed so far, for the frontend's /metrics
        self.channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        # How each stream ended: read to its final response (or a refusal, or a broken stream), stopped early and
        # then read to its end, or cancelled. The frontend's /metrics shows them: a cancel is what the bundled
        # tritonserver's crash needs.
        self.stream_ends = {"read": 0, "stopped": 0, "cancelled": 0}
        self._stops: bool | None = None  # whether the repository has STOP_MODEL; asked once
        self._tasks: set[asyncio.Task] = set()  # each stream's reader and early ending, kept until they end

    async def close(self) -> None:
        await self.channel.close()

    async def ready(self, timeout_s: float = 2.0) -> bool:
        import grpc
        from tritonclient.grpc import service_pb2

        try:
            response = await self.stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return response.ready

    def _request(self, text: str, options: RequestOptions):
        from tritonclient.grpc._utils import _get_inference_request

        request = _get_inference_request(
            model_name=self.model, inputs=build_inputs(text, options), model_version="",
            request_id=request_id("openai"), outputs=None, sequence_id=0, sequence_start=False,
            sequence_end=False, priority=0, timeout=None, parameters=None)
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        return request

    async def stream(self, text: str, options: RequestOptions) -> AsyncIterator[Chunk]:
        """Send one request; yield its chunks. Leaving early stops it in the server (`_stop`). Where the server is
        lost mid-answer (a broken stream, a dead engine stub), the server is waited for (resume_s) and the request
        sent again with the tokens received as resume_token_ids: the chunks read as one answer, none repeated."""
        have: list[int] = []
        with_ids = True  # every chunk so far said its tokens' ids (the LLM-API route's say none)
        resuming, deadline = False, 0.0
        while len(options.resume_ids) + len(have) < options.max_tokens:
            attempt = self._attempt(text, replace(options, resume_ids=options.resume_ids + tuple(have),
                                                  resumed=options.resumed or resuming))
            try:
                async for chunk in attempt:
                    have += chunk.token_ids
                    with_ids = with_ids and len(chunk.token_ids) == chunk.tokens
                    yield chunk
                return
            except EnsembleError as err:
                if resuming and err.busy and time.monotonic() < deadline:
                    # A restarted server meets every resumed answer at once: one refused as busy waits its turn.
                    await asyncio.sleep(BUSY_RETRY_S)
                    continue
                if (err.refused and not err.lost) or not self.resume_s or not with_ids \
                        or not await self._back_within(self.resume_s):
                    raise
                if not resuming:
                    self.resumed += 1
                resuming, deadline = True, time.monotonic() + self.resume_s
            finally:
                await attempt.aclose()

    async def _back_within(self, seconds: float) -> bool:
        """Whether the ensemble is ready again within `seconds` (a supervisor's restart takes about ten)."""
        deadline = time.monotonic() + seconds
        while not await self.ready():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(READY_EVERY_S)
        return True

    async def _attempt(self, text: str, options: RequestOptions) -> AsyncIterator[Chunk]:
        """One request's stream, as sent: its chunks, or the EnsembleError that ends it."""
        import grpc
        from tritonclient.grpc import InferResult

        request = self._request(text, options)
        ended = asyncio.Event()

        async def requests():
            yield request
            await ended.wait()  # half-closing the stream early would end it before the responses

        t0 = time.perf_counter()
        call = self.stub.ModelStreamInfer(requests())
        # Read by a task of its own: a consumer cancelled while it waits (the HTTP client left) must not cancel the
        # read, and with it the stream, before the request is stopped.
        responses: asyncio.Queue = asyncio.Queue()
        reader = asyncio.get_running_loop().create_task(_read_all(call, responses))
        self._tasks.add(reader)
        reader.add_done_callback(self._tasks.discard)
        finished = False
        try:
            while (response := await responses.get()) is not None:
                if isinstance(response, grpc.aio.AioRpcError):
                    finished = True
                    raise EnsembleError(f"tritonserver at {self.target} failed the request ({response.code().name}: "
                                        f"{(response.details() or '')[:160]})", refused=False)
                if response.error_message:
                    finished = True
                    raise EnsembleError(" ".join(response.error_message.split()).removeprefix(_ENSEMBLE_PREFIX),
                                        refused=True)
                infer = response.infer_response
                if infer.outputs:
                    yield chunk_of(InferResult(infer), time.perf_counter() - t0)
                if infer.parameters["triton_final_response"].bool_param:
                    finished = True
                    return
            finished = True
            raise EnsembleError(f"tritonserver at {self.target} closed the stream before the answer ended",
                                refused=False)
        finally:
            if finished:
                self.stream_ends["read"] += 1
                ended.set()  # the stream half-closes, and the reader ends with it
            else:
                # A task of its own, shielded: the consumer may be cancelled again while it waits (the HTTP server
                # cancels a response whose client left), and the request must still be stopped or cancelled.
                ending = asyncio.get_running_loop().create_task(self._end_early(request.id, call, responses, ended))
                self._tasks.add(ending)
                ending.add_done_callback(self._tasks.discard)
                await asyncio.shield(ending)

    async def _end_early(self, rid: str, call, responses: asyncio.Queue, ended: asyncio.Event) -> None:
        """A stream its consumer left: the request stopped (`_stop`), else the stream cancelled; then half-closed."""
        stopped = False
        try:
            stopped = await self._stop(rid, responses)
        finally:
            if not stopped:
                call.cancel()  # no stop model, or its end didn't come: the server stops decoding it all the same
            self.stream_ends["stopped" if stopped else "cancelled"] += 1
            ended.set()

    async def _stop(self, rid: str, responses: asyncio.Queue) -> bool:
        """Stop a request whose client left, through the engine (the stop_request model), and read its stream to
        the final response the gate then sends; False where the repository has no such model, or the end doesn't
        come within STOP_WITHIN_S (the caller cancels the stream then)."""
        import grpc
        from tritonclient.grpc import service_pb2

        try:
            async with asyncio.timeout(STOP_WITHIN_S):
                if self._stops is None:
                    ready = await self.stub.ModelReady(service_pb2.ModelReadyRequest(name=STOP_MODEL))
                    self._stops = ready.ready
                if not self._stops:
                    return False
                await self.stub.ModelInfer(_stop_request(rid))
                while (response := await responses.get()) is not None:
                    if isinstance(response, grpc.aio.AioRpcError):
                        return False
                    if response.error_message or response.infer_response.parameters[
                            "triton_final_response"].bool_param:
                        return True
        except (TimeoutError, grpc.aio.AioRpcError):
            pass
        return False


async def _read_all(call, responses: asyncio.Queue) -> None:
    """Every response of a stream into `responses`, then its error if it broke, then None."""
    import grpc

    try:
        async for response in call:
            responses.put_nowait(response)
    except grpc.aio.AioRpcError as err:
        responses.put_nowait(err)
    finally:
        responses.put_nowait(None)


def _stop_request(rid: str):
    """The stop_request model's request for one id."""
    from tritonclient.grpc._utils import _get_inference_request

    return _get_inference_request(model_name=STOP_MODEL, inputs=stop_inputs(rid), model_version="", request_id="",
                                  outputs=None, sequence_id=0, sequence_start=False, sequence_end=False, priority=0,
                                  timeout=None, parameters=None)

