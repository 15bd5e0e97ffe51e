"""Triton python model `tensorrt_llm` of the LLM-API route: loads TensorRT-LLM's own llmapi model.

We don't ship TensorRT-LLM's code. NVIDIA's Triton + TensorRT-LLM container has the model at
/app/all_models/llmapi/tensorrt_llm/1 (model.py and its helpers.py); the `llmapi_model_dir`
parameter of config.pbtxt says where, and a missing folder fails the load with one line naming the
container and the parameter. Upstream's model reads model.yaml from this model's own folder
(pb_utils.get_model_dir()), which is where `pipeline assemble` writes it.

Speculation on this route is TensorRT-LLM's: model.yaml's speculative_config.max_concurrency turns it
off above that batch size (for EAGLE-3 only in its two-model form, which compile writes under a gate).
Clients don't call this model: `llmapi_frontend` (models/llmapi_frontend.py) fronts it with the
ensemble interface of the other routes, and refuses a request's `speculation` on/off, which can't reach it.
"""

import importlib.util
import sys
from pathlib import Path

CONTAINER = "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3"


def _load_upstream(folder: str):
    source = Path(folder) / "model.py"
    if not source.is_file():
        raise RuntimeError(f"TensorRT-LLM's llmapi Triton model is not at {source}; serve this repository in "
                           f"{CONTAINER}, or set the tensorrt_llm model's llmapi_model_dir parameter to "
                           f"triton_backend/all_models/llmapi/tensorrt_llm/1 of a TensorRT-LLM checkout")
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its `from helpers import ...`
    spec = importlib.util.spec_from_file_location("trtllm_llmapi_model", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel


def _folder(config: dict) -> str:
    return config["parameters"]["llmapi_model_dir"]["string_value"]


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        upstream = _load_upstream(_folder(auto_complete_model_config.as_dict()))
        if hasattr(upstream, "auto_complete_config"):
            return upstream.auto_complete_config(auto_complete_model_config)
        return auto_complete_model_config

    def initialize(self, args):
        import json

        self.model = _load_upstream(_folder(json.loads(args["model_config"])))()
        self.model.initialize(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        if hasattr(self.model, "finalize"):
            self.model.finalize()
