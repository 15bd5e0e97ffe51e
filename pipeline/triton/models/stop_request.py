"""Triton python model `stop_request`: stops a client's request by the id the client gave it.

The client then reads the request's stream to its final response, which the gate sends once it has stopped the
request, instead of cancelling the stream: the bundled tritonserver 2.51 can die of a stream cancelled as its last
response goes out (docs/reliability.md). Marks are the gate's (pipeline.triton.cancel_marks); a stop for a request
that already ended, or that no one sent, leaves a mark that is swept. Tensors: pipeline.triton.interface
(STOP_INPUTS -> STOP_OUTPUTS).
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.errors import RequestError
from pipeline.triton import cancel_marks
from pipeline.triton.client_errors import answer_each
from pipeline.triton.interface import MAX_REQUEST_ID_BYTES
from pipeline.triton.stub_exit import exit_without_teardown


class TritonPythonModel:
    def initialize(self, args):
        exit_without_teardown()

    def execute(self, requests):
        return answer_each(requests, self._stop, "stop_request")

    def _stop(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, "request_id").as_numpy().reshape(-1)
        stopped = []
        for raw in ids:
            rid = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            if not rid or len(rid.encode()) > MAX_REQUEST_ID_BYTES:
                raise RequestError(f"request_id must be 1 to {MAX_REQUEST_ID_BYTES} bytes, the id the request was sent "
                                 f"with (got {len(rid.encode())} bytes)")
            if not cancel_marks.mark_stop(rid):
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"stop_request: {cancel_marks.MAX_STOP_MARKS} stops are pending; cancel the stream instead, or "
                    "retry", pb_utils.TritonError.UNAVAILABLE))
            stopped.append(True)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("stopped", np.array(stopped, np.bool_).reshape(ids.shape[0], 1))])
