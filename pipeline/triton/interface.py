"""The tensors that flow through the Triton repository: one table that every model config derives from.

The ensemble's request and response follow TensorRT-LLM's Triton ensemble
(tensorrtllm_backend all_models/inflight_batcher_llm/ensemble/config.pbtxt: text_input, max_tokens,
stream, temperature, top_k, top_p, random_seed, end_id, stop_words -> text_output), so tritonclient
scripts and genai-perf written for TensorRT-LLM work unchanged. We add `speculation` and
`num_draft_tokens` in, and per-response acceptance counts out.

Dims exclude the batch dimension: every model has max_batch_size > 0, as upstream's ensemble does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # tritonclient's name: "BYTES", "INT32", "FP32", "BOOL", "UINT64"
    dims: tuple[int, ...]
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch: rows of different lengths in one batch (tensorrtllm inputs)
    squeeze: bool = False  # reshape [1] -> [] as the tensorrtllm backend expects for per-request scalars

    @property
    def config_dtype(self) -> str:
        """The DataType enum name in config.pbtxt; BYTES is TYPE_STRING there."""
        return "TYPE_STRING" if self.dtype == "BYTES" else f"TYPE_{self.dtype}"


def names(specs: tuple[TensorSpec, ...]) -> tuple[str, ...]:
    return tuple(s.name for s in specs)


def required(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    return tuple(s for s in specs if not s.optional)


# What a client sends. text_input/max_tokens dims follow upstream's current ensemble ([1] per row).
ENSEMBLE_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "BYTES", (1,)),
    TensorSpec("max_tokens", "INT32", (1,)),
    TensorSpec("stream", "BOOL", (1,), optional=True),
    TensorSpec("temperature", "FP32", (1,), optional=True),
    TensorSpec("top_k", "INT32", (1,), optional=True),
    TensorSpec("top_p", "FP32", (1,), optional=True),
    TensorSpec("random_seed", "UINT64", (1,), optional=True),
    TensorSpec("end_id", "INT32", (1,), optional=True),
    TensorSpec("stop_words", "BYTES", (-1,), optional=True),
    TensorSpec("speculation", "BYTES", (1,), optional=True),  # "auto" (the gate decides) | "on" | "off"
    TensorSpec("num_draft_tokens", "INT32", (1,), optional=True),  # k for this request; the repo default if absent
)

# What every response carries. Counts are for the tokens this response adds (a stream's chunk,
# or the whole answer when not streaming); accepted / drafted is the acceptance rate.
ENSEMBLE_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("num_accepted_tokens", "INT32", (1,)),
    TensorSpec("num_drafted_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),  # new tokens in this response
)

# A request after preprocessing: tokenized, validated, every default filled in. Preprocessing emits
# these, the speculation gate consumes them and hands them on to the engine. None is optional, so
# models downstream never guess a default.
REQUEST_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("input_ids", "INT32", (-1,)),
    TensorSpec("input_lengths", "INT32", (1,)),
    TensorSpec("request_output_len", "INT32", (1,)),
    TensorSpec("end_id", "INT32", (1,)),
    TensorSpec("temperature", "FP32", (1,)),
    TensorSpec("top_k", "INT32", (1,)),
    TensorSpec("top_p", "FP32", (1,)),
    TensorSpec("random_seed", "UINT64", (1,)),
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("stop_words_list", "INT32", (2, -1)),  # tensorrtllm's layout: [flat token ids; end offsets], -1 padded
    TensorSpec("speculation", "BYTES", (1,)),
    TensorSpec("num_draft_tokens", "INT32", (1,)),
)

# One generation response, from the engine through the gate to postprocessing. output_ids holds
# prefix_length tokens already sent as text plus the new ones: postprocessing decodes both and
# keeps the text after the prefix, so multi-byte characters split across chunks come out whole
# and postprocessing keeps no per-request state.
GENERATION_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("output_ids", "INT32", (-1,)),
    TensorSpec("prefix_length", "INT32", (1,)),
    TensorSpec("accepted_tokens", "INT32", (1,)),
    TensorSpec("drafted_tokens", "INT32", (1,)),
    # Target steps that verified drafts: mean acceptance length = 1 + accepted / verify_steps. The
    # gate's metrics use it; postprocessing ignores it.
    TensorSpec("verify_steps", "INT32", (1,)),
    # The request's last response: postprocessing stops holding back a trailing U+FFFD (no more
    # bytes can complete it). Engines that don't send it leave the gate to say False.
    TensorSpec("final", "BOOL", (1,)),
    # Set by the gate, not the engine: names the stream, so postprocessing can tell the gate that the
    # client cancelled it (pipeline.triton.cancel_marks).
    TensorSpec("stream_id", "UINT64", (1,)),
)

# The gate names each engine request with its stream's id, so it can pass a client's cancel on
# (pipeline.triton.cancel_marks); a client calling the engine model directly needn't send it.
STREAM_ID = TensorSpec("stream_id", "UINT64", (1,), optional=True)

# The tensorrtllm backend's own names, a subset of upstream's
# all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt: what draft-target speculation needs.
TRTLLM_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("input_ids", "INT32", (-1,), ragged=True),
    TensorSpec("input_lengths", "INT32", (1,), squeeze=True),
    TensorSpec("request_output_len", "INT32", (1,)),
    TensorSpec("draft_input_ids", "INT32", (-1,), optional=True, ragged=True),
    TensorSpec("draft_logits", "FP32", (-1, -1), optional=True, ragged=True),
    TensorSpec("draft_acceptance_threshold", "FP32", (1,), optional=True, squeeze=True),
    TensorSpec("end_id", "INT32", (1,), optional=True, squeeze=True),
    TensorSpec("pad_id", "INT32", (1,), optional=True, squeeze=True),
    TensorSpec("stop_words_list", "INT32", (2, -1), optional=True, ragged=True),
    TensorSpec("temperature", "FP32", (1,), optional=True, squeeze=True),
    TensorSpec("runtime_top_k", "INT32", (1,), optional=True, squeeze=True),
    TensorSpec("runtime_top_p", "FP32", (1,), optional=True, squeeze=True),
    TensorSpec("random_seed", "UINT64", (1,), optional=True, squeeze=True),
    TensorSpec("return_generation_logits", "BOOL", (1,), optional=True, squeeze=True),
    TensorSpec("streaming", "BOOL", (1,), optional=True),
    TensorSpec("stop", "BOOL", (1,), optional=True),
)

TRTLLM_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("output_ids", "INT32", (-1, -1)),
    TensorSpec("sequence_length", "INT32", (-1,)),
    TensorSpec("generation_logits", "FP32", (-1, -1, -1)),
)
