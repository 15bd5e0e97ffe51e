"""What a client may see of a failure: one line, with no traceback and no path on this machine.

Every Triton model answers a failed request through `client_message`, so a model called directly
(the internal ones can be) never hands back a Python traceback full of venv and engine paths.
"""

from __future__ import annotations

import re

from pipeline.errors import PipelineError
from pipeline.policy.serving_gate import STOPPING_MESSAGE
from pipeline.triton import cancel_marks

# An absolute path of two or more parts; it is cut to its last part, which still names the file.
_PATH = re.compile(r"(?<![\w:/])(?:/[^\s/'\"(),;:]+){2,}/?")


def client_message(err: BaseException, where: str = "") -> str:
    """err as one line. A PipelineError's message is written for the client and goes as it is; any
    other error is unexpected, so it is named by its type (and `where` it happened)."""
    text = " ".join(str(err).split())
    if not isinstance(err, PipelineError):
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
        if where:
            text = f"{where}: {text}"
    return _PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def answer_each(requests, respond, where: str) -> list:
    """A non-decoupled model's responses: respond(request) for each, and for a request that raises, its error alone,
    in one line (client_message), so one bad request never takes the others or the model down. Runs in a model's
    stub, where the python backend's module is importable."""
    import triton_python_backend_utils as pb_utils

    responses = []
    for request in requests:
        try:
            responses.append(respond(request))
        except Exception as err:  # noqa: BLE001  any bad input fails alone
            responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(client_message(err, where))))
    return responses


def stopping_refusal():
    """A gate model's answer to a new request while its server drains (pipeline.triton.drain): UNAVAILABLE with
    STOPPING_MESSAGE, which clients retry elsewhere; None while the server takes requests. A stat per request."""
    if not cancel_marks.draining():
        return None
    import triton_python_backend_utils as pb_utils

    return pb_utils.InferenceResponse(error=pb_utils.TritonError(STOPPING_MESSAGE, pb_utils.TritonError.UNAVAILABLE))
