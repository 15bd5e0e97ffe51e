"""A stand-in for TensorRT-LLM's llmapi Triton model (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py),
copied by the tests into a folder as model.py beside a helpers.py, where our loader
(pipeline/triton/models/llmapi.py) finds it as it would find NVIDIA's in the container.

It keeps upstream's contract: model.yaml read from pb_utils.get_model_dir(), its triton_config setting
max_batch_size and decoupled in auto_complete_config, everything else being LLM(...) arguments; text in
(text_input, streaming, sampling_param_*), text_output out, and when streaming every response holds the
text so far (CompletionOutput.text), not the new part. Instead of generating it echoes what it got, as
JSON, then grows the text by two words, so a test can see that the YAML and each mapped input arrived
and that the frontend turns the running text into deltas.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from helpers import scalar  # upstream imports its helpers.py the same way


def _model_yaml():
    with open(os.path.join(pb_utils.get_model_dir(), "model.yaml")) as f:
        return yaml_load(f)


def yaml_load(f):
    import yaml

    return yaml.safe_load(f)


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        triton_config = _model_yaml()["triton_config"]
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(triton_config["decoupled"])))
        auto_complete_model_config.set_max_batch_size(int(triton_config["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        config = _model_yaml()
        self.llm_args = {k: v for k, v in config.items() if k != "triton_config"}

    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0].decode()
            stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
            got = {"prompt": text, "model": self.llm_args["model"],
                   "speculative_config": self.llm_args.get("speculative_config"),
                   "max_tokens": scalar(request, "sampling_param_max_tokens"),
                   "temperature": scalar(request, "sampling_param_temperature"),
                   "top_k": scalar(request, "sampling_param_top_k"),
                   "seed": scalar(request, "sampling_param_seed"),
                   "exclude_input_from_output": scalar(request, "sampling_param_exclude_input_from_output"),
                   "stop": None if stop is None else [w.decode() for w in stop.as_numpy().reshape(-1)]}
            pieces = [json.dumps(got), " second", " third"]
            if not scalar(request, "streaming"):
                pieces = ["".join(pieces)]
            so_far = ""
            for i, piece in enumerate(pieces):
                so_far += piece
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array([so_far.encode()], np.object_))]),
                    flags=final if i == len(pieces) - 1 else 0)
        return None
