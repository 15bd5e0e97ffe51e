"""Tokenizer loading, prompt encoding, stop tokens, and the draft/target vocabulary check."""

from __future__ import annotations

import hashlib
import json
from importlib import import_module
from pathlib import Path

from pipeline.errors import DraftMismatchError, ModelFormatError

# End-of-turn markers a chat template writes after each message. The model emits one to end its
# answer, but many configs list only the end-of-text token as eos, so generation would run on.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def load_tokenizer(path: Path, resolved: str = ""):
    """The transformers tokenizer saved in the model folder `path`: the class AutoTokenizer picks for it, or the
    one `resolved` names ("module:Class", what `tokenizer_class` recorded), loaded without AutoTokenizer. Why: the
    auto classes import torch (about 3 s and 200 MB), which the server's tokenizing processes otherwise never use."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFormatError(f"{path} is not a folder; pass a model folder that holds its tokenizer")
    try:
        if resolved:
            module, _, name = resolved.partition(":")
            loader = getattr(import_module(module), name)
        else:
            from transformers import AutoTokenizer as loader
    except ImportError:
        from pipeline.errors import MissingDependencyError

        raise MissingDependencyError("loading a tokenizer needs transformers; pip install transformers") from None
    except AttributeError:
        raise ModelFormatError(f"this transformers has no tokenizer class {resolved!r}; assemble the repository "
                               "again with the transformers that serves it") from None
    try:
        return loader.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelFormatError(
            f"{path} has no usable tokenizer ({reason}); save one there with tokenizer.save_pretrained(dir)"
        ) from None


def tokenizer_class(path: Path) -> str:
    """The class AutoTokenizer loads the folder's tokenizer as, "module:Class", for load_tokenizer(path, it); "" for
    one outside transformers (a checkpoint's own code), which only AutoTokenizer loads."""
    cls = type(load_tokenizer(path))
    return f"{cls.__module__}:{cls.__qualname__}" if cls.__module__.startswith("transformers.") else ""


def config_eos_ids(cfg: dict) -> tuple[int, ...]:
    """config.json's eos_token_id (one id, a list of them, or none) as a tuple."""
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


REPLACEMENT = "\ufffd"


def visible_text(text: str) -> str:
    """Decoded answer text as it is sent, without one trailing U+FFFD. A lossy UTF-8 decode writes exactly one
    U+FFFD for a character whose bytes haven't all come, and changes nothing before it when more come: mid-answer
    the rest may follow, and at its end (max_tokens cut a character in two) none will, so it is never sent. (A run
    of U+FFFD can't be stripped whole: its first ones may be bytes that were never a character.)"""
    return text[:-1] if text.endswith(REPLACEMENT) else text


def answer_text(tokenizer, ids: list[int]) -> str:
    """An answer's text, as every route sends it: special tokens skipped, no unfinished character at the end."""
    return visible_text(tokenizer.decode(ids, skip_special_tokens=True))


def uses_chat_template(tokenizer, raw: bool) -> bool:
    return not raw and bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """A conversation as the model's chat template writes it, ready for the model's answer: a generation
    prompt after a user turn, or the last assistant turn left open when the conversation ends with one
    (assistant prefill, as vLLM's continue_final_message). tools: OpenAI's tool objects, for a template that
    renders them (pipeline.openai_api.tools)."""
    prefill = bool(messages) and messages[-1].get("role") == "assistant" and not messages[-1].get("tool_calls")
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=not prefill,
                                         continue_final_message=prefill)


def template_opening(tokenizer) -> str:
    """What every conversation the chat template renders starts with (SmolLM2: "<|im_start|>system\\n"), or ""
    when the template has no fixed opening holding a special token, so plain text can't be taken for it."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    try:
        a = render_chat(tokenizer, [{"role": "user", "content": "a"}])
        b = render_chat(tokenizer, [{"role": "system", "content": "b"}, {"role": "user", "content": "c"}])
    except Exception:  # noqa: BLE001  a template that refuses a system turn: no opening to detect
        return ""
    opening = a[:next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))]
    special = [t for t in tokenizer.all_special_tokens if t] + [
        t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return opening if any(t in opening for t in special) else ""


def is_rendered(tokenizer, prompt: str, opening: str | None = None) -> bool:
    """True when the prompt is already a rendered conversation: an OpenAI frontend (ours, or Triton's own,
    which renders with the tokenizer's template and sends the result as text_input: triton-inference-server/
    server python/openai/openai_frontend/engine/triton_engine.py TritonLLMEngine.chat) templated it."""
    opening = template_opening(tokenizer) if opening is None else opening
    return bool(opening) and prompt.startswith(opening)


def encode_prompt(tokenizer, prompt: str, raw: bool, opening: str | None = None) -> list[int]:
    """Prompt token ids: wrapped as one user turn by the chat template, unless `raw`, there is none, or the
    prompt is already a rendered conversation (is_rendered; `opening` caches template_opening).

    The template writes its own BOS when the model wants one, so the rendered text is encoded
    without special tokens; raw text gets whatever the tokenizer adds by default.
    """
    if is_rendered(tokenizer, prompt, opening):
        return list(tokenizer(prompt, add_special_tokens=False).input_ids)
    if not uses_chat_template(tokenizer, raw):
        return list(tokenizer(prompt).input_ids)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_text(tokenizer, prompt: str, raw: bool, opening: str | None = None) -> str:
    """The prompt as text for an engine that tokenizes it itself with special tokens (TensorRT-LLM's LLM API
    does: tokenizer.encode(prompt, add_special_tokens=True)), so that it sees the ids `encode_prompt` gives.

    The chat template writes the BOS itself; a tokenizer that adds one too would double it, so the
    rendered text drops its leading BOS when the tokenizer adds that BOS anyway.
    """
    if is_rendered(tokenizer, prompt, opening):
        text = prompt
    elif not uses_chat_template(tokenizer, raw):
        return prompt
    else:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]
    return text[len(bos):] if adds_bos and text.startswith(bos) else text


def stop_token_ids(tokenizer, config_eos: tuple[int, ...], *, chat: bool = True) -> tuple[int, ...]:
    """Ids that end generation: the tokenizer's eos, the config's, and (for chat) the end-of-turn
    markers the chat template writes and the vocabulary has."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    ids.extend(config_eos)
    template = getattr(tokenizer, "chat_template", None) or ""
    if chat and template:
        vocab = tokenizer.get_vocab()
        ids.extend(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template)
    return tuple(dict.fromkeys(ids))  # dedupe, keep order


def check_draft_compatible(target_path: Path, draft_path: Path) -> None:
    """Raise DraftMismatchError unless every token id the draft proposes means the same to the target."""
    target_path, draft_path = Path(target_path), Path(draft_path)
    if target_path.resolve() == draft_path.resolve():
        return
    fix = "pick a draft from the same model family, or use --draft ngram"
    target_vocab, draft_vocab = _config_vocab_size(target_path), _config_vocab_size(draft_path)
    if target_vocab != draft_vocab:
        raise DraftMismatchError(
            f"draft '{draft_path.name}' does not share the target's vocabulary "
            f"(vocab {draft_vocab} vs {target_vocab}); {fix}"
        )
    digest = _tokenizer_files_digest(target_path)
    if digest is not None and digest == _tokenizer_files_digest(draft_path):
        return  # byte-identical tokenizer files: no need to load them
    target, draft = load_tokenizer(target_path).get_vocab(), load_tokenizer(draft_path).get_vocab()
    if target != draft:
        differing = len(set(target.items()) ^ set(draft.items()))
        raise DraftMismatchError(
            f"draft '{draft_path.name}' does not share the target's vocabulary "
            f"(tokenizers of {len(draft)} and {len(target)} tokens, {differing} entries differ); {fix}"
        )


def _config_vocab_size(folder: Path) -> int:
    config = folder / "config.json"
    if not config.is_file():
        raise ModelFormatError(f"{folder} has no config.json; a model folder needs the Hugging Face layout")
    cfg = json.loads(config.read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    if "vocab_size" not in cfg:
        raise ModelFormatError(f"{config} has no vocab_size; is this a causal language model?")
    return int(cfg["vocab_size"])


def _tokenizer_files_digest(folder: Path) -> str | None:
    """A hash of tokenizer.json, or None when the folder has none (then the tokenizers are compared loaded)."""
    file = folder / "tokenizer.json"
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None
