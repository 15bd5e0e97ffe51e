"""One request to the served `ensemble`, as an async stream of chunks, over gRPC.

The ensemble has a decoupled step, so Triton serves it over the streaming RPC only (as
pipeline.client.ensemble explains). This is that client's asyncio twin for the HTTP frontend: one gRPC
channel for the process, one stream per request, so an error is the request's own, and closing the
stream early (the HTTP client left, or a stop string matched) cancels the request in the server.

tritonclient's asyncio client can't ask for the empty final response (it refuses `triton_*` request
parameters), and without it a decoupled stream's end is never seen; so the request is built with
tritonclient's own helper, that flag set on it, and sent on the protobuf stub tritonclient generates.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator

from pipeline.client.ensemble import ENSEMBLE, Chunk, RequestOptions, build_inputs, chunk_of, grpc_target

_ids = itertools.count()
_ENSEMBLE_PREFIX = f"in ensemble '{ENSEMBLE}', "
# Refused as busy by the gate or the engine (serving_gate.busy_message): a 503 the client may retry.
BUSY_PREFIX = "server busy:"


class EnsembleError(Exception):
    """The ensemble refused the request (`refused`: its one line is the client's to read), or the server
    could not be reached or was lost (`refused` False)."""

    def __init__(self, message: str, refused: bool):
        super().__init__(message)
        self.message, self.refused = message, refused

    @property
    def busy(self) -> bool:
        return self.message.startswith(BUSY_PREFIX)


class Ensemble:
    """The ensemble on one tritonserver. Create and use inside one event loop."""

    def __init__(self, url: str, model: str = ENSEMBLE):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.target = grpc_target(url)
        self.model = model
        self.channel = grpc.aio.insecure_channel(self.target, options=[
            ("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

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
            request_id=f"openai-{os.getpid()}-{next(_ids)}", outputs=None, sequence_id=0, sequence_start=False,
            sequence_end=False, priority=0, timeout=None, parameters=None)
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        return request

    async def stream(self, text: str, options: RequestOptions) -> AsyncIterator[Chunk]:
        """Send one request; yield its chunks. Leaving early cancels it in the server."""
        import grpc
        from tritonclient.grpc import InferResult

        request = self._request(text, options)
        ended = asyncio.Event()

        async def requests():
            yield request
            await ended.wait()  # half-closing the stream early would end it before the responses

        t0 = time.perf_counter()
        call = self.stub.ModelStreamInfer(requests())
        finished = False
        try:
            async for response in call:
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
            raise EnsembleError(f"tritonserver at {self.target} closed the stream before the answer ended",
                                refused=False)
        except grpc.aio.AioRpcError as err:
            finished = True
            raise EnsembleError(f"tritonserver at {self.target} failed the request ({err.code().name}: "
                                f"{(err.details() or '')[:160]})", refused=False) from None
        finally:
            ended.set()
            if not finished:
                call.cancel()  # the client left or a stop string matched: the server stops decoding it
