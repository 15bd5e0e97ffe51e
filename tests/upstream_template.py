"""NVIDIA's container, simulated for tests: its tensorrt_llm config template and tools/fill_template.py.

The template text is rendered from pipeline.trtllm.upstream's tables in upstream's own format (${...}
placeholders, the data types unquoted), and the fill tool follows the documented behaviour of
triton_backend/tools/fill_template.py: `fill_template.py [-i] FILE k:v,k:v`, where a backslash escapes the
next character (and is consumed) while the argument is split on ',' and then each pair on ':'; every key
must occur in the template text or it aborts; string.Template.safe_substitute leaves the rest as ${...};
max_queue_size and max_queue_delay_microseconds default to 0.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.trtllm import upstream

# Inputs and outputs whose data type is a placeholder in the template.
DTYPE_PLACEHOLDERS = {"encoder_input_features": "encoder_input_features_data_type", "draft_logits": "logits_datatype",
                      "context_logits": "logits_datatype", "generation_logits": "logits_datatype",
                      "prompt_embedding_table": "prompt_embedding_table_data_type"}

FILL_TEMPLATE = r'''
import argparse
from string import Template


def split(string, delimiter):
    out, current, escaped = [], "", False
    for ch in string:
        if escaped:
            current += ch
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == delimiter:
            out.append(current)
            current = ""
        else:
            current += ch
    out.append(current)
    return out


parser = argparse.ArgumentParser()
parser.add_argument("file_path")
parser.add_argument("substitutions")
parser.add_argument("--in_place", "-i", action="store_true")
args = parser.parse_args()
with open(args.file_path) as f:
    pbtxt = Template(f.read())
sub_dict = {"max_queue_size": 0, "max_queue_delay_microseconds": 0}
for sub in split(args.substitutions, ","):
    key, value = split(sub, ":")
    sub_dict[key] = value
    assert key in pbtxt.template, f"key '{key}' does not exist in the file {args.file_path}."
pbtxt = pbtxt.safe_substitute(sub_dict)
if args.in_place:
    with open(args.file_path, "w") as f:
        f.write(pbtxt)
else:
    print(pbtxt)
'''


def _tensor(t, output: bool) -> str:
    dtype = "${%s}" % DTYPE_PLACEHOLDERS[t.name] if t.name in DTYPE_PLACEHOLDERS else t.config_dtype
    lines = [f'    name: "{t.name}"', f"    data_type: {dtype}", f"    dims: [ {', '.join(map(str, t.dims))} ]"]
    if not output:
        if t.squeeze:
            lines.append("    reshape: { shape: [ ] }")
        if t.optional:
            lines.append("    optional: true")
        if t.ragged:
            lines.append("    allow_ragged_batch: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def template_text(drop_parameters: tuple[str, ...] = (), drop_inputs: tuple[str, ...] = ()) -> str:
    inputs = [t for t in upstream.TENSORRT_LLM_INPUTS if t.name not in drop_inputs]
    params = [p for p in upstream.TEMPLATE_PARAMETERS if p.key not in drop_parameters]
    return "\n".join([
        'name: "tensorrt_llm"', 'backend: "${triton_backend}"', "max_batch_size: ${triton_max_batch_size}", "",
        "model_transaction_policy {\n  decoupled: ${decoupled_mode}\n}", "",
        "dynamic_batching {\n    preferred_batch_size: [ ${triton_max_batch_size} ]\n"
        "    max_queue_delay_microseconds: ${max_queue_delay_microseconds}\n"
        "    default_queue_policy: { max_queue_size: ${max_queue_size} }\n}", "",
        "input [\n" + ",\n".join(_tensor(t, False) for t in inputs) + "\n]",
        "output [\n" + ",\n".join(_tensor(t, True) for t in upstream.TENSORRT_LLM_OUTPUTS) + "\n]",
        "instance_group [\n  {\n    count: 1\n    kind : KIND_CPU\n  }\n]",
        *[f'parameters: {{\n  key: "{p.key}"\n  value: {{\n    string_value: "{p.value}"\n  }}\n}}' for p in params],
    ]) + "\n"


def fake_container(root: Path, **template_kw) -> Path:
    """A folder laid out as NVIDIA's container's /app: the template and fill_template.py."""
    model = root / upstream.CONTAINER_TEMPLATES / "tensorrt_llm"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(template_text(**template_kw))
    tool = root / upstream.CONTAINER_FILL_TEMPLATE
    tool.parent.mkdir(parents=True)
    tool.write_text(FILL_TEMPLATE)
    return root
