"""The tensors that flow through the Triton repository: one table that every model config derives from.

The ensemble's request is a superset of TensorRT-LLM's Triton ensemble, name for name and dtype for dtype
(pipeline.trtllm.upstream.ENSEMBLE_INPUTS, from tensorrtllm_backend's ensemble/config.pbtxt), so
tritonclient scripts and genai-perf written for TensorRT-LLM send what they always send. We add
`speculation`, `num_draft_tokens`, `apply_chat_template` and `num_logprobs`. Inputs upstream has and this
pipeline can't honour (beam search, LoRA, ...) are accepted at their neutral values and refused otherwise, in
one line (UNSUPPORTED_INPUTS): never ignored. Out come `text_output` and `num_output_tokens` as upstream names
them, plus per-response acceptance counts; UPSTREAM_OUTPUTS_NOT_PRODUCED says which upstream outputs
aren't produced, and why.

Dims exclude the batch dimension: every model has max_batch_size > 0, as upstream's ensemble does.
"""

from __future__ import annotations

from pipeline.tensor_spec import TensorSpec, names, required  # noqa: F401  (re-exported)
from pipeline.trtllm import upstream

# What a client sends: upstream's ensemble inputs as they are (no reshape, no ragged batching at the
# ensemble), then ours.
OUR_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("speculation", "BYTES", (1,), optional=True),  # "auto" (the gate decides) | "on" | "off"
    TensorSpec("num_draft_tokens", "INT32", (1,), optional=True),  # k for this request; the repo default if absent
    # Wrap text_input as a user turn in the chat template (true) or take it as it is (false); absent: the
    # repository's setting. Text that is already a rendered conversation is never templated again
    # (pipeline.models.tokenizer.is_rendered), so Triton's own OpenAI frontend can sit in front unchanged.
    TensorSpec("apply_chat_template", "BOOL", (1,), optional=True),
    # With return_log_probs: the N most likely alternatives per token too (0-20; 0 or absent: none), as
    # top_log_probs. The portable engine's; the TensorRT-LLM routes refuse N > 0.
    TensorSpec("num_logprobs", "INT32", (1,), optional=True),
    # The model's end tokens don't end the answer (stop_words still do): what load tools send to fix lengths.
    TensorSpec("ignore_eos", "BOOL", (1,), optional=True),
    # A JSON object, token id -> bias added to its logit (-100..100, at most 300; OpenAI's logit_bias). Upstream's
    # embedding_bias_words biases words, not token ids.
    TensorSpec("logit_bias", "BYTES", (1,), optional=True),
    # The prompt's own log probs (vLLM's prompt_logprobs; OpenAI's completions `echo` with `logprobs`): -1 or absent
    # for none, N >= 0 for each prompt token's log prob and its N most likely alternatives, in the first response's
    # prompt_log_probs. What evaluators (lm-evaluation-harness) score answers with. The portable engine's.
    TensorSpec("prompt_logprobs", "INT32", (1,), optional=True),
    # The prompt as token ids, taken as they are instead of tokenizing text_input (which a request still sends, as
    # upstream requires it): an evaluator's context and continuation, tokenized apart, are not what the tokenizer
    # makes of their text together.
    TensorSpec("prompt_token_ids", "INT32", (-1,), optional=True),
    # The least time between two streamed responses of this request, in ms (STREAM_INTERVAL_MS, the default, to
    # MAX_STREAM_INTERVAL_MS): tokens made meanwhile go together in the next. A client that reads the answer only
    # at its end (the OpenAI frontend's whole answers) asks for more, so fewer responses cross the stack; a left
    # client is still noticed at the next one. vLLM's --stream-interval, per request and in time. The portable
    # engine's; the TensorRT-LLM routes respond at upstream's own cadence.
    TensorSpec("stream_interval_ms", "INT32", (1,), optional=True),
    # Requests that carry the same request_group (one client request's n choices: the OpenAI frontend sends each as
    # a request of its own) share the engine's batch slots fairly with every other group: while a request waits, a
    # group holding two slots more than the waiting one's gives its newest back, to resume later, and beside smaller
    # groups' rows a group decodes only the rows the engine's cost model says keep their steps quick (LLMEngine.
    # _fair_rows). Absent or 0: a group of its own. The portable
    # engine's; the TensorRT-LLM routes schedule by their own policy.
    TensorSpec("request_group", "UINT64", (1,), optional=True),
    # The answer's tokens this client already has (output_token_ids of a stream a restart cut off): the engine takes
    # them as the answer's start, counted by max_tokens, the penalties, min_tokens and the guide, and sends only what
    # follows them, whose text joins theirs. Greedy, or sampled with the same seed, the answer then ends exactly as
    # the first run would have (pipeline.engine.sampling.sample_keyed). The portable engine's; the TensorRT-LLM
    # routes refuse it.
    TensorSpec("resume_token_ids", "INT32", (-1,), optional=True),
    # This request is a client's retry of one a lost server held (a restart or a drain cut it off, whether or not any
    # of its answer had come): it queues ahead of new requests, and may queue past max_queue_size by one more
    # capacity (pipeline.policy.serving_gate.queue_is_full). resume_token_ids implies it. The portable engine's.
    TensorSpec("resumed", "BOOL", (1,), optional=True),
)
STREAM_INTERVAL_MS, MAX_STREAM_INTERVAL_MS = 50, 1000
# What a request must carry: upstream's required inputs. They are declared optional all the same, and the model
# that reads the request (pipeline.triton.validate.read_request) requires them by name. tritonserver 2.51 only
# counts a request's inputs against the required ones (InferenceRequest::ValidateRequestInputs), so a request
# with max_tokens and stream but no text_input passes; the ensemble's first step then never becomes ready, and a
# decoupled ensemble ends such a request with an empty final response, an empty success (docs/reliability.md).
REQUIRED_INPUTS: tuple[str, ...] = tuple(t.name for t in upstream.ENSEMBLE_INPUTS if not t.optional)
ENSEMBLE_INPUTS: tuple[TensorSpec, ...] = tuple(
    TensorSpec(t.name, t.dtype, t.dims, optional=True) for t in upstream.ENSEMBLE_INPUTS) + OUR_INPUTS

# Upstream inputs this pipeline doesn't implement: the value that means "off" (a request may send it, as
# upstream clients often send every field), and the one line a request sending anything else gets back.
# None as the neutral value: any non-empty value is refused.
UNSUPPORTED_INPUTS: dict[str, tuple[object, str]] = {
    "decoder_text_input": (None, "encoder-decoder models aren't served here; drop decoder_text_input"),
    "num_return_sequences": (1, "one sequence per request; send num_return_sequences 1 or leave it out"),
    "bad_words": (None, "bad_words isn't supported; leave it out"),
    "exclude_input_in_output": (True, "the output never repeats the prompt here; send exclude_input_in_output "
                                      "true or leave it out"),
    "return_context_logits": (False, "logits aren't returned here; send return_context_logits false or leave it out"),
    "return_generation_logits": (False, "logits aren't returned here; send return_generation_logits false or "
                                        "leave it out"),
    "return_perf_metrics": (False, "per-request perf metrics aren't returned here (see the metrics port); send "
                                   "return_perf_metrics false or leave it out"),
    "return_num_input_tokens": (False, "num_input_tokens isn't returned here; send return_num_input_tokens false "
                                       "or leave it out"),
    "beam_width": (1, "beam search isn't supported (speculation verifies one beam); send beam_width 1 or leave "
                      "it out"),
    "prompt_embedding_table": (None, "prompt tuning isn't supported; drop prompt_embedding_table"),
    "prompt_table_extra_id": (None, "prompt tuning isn't supported; drop prompt_table_extra_id"),
    "prompt_vocab_size": (None, "prompt tuning isn't supported; drop prompt_vocab_size"),
    "embedding_bias_words": (None, "embedding bias isn't supported; drop embedding_bias_words"),
    "embedding_bias_weights": (None, "embedding bias isn't supported; drop embedding_bias_weights"),
    "lora_task_id": (None, "LoRA adapters aren't served here; drop lora_task_id"),
    "lora_weights": (None, "LoRA adapters aren't served here; drop lora_weights"),
    "lora_config": (None, "LoRA adapters aren't served here; drop lora_config"),
}
# Accepted and honoured without changing anything: pad_id pads batched outputs, and every answer here is
# returned unpadded; length_penalty only scores beams, and there is one; return_num_output_tokens:
# num_output_tokens is always returned.
IGNORED_INPUTS: dict[str, str] = {
    "pad_id": "answers are never padded",
    "length_penalty": "it scores beams, and beam_width is 1",
    "return_num_output_tokens": "num_output_tokens is always returned",
}

# Upstream ensemble outputs we don't produce, and why; a client asking for one gets Triton's "unexpected
# inference output" (every other upstream output has the same name and dtype here).
UPSTREAM_OUTPUTS_NOT_PRODUCED: dict[str, str] = {
    "context_logits": "logits are not returned", "generation_logits": "logits are not returned",
    "batch_index": "one request per call", "sequence_index": "one sequence per request",
    "kv_cache_alloc_new_blocks": "KV cache block stats are on the metrics port",
    "kv_cache_reused_blocks": "KV cache block stats are on the metrics port",
    "kv_cache_alloc_total_blocks": "KV cache block stats are on the metrics port",
    "arrival_time_ns": "timings are on the metrics port", "first_scheduled_time_ns": "timings are on the metrics port",
    "first_token_time_ns": "timings are on the metrics port", "last_token_time_ns": "timings are on the metrics port",
    "acceptance_rate": "num_accepted_tokens / num_drafted_tokens per response instead",
    "total_accepted_draft_tokens": "num_accepted_tokens per response instead (sum them)",
    "total_draft_tokens": "num_drafted_tokens per response instead (sum them)",
    "num_input_tokens": "not returned",
}

# What every response carries. Counts are for the tokens this response adds (a stream's chunk,
# or the whole answer when not streaming); accepted / drafted is the acceptance rate.
ENSEMBLE_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("num_accepted_tokens", "INT32", (1,)),
    TensorSpec("num_drafted_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),  # new tokens in this response
    # Decode steps in this response that drafted, and a JSON object of those that didn't, by reason
    # (docs/gate.md): why a request did or didn't speculate, per request.
    TensorSpec("num_draft_steps", "INT32", (1,)),
    TensorSpec("skipped_steps", "BYTES", (1,)),
    # A JSON object: drafts accepted -> verification steps in this response that accepted that many
    # ({"0": 2, "3": 1}); vLLM's per-request acceptance histogram, as the OpenAI frontend reports it.
    TensorSpec("acceptance_histogram", "BYTES", (1,)),
    # With return_log_probs (upstream's names and shapes, one beam): the log probs of this response's tokens, from
    # the distribution each was drawn from (after penalties, temperature, top-k and top-p), and their sum.
    TensorSpec("cum_log_probs", "FP32", (-1,)),
    TensorSpec("output_log_probs", "FP32", (-1, -1)),
    # With return_log_probs: a JSON list, per token of this response, of [token id, its log prob, [[id, log prob],
    # ...] for the num_logprobs most likely tokens]; "[]" otherwise.
    TensorSpec("top_log_probs", "BYTES", (1,)),
    # Prompt tokens whose KV blocks came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    TensorSpec("prefix_cache_hit_tokens", "INT32", (1,)),
    # With prompt_logprobs, in the first response: a JSON list, per prompt token, of [token id, its log prob, [[id,
    # log prob], ...] for the N most likely] (the first token's null: nothing predicts it); "[]" otherwise.
    TensorSpec("prompt_log_probs", "BYTES", (1,)),
    # The ids of this response's new tokens: what a client keeps to resend as resume_token_ids if the answer is cut
    # off. Empty on the LLM-API route, whose llmapi model returns text only.
    TensorSpec("output_token_ids", "INT32", (-1,)),
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
    TensorSpec("seed", "UINT64", (1,)),
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("stop_words_list", "INT32", (2, -1)),  # tensorrtllm's layout: [flat token ids; end offsets], -1 padded
    TensorSpec("speculation", "BYTES", (1,)),
    TensorSpec("num_draft_tokens", "INT32", (1,)),
    TensorSpec("repetition_penalty", "FP32", (1,)),
    TensorSpec("presence_penalty", "FP32", (1,)),
    TensorSpec("frequency_penalty", "FP32", (1,)),
    TensorSpec("return_log_probs", "BOOL", (1,)),
    TensorSpec("num_logprobs", "INT32", (1,)),
    # Every stop word as text, a JSON list: the portable engine matches them on the answer's text, across token
    # boundaries, and cuts the text just before (stop_words_list carries them as token ids for TensorRT-LLM).
    TensorSpec("stop_strings", "BYTES", (1,)),
    # Guided decoding, by upstream's names and values (json, json_schema, regex, ebnf_grammar; pipeline.engine.guide):
    # "" for none. Optional, so a client calling the engine model directly needn't send them.
    TensorSpec("guided_decoding_guide_type", "BYTES", (1,), optional=True),
    TensorSpec("guided_decoding_guide", "BYTES", (1,), optional=True),
    # No stop before this many tokens (upstream's min_tokens); the model's end tokens ignored; a logit bias as the
    # ensemble's logit_bias ("{}" for none). Optional, for the same reason.
    TensorSpec("min_tokens", "INT32", (1,), optional=True),
    TensorSpec("ignore_eos", "BOOL", (1,), optional=True),
    TensorSpec("logit_bias", "BYTES", (1,), optional=True),
    TensorSpec("prompt_logprobs", "INT32", (1,), optional=True),  # the ensemble's; -1: none
    TensorSpec("stream_interval_ms", "INT32", (1,), optional=True),  # the ensemble's; absent: STREAM_INTERVAL_MS
    TensorSpec("request_group", "UINT64", (1,), optional=True),  # the ensemble's; absent or 0: a group of its own
    # Of input_ids, the last resume_length are the answer's start (the ensemble's resume_token_ids), not prompt; one
    # tensor of ids, since an empty one between ensemble steps reads as a missing input. Absent or 0: none.
    TensorSpec("resume_length", "INT32", (1,), optional=True),
    TensorSpec("resumed", "BOOL", (1,), optional=True),  # the ensemble's, or resume_length > 0: ahead in the queue
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
    # Steps in this response that didn't draft: a JSON object, reason -> count (policy/draft_plan.py).
    TensorSpec("skipped_steps", "BYTES", (1,)),
    TensorSpec("acceptance_histogram", "BYTES", (1,)),  # verify steps by drafts accepted (ENSEMBLE_OUTPUTS')
    # output_ids' log probs, one per id (prefix included; 0 where none were asked for), and the new tokens' ids,
    # log probs and top-N alternatives as ENSEMBLE_OUTPUTS' top_log_probs ("[]" for none). These four are optional
    # for a client calling postprocessing directly; the gate always sends them.
    TensorSpec("output_log_probs", "FP32", (-1,), optional=True),
    TensorSpec("top_log_probs", "BYTES", (1,), optional=True),
    # Characters of this response's text to keep (-1: all): a stop string ends the answer inside it.
    TensorSpec("text_limit", "INT32", (1,), optional=True),
    TensorSpec("cached_tokens", "INT32", (1,), optional=True),  # prompt tokens served from the prefix cache
    TensorSpec("prompt_log_probs", "BYTES", (1,), optional=True),  # ENSEMBLE_OUTPUTS'; "[]" but in the first
    # Set by the gate, not the engine: names the stream, so postprocessing can tell the gate that the
    # client cancelled it (pipeline.triton.cancel_marks).
    TensorSpec("stream_id", "UINT64", (1,)),
)

# The stop_request model: a client stops its request by the id it gave it (pipeline.triton.cancel_marks), and reads
# the request's stream to its end instead of cancelling it.
STOP_INPUTS = (TensorSpec("request_id", "BYTES", (1,)),)
STOP_OUTPUTS = (TensorSpec("stopped", "BOOL", (1,)),)
MAX_REQUEST_ID_BYTES = 256

# The gate names each engine request with its stream's id, so it can pass a client's cancel on
# (pipeline.triton.cancel_marks); a client calling the engine model directly needn't send it.
STREAM_ID = TensorSpec("stream_id", "UINT64", (1,), optional=True)

# The tensorrtllm backend's own tensors: all of upstream's tensorrt_llm/config.pbtxt, so the model config we
# write is the template's, and the draft -> target loop (pipeline.triton.draft_target) sends a subset.
TRTLLM_INPUTS: tuple[TensorSpec, ...] = upstream.TENSORRT_LLM_INPUTS
TRTLLM_OUTPUTS: tuple[TensorSpec, ...] = upstream.TENSORRT_LLM_OUTPUTS


def layout_digest() -> str:
    """A digest of the tensor tables above: a repository assembled under other tables is stale, and `pipeline build`
    assembles it again (pipeline.build.plan keys its assemble stage on it). A repository from before the echo
    tensors was reused after an upgrade, and its ensemble refused prompt_token_ids."""
    import hashlib

    tables = (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, REQUEST_TENSORS, GENERATION_TENSORS, (STREAM_ID,), STOP_INPUTS,
              STOP_OUTPUTS)
    text = repr([[(t.name, t.dtype, tuple(t.dims), t.optional) for t in table] for table in tables])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
