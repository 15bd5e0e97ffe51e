"""Triton python model `postprocessing`: one generation response -> its text.

output_ids = prefix_length tokens already sent + the new ones (pipeline.triton.interface). The text
is decode(all) minus decode(prefix), each without one trailing U+FFFD (pipeline.models.tokenizer.visible_text):
an unfinished character waits for its bytes, which keeps every chunk whole with no per-request state here,
and an answer cut inside one (by max_tokens) ends before it.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.models.tokenizer import load_tokenizer, visible_text
from pipeline.triton import cancel_marks
from pipeline.triton.client_errors import answer_each
from pipeline.triton.stub_exit import exit_without_teardown
from pipeline.triton.validate import read_generation_output


class TritonPythonModel:
    def initialize(self, args):
        exit_without_teardown()
        config = json.loads(args["model_config"])
        params = config["parameters"]
        self.tokenizer = load_tokenizer(params["tokenizer_dir"]["string_value"],
                                        params.get("tokenizer_class", {}).get("string_value", ""))
        self.skip_special = params["skip_special_tokens"]["string_value"] == "true"

    @staticmethod
    def _empty():
        zero = np.zeros((1, 1), np.int32)
        return [pb_utils.Tensor("text_output", np.array([[b""]], np.object_)),
                pb_utils.Tensor("num_accepted_tokens", zero), pb_utils.Tensor("num_drafted_tokens", zero),
                pb_utils.Tensor("num_output_tokens", zero), pb_utils.Tensor("num_draft_steps", zero),
                pb_utils.Tensor("skipped_steps", np.array([[b"{}"]], np.object_)),
                pb_utils.Tensor("acceptance_histogram", np.array([[b"{}"]], np.object_)),
                pb_utils.Tensor("cum_log_probs", np.zeros((1, 1), np.float32)),
                pb_utils.Tensor("output_log_probs", np.zeros((1, 1, 0), np.float32)),
                pb_utils.Tensor("top_log_probs", np.array([[b"[]"]], np.object_)),
                pb_utils.Tensor("prefix_cache_hit_tokens", zero),
                pb_utils.Tensor("prompt_log_probs", np.array([[b"[]"]], np.object_)),
                pb_utils.Tensor("output_token_ids", np.zeros((1, 0), np.int32))]

    def _visible(self, ids) -> str:
        return visible_text(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special))

    def execute(self, requests):
        return answer_each(requests, self._respond, "postprocessing")

    def _respond(self, request):
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        stream_id = int(get("stream_id").reshape(-1)[0])
        if request.is_cancelled():  # the client left: tell the gate and the engine, skip the decoding
            cancel_marks.mark(f"stream-{stream_id}")
            cancel_marks.mark(f"engine-{stream_id}")
            # An empty answer, not a CANCELLED error: after an error from a step, Triton 2.51's ensemble
            # drops the gate's later final response and keeps the request in flight until its 30 s exit
            # timeout at unload. The client is gone, so nobody reads this.
            return pb_utils.InferenceResponse(output_tensors=self._empty())
        ids, start = read_generation_output(get)
        full, prefix = self._visible(ids), self._visible(ids[:start])
        text = full[len(prefix):] if full.startswith(prefix) else full
        limit = get("text_limit")
        if limit is not None and int(limit.reshape(-1)[0]) >= 0:  # a stop string ends the answer in this response
            text = text[:int(limit.reshape(-1)[0])]
        logprobs = get("output_log_probs")
        new = np.zeros(0, np.float32) if logprobs is None else logprobs.reshape(-1)[start:].astype(np.float32)
        top = get("top_log_probs")
        cached = get("cached_tokens")
        prompt = get("prompt_log_probs")
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("prompt_log_probs", np.array([[b"[]"]], np.object_) if prompt is None
                            else prompt.astype(np.object_).reshape(1, 1)),
            pb_utils.Tensor("cum_log_probs", np.array([[new.sum()]], np.float32)),
            pb_utils.Tensor("output_log_probs", new.reshape(1, 1, -1)),
            pb_utils.Tensor("top_log_probs", np.array([[b"[]"]], np.object_) if top is None
                            else top.astype(np.object_).reshape(1, 1)),
            pb_utils.Tensor("prefix_cache_hit_tokens",
                            np.zeros((1, 1), np.int32) if cached is None else cached.astype(np.int32).reshape(1, 1)),
            pb_utils.Tensor("text_output", np.array([[text.encode()]], np.object_)),
            pb_utils.Tensor("num_accepted_tokens", get("accepted_tokens").astype(np.int32)),
            pb_utils.Tensor("num_drafted_tokens", get("drafted_tokens").astype(np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([[len(ids) - start]], np.int32)),
            pb_utils.Tensor("output_token_ids", np.array([ids[start:]], np.int32).reshape(1, -1)),
            pb_utils.Tensor("num_draft_steps", get("verify_steps").astype(np.int32).reshape(1, 1)),
            pb_utils.Tensor("skipped_steps", get("skipped_steps").astype(np.object_).reshape(1, 1)),
            pb_utils.Tensor("acceptance_histogram", get("acceptance_histogram").astype(np.object_).reshape(1, 1)),
        ])
