"""Triton python model `preprocessing`: text -> validated token ids, every default filled in.

Bad input (empty text, max_tokens out of range, a prompt too long) becomes an error response with a
one-line message; the model keeps serving. Tensors: pipeline.triton.interface (ENSEMBLE_INPUTS ->
REQUEST_TENSORS).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.models.families import text_config
from pipeline.models.shape import read_config
from pipeline.models.tokenizer import (config_eos_ids, encode_prompt, load_tokenizer, stop_token_ids, template_opening,
                                       uses_chat_template)
from pipeline.triton.client_errors import answer_each
from pipeline.triton.stub_exit import exit_without_teardown
from pipeline.triton.validate import check_length, read_request


def _param(config: dict, key: str, default: str | None = None) -> str:
    if default is not None and key not in config["parameters"]:
        return default
    return config["parameters"][key]["string_value"]


class TritonPythonModel:
    def initialize(self, args):
        exit_without_teardown()
        config = json.loads(args["model_config"])
        tokenizer_dir = _param(config, "tokenizer_dir")
        # The class assemble recorded: no AutoTokenizer, so no torch in this process (pipeline.models.tokenizer)
        self.tokenizer = load_tokenizer(tokenizer_dir, _param(config, "tokenizer_class", ""))
        self.raw = _param(config, "apply_chat_template") != "true"
        # A text_input that starts as the template's rendering does is a conversation an OpenAI frontend
        # already rendered: encoded as it is, never templated twice (tokenizer.is_rendered).
        self.opening = template_opening(self.tokenizer)
        self.max_seq_len = int(_param(config, "max_seq_len"))
        self.num_draft_tokens = int(_param(config, "num_draft_tokens"))
        self.max_input_bytes = int(_param(config, "max_input_bytes"))
        chat = uses_chat_template(self.tokenizer, self.raw)
        # The same stop set `pipeline generate` uses: eos, the config's eos, the chat end-of-turn markers.
        self.stops = stop_token_ids(self.tokenizer, config_eos_ids(text_config(read_config(tokenizer_dir))), chat=chat)

    def execute(self, requests):
        return answer_each(requests, lambda r: pb_utils.InferenceResponse(output_tensors=self._tensors(r)),
                           "preprocessing")

    def _tensors(self, request):
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        r = read_request(get, max_seq_len=self.max_seq_len, max_input_bytes=self.max_input_bytes,
                         num_draft_tokens=self.num_draft_tokens, vocab_size=len(self.tokenizer))
        ids = list(r.prompt_ids) if r.prompt_ids is not None else encode_prompt(self.tokenizer, r.text,
                                                                                r.raw(self.raw), self.opening)
        check_length(len(ids), r.max_tokens, self.max_seq_len)  # a resumed answer's start is in its max_tokens
        # ignore_eos (vLLM's): none of the model's own stop tokens ends the answer, the chat template's end of turn
        # included, only max_tokens, the request's stop words and its end_id if it sent one. A benchmark client's
        # fixed-length requests rely on it.
        stops = () if r.ignore_eos else self.stops
        end_id = r.end_id if r.end_id is not None else (stops[0] if stops else -1)
        # tensorrtllm's layout: row 0 the flat ids, row 1 the end offset of each word, -1 padded. The model's own
        # stop tokens first, then each stop word's tokens (TensorRT-LLM matches them as sequences).
        words = [[t] for t in stops[1:]] + [self.tokenizer(w, add_special_tokens=False).input_ids
                                            for w in r.stop_words]
        words = [w for w in words if w]
        flat = [t for w in words for t in w]
        stop_words = np.full((1, 2, max(1, len(flat))), -1, np.int32)
        stop_words[0, 0, :len(flat)] = flat
        stop_words[0, 1, :len(words)] = np.cumsum([len(w) for w in words])

        def row(value, dtype):
            return np.array([[value]], dtype)

        return [
            pb_utils.Tensor("input_ids", np.array([ids + list(r.resume_ids)], np.int32)),
            pb_utils.Tensor("input_lengths", row(len(ids) + len(r.resume_ids), np.int32)),
            pb_utils.Tensor("resume_length", row(len(r.resume_ids), np.int32)),
            pb_utils.Tensor("request_output_len", row(r.max_tokens, np.int32)),
            pb_utils.Tensor("end_id", row(end_id, np.int32)),
            pb_utils.Tensor("temperature", row(r.temperature, np.float32)),
            pb_utils.Tensor("top_k", row(r.top_k, np.int32)),
            pb_utils.Tensor("top_p", row(r.top_p, np.float32)),
            pb_utils.Tensor("seed", row(r.seed, np.uint64)),
            pb_utils.Tensor("stream", row(r.stream, np.bool_)),
            pb_utils.Tensor("stop_words_list", stop_words),
            pb_utils.Tensor("speculation", np.array([[r.speculation.encode()]], np.object_)),
            pb_utils.Tensor("num_draft_tokens", row(r.num_draft_tokens, np.int32)),
            pb_utils.Tensor("repetition_penalty", row(r.repetition_penalty, np.float32)),
            pb_utils.Tensor("presence_penalty", row(r.presence_penalty, np.float32)),
            pb_utils.Tensor("frequency_penalty", row(r.frequency_penalty, np.float32)),
            pb_utils.Tensor("return_log_probs", row(r.return_log_probs, np.bool_)),
            pb_utils.Tensor("num_logprobs", row(r.num_logprobs, np.int32)),
            pb_utils.Tensor("stop_strings", np.array([[json.dumps(list(r.stop_words)).encode()]], np.object_)),
            pb_utils.Tensor("guided_decoding_guide_type", np.array([[r.guide.type.encode() if r.guide else b""]],
                                                                   np.object_)),
            pb_utils.Tensor("guided_decoding_guide", np.array([[r.guide.guide.encode() if r.guide else b""]],
                                                              np.object_)),
            pb_utils.Tensor("min_tokens", row(r.min_tokens, np.int32)),
            pb_utils.Tensor("ignore_eos", row(r.ignore_eos, np.bool_)),
            pb_utils.Tensor("logit_bias", np.array([[json.dumps({str(t): b for t, b in r.logit_bias}).encode()]],
                                                   np.object_)),
            pb_utils.Tensor("prompt_logprobs", row(r.prompt_logprobs, np.int32)),
            pb_utils.Tensor("stream_interval_ms", row(r.stream_interval_ms, np.int32)),
            pb_utils.Tensor("request_group", row(r.request_group, np.uint64)),
            pb_utils.Tensor("resumed", row(r.resumed, np.bool_)),
        ]

