import json
import shutil

import pytest
from tiny_models import make_tiny_llama

from pipeline.errors import DraftMismatchError, ModelFormatError
from pipeline.models.tokenizer import check_draft_compatible, encode_prompt, load_tokenizer, prompt_text, \
    stop_token_ids


@pytest.fixture(scope="module")
def tok(tiny_target):
    return load_tokenizer(tiny_target)


def test_chat_encoding_wraps_the_prompt_as_a_user_turn(tok):
    ids = encode_prompt(tok, "hi", raw=False)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_raw_encoding_is_the_bare_text(tok):
    ids = encode_prompt(tok, "hi there", raw=True)
    assert tok.decode(ids) == "hi there"
    assert len(ids) == len("hi there")  # byte tokenizer, no merges, no BOS added by default


def test_tokenizer_without_chat_template_encodes_raw(tiny_target, tmp_path):
    folder = shutil.copytree(tiny_target, tmp_path / "m")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    plain = load_tokenizer(folder)
    assert not plain.chat_template
    assert encode_prompt(plain, "hi", raw=False) == encode_prompt(plain, "hi", raw=True)


def test_stop_ids_add_the_templates_end_of_turn_marker(tok):
    eos, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok, (eos,)) == (eos, im_end)
    assert stop_token_ids(tok, (eos,), chat=False) == (eos,)
    assert stop_token_ids(tok, (7, eos)) == (eos, 7, im_end)


def test_load_tokenizer_from_a_folder_without_one_is_a_format_error(tmp_path):
    with pytest.raises(ModelFormatError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)


def test_draft_with_the_same_tokenizer_is_compatible(tiny_target, tiny_draft):
    check_draft_compatible(tiny_target, tiny_draft)
    check_draft_compatible(tiny_target, tiny_target)


def test_draft_with_another_vocab_size_is_rejected(tiny_target, tmp_path):
    draft = make_tiny_llama(tmp_path / "wide", seed=2, layers=1, hidden=32, heads=2, kv_heads=1,
                            intermediate=64, vocab_size=512)
    with pytest.raises(DraftMismatchError, match=r"draft 'wide' .*\(vocab 512 vs 320\).*--draft ngram"):
        check_draft_compatible(tiny_target, draft)


def test_draft_with_same_size_but_different_tokens_is_rejected(tiny_target, tmp_path):
    draft = make_tiny_llama(tmp_path / "other", seed=2, layers=1, hidden=32, heads=2, kv_heads=1,
                            intermediate=64, extra_tokens=4)
    with pytest.raises(DraftMismatchError, match="does not share the target's vocabulary"):
        check_draft_compatible(tiny_target, draft)


def test_same_vocab_written_differently_is_compatible(tiny_target, tmp_path):
    """Byte-identical tokenizer files are the fast path; a reformatted file must still compare equal."""
    draft = shutil.copytree(tiny_target, tmp_path / "reformatted")
    data = json.loads((draft / "tokenizer.json").read_text())
    (draft / "tokenizer.json").write_text(json.dumps(data, indent=4))
    check_draft_compatible(tiny_target, draft)


def test_prompt_text_is_what_an_engine_that_tokenizes_with_special_tokens_must_get(tok):
    """TensorRT-LLM's LLM API encodes a text prompt with add_special_tokens=True: prompt_text gives it the ids
    preprocessing gives the other routes, with one BOS even where the tokenizer adds one and the template too."""
    import copy

    from tokenizers import processors

    assert tok(prompt_text(tok, "hi", raw=False)).input_ids == encode_prompt(tok, "hi", raw=False)
    assert prompt_text(tok, "hi", raw=True) == "hi"
    bos = copy.deepcopy(tok)  # a Llama-style tokenizer: adds BOS, and its chat template writes BOS as well
    bos._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos.bos_token_id)])
    bos.chat_template = "{{ bos_token }}" + tok.chat_template
    assert bos("").input_ids == [bos.bos_token_id]
    ids = bos(prompt_text(bos, "hi", raw=False)).input_ids
    assert ids == encode_prompt(bos, "hi", raw=False) and ids.count(bos.bos_token_id) == 1


# What a checkpoint's tokenizer_config.json may declare. LlamaTokenizer over a byte-level tokenizer.json is one
# AutoTokenizer overrides (it loads TokenizersBackend), so a loader reading the declared name would differ.
DECLARED = ("TokenizersBackend", "GPT2Tokenizer", "Qwen2Tokenizer", "LlamaTokenizer")


@pytest.mark.parametrize("declared", DECLARED)
def test_the_recorded_class_loads_the_tokenizer_autotokenizer_loads_and_imports_no_torch(tiny_target, tmp_path,
                                                                                         declared):
    """Assemble records the class AutoTokenizer picks (RepoSpec.tokenizer_class); the served tokenizing models load
    it directly, so their processes never import torch (3 s and 200 MB each)."""
    import subprocess
    import sys

    from pipeline.models.tokenizer import tokenizer_class

    folder = shutil.copytree(tiny_target, tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": declared}))
    auto = load_tokenizer(folder)
    recorded = tokenizer_class(folder)
    assert recorded == f"{type(auto).__module__}:{type(auto).__name__}"
    direct = load_tokenizer(folder, recorded)
    assert type(direct) is type(auto)
    text = "héllo <|im_end|> wörld \u200d!"
    chat = [{"role": "user", "content": text}]
    assert direct.encode(text) == auto.encode(text)
    assert direct.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    ids = auto.encode(text)
    assert direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    fresh = subprocess.run([sys.executable, "-c", "import sys; from pipeline.models.tokenizer import load_tokenizer; "
                            f"load_tokenizer({str(folder)!r}, {recorded!r}); print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert fresh.stdout.strip() == "False", fresh.stderr[-2000:]


def test_a_recorded_class_this_transformers_lacks_is_a_format_error(tiny_target):
    with pytest.raises(ModelFormatError, match="no tokenizer class 'transformers.tokenization_utils_tokenizers:Gone'"):
        load_tokenizer(tiny_target, "transformers.tokenization_utils_tokenizers:Gone")
