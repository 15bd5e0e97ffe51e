"""A python-backend stand-in for TensorRT-LLM's `tensorrt_llm` Triton model (the tensorrtllm backend can't
load without a GPU), copied in as model.py of `tensorrt_llm` and `tensorrt_llm_draft` by the tests.

It follows the backend's interface (tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm,
and the BLS that drives it): decoupled; inputs input_ids / input_lengths / request_output_len /
end_id / stop_words_list / streaming / draft_input_ids; outputs output_ids [1, beam=1, len] and
sequence_length [1, 1], generated tokens only (exclude_input_in_output=true), a streaming response
holding only the tokens new since the last. With draft_input_ids it verifies greedily: it answers with
the longest prefix of the drafts that matches its own greedy tokens, then its own next token.
Without drafts it takes repetition_penalty, presence_penalty and frequency_penalty (penalised_next) and
return_log_probs: output_log_probs [1, 1, len] then holds every generated token's log prob so far, also in a
streaming response, as TensorRT-LLM's LlmRequest::createResult returns them. A guide (guided_decoding_guide_type)
needs its config's guided_decoding_backend set, and no drafts beside it; the stand-in doesn't apply the grammar,
it only checks what the gate sends it.

The model is the Hugging Face folder at gpt_model_path, run greedy with a full recompute per token
(they are tiny). One worker thread computes and sends everything, as a decoupled model must.
"""

from __future__ import annotations

import json
import queue
import threading

import numpy as np


def load_model(folder: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def greedy_at_every_position(model, ids: list[int]) -> list[int]:
    """argmax of the logits at each position of `ids`: entry i is the greedy token after ids[:i+1]."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].argmax(-1).tolist()


def greedy_generate(model, ids: list[int], n: int, end_id: int = -1) -> list[int]:
    """Target-only greedy: the reference the served answers must equal."""
    out: list[int] = []
    while len(out) < n:
        token = greedy_at_every_position(model, ids + out)[-1]
        out.append(token)
        if token == end_id:
            break
    return out


def penalised_next(model, ids: list[int], prompt_len: int, repetition: float = 1.0, presence: float = 0.0,
                   frequency: float = 0.0) -> tuple[int, float]:
    """(greedy token, its log prob) after the penalties: repetition over prompt and answer (transformers' rule),
    presence and frequency over the answer (OpenAI's)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    if repetition != 1.0:
        seen = torch.tensor(sorted(set(ids)))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / repetition, values * repetition)
    counts = torch.bincount(torch.tensor(ids[prompt_len:], dtype=torch.long), minlength=logits.numel()).double()
    logits = logits - frequency * counts - presence * (counts > 0).double()
    logprobs = torch.log_softmax(logits, -1)
    token = int(logprobs.argmax())
    return token, float(logprobs[token])


def verify(model, ids: list[int], drafts: list[int]) -> list[int]:
    """The accepted prefix of `drafts` + the model's own next token."""
    predicted = greedy_at_every_position(model, ids + drafts)[len(ids) - 1:]  # [len(drafts) + 1]
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
        accepted += 1
    return drafts[:accepted] + [predicted[accepted]]


def _stops(tokens: list[int], end_id: int, words: list[tuple[int, ...]]) -> bool:
    if tokens and tokens[-1] == end_id:
        return True
    return any(tuple(tokens[-len(w):]) == w for w in words if len(tokens) >= len(w))


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        self.model = load_model(config["parameters"]["gpt_model_path"]["string_value"])
        # The engine's build-time --max_draft_len (TensorRT-LLM reads it from the engine's config.json).
        self.max_draft_len = int(config["parameters"].get("standin_max_draft_len", {}).get("string_value", "0") or 0)
        # The engine's --max_input_len, 0 for none: longer inputs get TensorRT-LLM's error response.
        self.max_input_len = int(config["parameters"].get("standin_max_input_len", {}).get("string_value", "0") or 0)
        self.guided = bool(config["parameters"].get("guided_decoding_backend", {}).get("string_value", ""))
        self.inbox: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()

    def execute(self, requests):
        for request in requests:
            self.inbox.put((request, request.get_response_sender()))
        return None

    def finalize(self):
        self.inbox.put(None)
        self.worker.join(timeout=10)

    def _work(self):
        while (item := self.inbox.get()) is not None:
            request, sender = item
            try:
                self._answer(request, sender)
            except Exception as err:  # noqa: BLE001  an error response, as the real backend sends
                sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(f"standin: {err}")),
                            flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _answer(self, request, sender):
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        def get(name):
            t = pb.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        length = int(get("input_lengths").reshape(-1)[0])
        ids = [int(t) for t in get("input_ids").reshape(-1)[:length]]
        n = int(get("request_output_len").reshape(-1)[0])
        end_id = -1 if get("end_id") is None else int(get("end_id").reshape(-1)[0])
        streaming = get("streaming") is not None and bool(get("streaming").reshape(-1)[0])
        words: list[tuple[int, ...]] = []
        if get("stop_words_list") is not None:
            flat, ends = get("stop_words_list").reshape(2, -1)
            start = 0
            for end in (int(e) for e in ends if e >= 0):
                words.append(tuple(int(t) for t in flat[start:end]))
                start = end
        drafts = [] if get("draft_input_ids") is None else [int(t) for t in get("draft_input_ids").reshape(-1)]
        if drafts and len(drafts) + 1 > n:
            raise ValueError(f"request_output_len {n} < draft length {len(drafts)} + 1")
        if self.max_input_len and length > self.max_input_len:
            raise ValueError(f"Prompt length ({length}) exceeds maximum input length ({self.max_input_len})")
        if self.max_draft_len and len(drafts) > self.max_draft_len:  # TensorRT-LLM's own refusal
            raise ValueError(f"Number of draft tokens ({len(drafts)}) is larger than maximum number of draft "
                             f"tokens ({self.max_draft_len})")

        def scalar(name, default):
            return default if get(name) is None else get(name).reshape(-1)[0]

        penalties = [float(scalar(name, neutral)) for name, neutral in
                     (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))]
        log_probs = bool(scalar("return_log_probs", False))
        if drafts and (log_probs or penalties != [1.0, 0.0, 0.0]):
            raise ValueError("draft_input_ids with penalties or log probs: the loop never sends these together")
        guide = scalar("guided_decoding_guide_type", b"")
        if guide and (drafts or not self.guided):
            raise ValueError(f"guide {guide!r} with drafts, or without guided_decoding_backend in the config")
        logprobs: list[float] = []

        def response(tokens):
            extra = [pb.Tensor("output_log_probs", np.array(logprobs, np.float32).reshape(1, 1, -1))] \
                if log_probs else []
            return pb.InferenceResponse(output_tensors=[
                pb.Tensor("output_ids", np.array([[tokens]], np.int32).reshape(1, 1, -1)),
                pb.Tensor("sequence_length", np.array([[len(tokens)]], np.int32)), *extra])

        out: list[int] = []
        if drafts:  # one verification step, the whole answer of a draft_input_ids request
            out = verify(self.model, ids, drafts)
            for i in range(1, len(out) + 1):
                if _stops(out[:i], end_id, words):
                    out = out[:i]
                    break
            sender.send(response(out), flags=final)
            return
        while len(out) < n:
            if sender.is_cancelled():
                sender.send(flags=final)
                return
            token, logprob = penalised_next(self.model, ids + out, len(ids), *penalties)
            out.append(token)
            logprobs.append(logprob)
            if streaming:
                sender.send(response(out[-1:]))
            if _stops(out, end_id, words):
                break
        if streaming:
            sender.send(flags=final)
        else:
            sender.send(response(out), flags=final)
