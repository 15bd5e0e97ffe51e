"""Triton python model `speculation_gate` (decoupled): decides speculation per request, relays the engine.

For a request with speculation "auto" the gate picks "on" or "off" from the load: requests asking
for fewer than gate_min_tokens never speculate (they can't pay back the draft), and speculation
turns off while more than gate_max_batch_size requests are in flight, back on only at or below
gate_max_batch_size - gate_hysteresis, so the decision doesn't flap at the threshold. The engine
model (BLS, decoupled) gets the decision in its `speculation` tensor; each of its responses is
relayed as is.

Each stream is read by its own worker thread (a BLS response iterator blocks), but every response
is sent from ONE sender thread: a decoupled model sending from many threads at once crashed the
python backend at 40 streams.
"""

import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
GENERATION_OUTPUTS = ["output_ids", "prefix_length", "accepted_tokens", "drafted_tokens", "verify_steps"]


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.engine_model = params["engine_model"]
        self.max_batch = int(params["gate_max_batch_size"])
        self.hysteresis = int(params["gate_hysteresis"])
        self.min_tokens = int(params["gate_min_tokens"])
        self.lock = threading.Lock()
        self.in_flight = 0
        self.speculating = self.max_batch > 0
        self.outbox: queue.Queue = queue.Queue()  # (sender, response or None, flags); None ends the thread
        self.sender_thread = threading.Thread(target=self._send_loop, name="gate-sender", daemon=True)
        self.sender_thread.start()

    def execute(self, requests):
        for request in requests:
            with self.lock:
                self.in_flight += 1
            threading.Thread(target=self._relay, args=(request,), daemon=True).start()
        return None

    def finalize(self):
        self.outbox.put(None)
        self.sender_thread.join(timeout=10)

    def decide(self, requested: str, max_tokens: int) -> str:
        """auto -> on/off from the load (in-flight requests, with hysteresis) and the request's length."""
        if requested in ("on", "off"):
            return requested
        if max_tokens < self.min_tokens:
            return "off"
        with self.lock:
            if self.speculating and self.in_flight > self.max_batch:
                self.speculating = False
            elif not self.speculating and self.in_flight <= self.max_batch - self.hysteresis:
                self.speculating = True
            return "on" if self.speculating else "off"

    def _relay(self, request):
        sender = request.get_response_sender()
        try:
            requested = pb_utils.get_input_tensor_by_name(request, "speculation").as_numpy().reshape(-1)[0]
            requested = requested.decode() if isinstance(requested, bytes) else str(requested)
            max_tokens = int(pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)[0])
            decision = self.decide(requested, max_tokens)
            inputs = [t for t in request.inputs() if t.name() != "speculation"]
            inputs.append(pb_utils.Tensor("speculation", np.array([[decision.encode()]], np.object_)))
            responses = pb_utils.InferenceRequest(
                model_name=self.engine_model, inputs=inputs,
                requested_output_names=GENERATION_OUTPUTS).exec(decoupled=True)
            for response in responses:
                if sender.is_cancelled():
                    if hasattr(responses, "cancel"):
                        responses.cancel()
                    break
                if response.has_error():
                    self.outbox.put((sender, pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(response.error().message())), 0))
                    break
                tensors = response.output_tensors()
                if tensors:
                    self.outbox.put((sender, pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(t.name(), t.as_numpy()) for t in tensors]), 0))
        except Exception as err:  # noqa: BLE001  one failed stream must not take the model down
            self.outbox.put((sender, pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"speculation_gate: {' '.join(str(err).split())}")), 0))
        finally:
            with self.lock:
                self.in_flight -= 1
            self.outbox.put((sender, None, FINAL))

    def _send_loop(self):
        while (item := self.outbox.get()) is not None:
            sender, response, flags = item
            try:
                if response is None:
                    sender.send(flags=flags)
                else:
                    sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001  a cancelled client's sender refuses sends; others go on
                pass
