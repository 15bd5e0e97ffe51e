"""Triton repository configs: built as protobuf messages, written, parsed back, and checked as a graph."""

from dataclasses import replace

import pytest
from serving_checks import metrics as scrape
from serving_checks import tensor as grpc_input

from pipeline.errors import ConfigError
from pipeline.triton import interface
from pipeline.triton.config import (
    ENSEMBLE,
    GATE,
    TORCH_ENGINE,
    TRTLLM_DRAFT,
    TRTLLM_TARGET,
    RepoSpec,
    config_text,
    read_config,
    repository_configs,
    write_config,
)
from pipeline.triton.ports import free_ports

from tritonclient.grpc import model_config_pb2 as pb  # noqa: E402

TORCH = RepoSpec(backend="torch", tokenizer_dir="/models/smollm2", engine_dir="/engines/smollm2")
TRTLLM = RepoSpec(backend="trtllm", tokenizer_dir="/models/llama", engine_dir="/engines/target",
                  draft_engine_dir="/engines/draft", kv_fraction_target=0.7, kv_fraction_draft=0.3)



def both_backends():
    return pytest.mark.parametrize("spec", [TORCH, TRTLLM], ids=["torch", "trtllm"])


def tensors(config, kind: str) -> dict:
    return {t.name: t for t in getattr(config, kind)}


@both_backends()
def test_every_config_round_trips_through_written_file(spec, tmp_path):
    for name, msg in repository_configs(spec).items():
        path = write_config(tmp_path / name, msg)
        assert path == tmp_path / name / "config.pbtxt"
        assert read_config(path) == msg
        assert read_config(tmp_path / name) == msg  # the folder works too


@both_backends()
def test_no_config_leaves_a_placeholder_or_empty_parameter(spec):
    """Only the tensorrt_llm models keep placeholders, and only where fill_template.py would leave one: a
    guarded key left at its default. The two guided-decoding keys are "" (off), as NVIDIA's CI fills them."""
    from pipeline.trtllm import upstream

    guarded = {p.key: p.value for p in upstream.TEMPLATE_PARAMETERS if p.guarded}
    for name, msg in repository_configs(spec).items():
        assert msg.name == name
        assert msg.backend or msg.platform, name
        assert msg.max_batch_size == spec.max_batch_size
        trtllm = msg.backend == "tensorrtllm"
        for key, value in msg.parameters.items():
            if trtllm and value.string_value.startswith("${"):
                assert guarded.get(key) == value.string_value, f"{name}: {key} left unfilled but read unguarded"
            elif trtllm and key in ("guided_decoding_backend", "xgrammar_tokenizer_info_path"):
                assert value.string_value == ""
            else:
                assert value.string_value.strip() and "${" not in value.string_value, f"{name}: {key} is empty"


def test_repository_holds_the_engine_models_of_the_chosen_backend():
    assert set(repository_configs(TORCH)) == {"preprocessing", "postprocessing", GATE, ENSEMBLE, TORCH_ENGINE,
                                              "stop_request"}
    assert set(repository_configs(TRTLLM)) == {"preprocessing", "postprocessing", GATE, ENSEMBLE,
                                               TRTLLM_TARGET, TRTLLM_DRAFT, "stop_request"}


@both_backends()
def test_ensemble_interface_matches_the_table_and_tensorrt_llm_names(spec):
    ensemble = repository_configs(spec)[ENSEMBLE]
    assert ensemble.platform == "ensemble"
    for kind, table in (("input", interface.ENSEMBLE_INPUTS), ("output", interface.ENSEMBLE_OUTPUTS)):
        got = [(t.name, pb.DataType.Name(t.data_type), tuple(t.dims), t.optional if kind == "input" else False)
               for t in getattr(ensemble, kind)]
        assert got == [(t.name, t.config_dtype, t.dims, t.optional) for t in table]
    inputs = tensors(ensemble, "input")
    # Every input declared optional: preprocessing requires text_input and max_tokens by name (REQUIRED_INPUTS).
    assert all(t.optional for t in inputs.values()) and interface.REQUIRED_INPUTS == ("text_input", "max_tokens")
    assert inputs["speculation"].data_type == pb.TYPE_STRING
    assert inputs["num_draft_tokens"].data_type == pb.TYPE_INT32
    outputs = tensors(ensemble, "output")
    assert outputs["text_output"].data_type == pb.TYPE_STRING
    assert {"num_accepted_tokens", "num_drafted_tokens", "num_output_tokens"} <= set(outputs)


@both_backends()
def test_ensemble_is_a_superset_of_tensorrt_llms_name_for_name_and_dtype_for_dtype(spec):
    """A client written for upstream's ensemble (ensemble/config.pbtxt) sends nothing we call unexpected;
    every upstream output we lack is listed with the reason."""
    from pipeline.trtllm import upstream

    ensemble = repository_configs(spec)[ENSEMBLE]
    inputs, outputs = tensors(ensemble, "input"), tensors(ensemble, "output")
    for theirs in upstream.ENSEMBLE_INPUTS:
        ours = inputs.get(theirs.name)
        assert ours is not None, f"upstream input {theirs.name} missing"
        assert pb.DataType.Name(ours.data_type) == theirs.config_dtype, theirs.name
        assert tuple(ours.dims) == theirs.dims, theirs.name
        assert ours.optional and (theirs.name in interface.REQUIRED_INPUTS) == (not theirs.optional), theirs.name
    for theirs in upstream.ENSEMBLE_OUTPUTS:
        if theirs.name in interface.UPSTREAM_OUTPUTS_NOT_PRODUCED:
            assert theirs.name not in outputs
        else:
            assert pb.DataType.Name(outputs[theirs.name].data_type) == theirs.config_dtype, theirs.name
    # Every upstream input we don't implement is either refused off its neutral value or harmless.
    handled = set(interface.UNSUPPORTED_INPUTS) | set(interface.IGNORED_INPUTS) | {"min_tokens"}
    implemented = {"text_input", "max_tokens", "stop_words", "end_id", "top_k", "top_p", "temperature", "seed",
                   "stream", "repetition_penalty", "presence_penalty", "frequency_penalty", "return_log_probs",
                   "guided_decoding_guide_type", "guided_decoding_guide"}
    assert {t.name for t in upstream.ENSEMBLE_INPUTS} == handled | implemented
    assert "random_seed" not in inputs  # upstream's name is seed (InputFieldsNames::seed)


@both_backends()
def test_ensemble_steps_form_a_connected_typed_graph(spec):
    configs = repository_configs(spec)
    ensemble = configs[ENSEMBLE]
    # Every ensemble tensor: the ensemble's inputs, then whatever each step produces, in order.
    available = {t.name: (t.data_type, tuple(t.dims)) for t in ensemble.input}
    produced_by_steps = set()
    for step in ensemble.ensemble_scheduling.step:
        model = configs[step.model_name]
        model_inputs, model_outputs = tensors(model, "input"), tensors(model, "output")
        for key, tensor in step.input_map.items():
            assert key in model_inputs, f"{step.model_name} has no input {key}"
            assert tensor in available, f"{step.model_name}.{key} reads {tensor}, which nothing produced earlier"
            want = model_inputs[key]
            assert available[tensor] == (want.data_type, tuple(want.dims)), f"{step.model_name}.{key} type"
        required = {n for n, t in model_inputs.items() if not t.optional}
        assert required <= set(step.input_map), f"{step.model_name} misses {required - set(step.input_map)}"
        for key, tensor in step.output_map.items():
            assert key in model_outputs, f"{step.model_name} has no output {key}"
            assert tensor not in available, f"{tensor} is produced twice"
            out = model_outputs[key]
            available[tensor] = (out.data_type, tuple(out.dims))
            produced_by_steps.add(tensor)
    for out in ensemble.output:
        assert out.name in produced_by_steps, f"no step produces the ensemble output {out.name}"
        assert available[out.name] == (out.data_type, tuple(out.dims))
    # Every intermediate tensor is read by a later step: nothing computed for nobody.
    read = {t for step in ensemble.ensemble_scheduling.step for t in step.input_map.values()}
    assert produced_by_steps - {o.name for o in ensemble.output} <= read


@both_backends()
def test_gate_and_engines_are_decoupled_and_the_tokenizer_models_are_not(spec):
    configs = repository_configs(spec)
    for name in (GATE, spec.engine_model) + ((TRTLLM_DRAFT,) if spec.backend == "trtllm" else ()):
        assert configs[name].model_transaction_policy.decoupled, name
    for name in ("preprocessing", "postprocessing"):
        assert not configs[name].model_transaction_policy.decoupled, name
        assert configs[name].backend == "python"
    assert configs[GATE].parameters["engine_model"].string_value == spec.engine_model


@both_backends()
def test_only_preprocessing_runs_more_than_one_instance(spec):
    """A long prompt tokenizing must not hold every other request; everything else stays one instance (the
    decoupled models send from one thread, and postprocessing must see a stream's responses in order)."""
    counts = {name: sum(g.count for g in c.instance_group) for name, c in repository_configs(spec).items()
              if c.backend == "python"}
    assert counts.pop("preprocessing") == 2 and set(counts.values()) == {1}, counts


def test_gate_and_engine_share_the_request_and_generation_tensors():
    configs = repository_configs(TORCH)
    request = list(interface.names(interface.REQUEST_TENSORS))
    assert [t.name for t in configs[GATE].input] == request
    # The engine also takes the gate's optional stream id, to hear of a client's cancel.
    assert [t.name for t in configs[TORCH_ENGINE].input] == request + ["stream_id"]
    assert configs[TORCH_ENGINE].input[-1].optional
    for name in (GATE, TORCH_ENGINE):
        assert [t.name for t in configs[name].output] == list(interface.names(interface.GENERATION_TENSORS))


def test_trtllm_configs_carry_engine_paths_batching_and_kv_fractions():
    spec = replace(TRTLLM, draft_max_tokens=4096, gpu_device_ids="0,1")
    configs = repository_configs(spec)
    target, draft = configs[TRTLLM_TARGET], configs[TRTLLM_DRAFT]
    for msg, path, fraction in ((target, "/engines/target", "0.7"), (draft, "/engines/draft", "0.3")):
        assert msg.backend == "tensorrtllm"
        params = {k: v.string_value for k, v in msg.parameters.items()}
        assert params["gpt_model_path"] == path
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["kv_cache_free_gpu_mem_fraction"] == fraction
        assert params["gpu_device_ids"] == "0,1"
        assert params["tokenizer_dir"] == "/models/llama"
        assert {"input_ids", "input_lengths", "request_output_len", "draft_input_ids", "seed"} <= set(
            tensors(msg, "input"))
        assert "output_ids" in tensors(msg, "output")
        assert msg.model_transaction_policy.decoupled
        assert list(msg.dynamic_batching.preferred_batch_size) == [spec.max_batch_size]
    assert draft.parameters["max_tokens_in_paged_kv_cache"].string_value == "4096"
    assert target.parameters["max_tokens_in_paged_kv_cache"].string_value == "${max_tokens_in_paged_kv_cache}"
    assert configs[GATE].parameters["draft_model"].string_value == TRTLLM_DRAFT
    assert tensors(target, "input")["input_lengths"].HasField("reshape")


def test_trtllm_without_a_draft_serves_the_target_alone():
    configs = repository_configs(replace(TRTLLM, draft_engine_dir=""))
    assert TRTLLM_TARGET in configs and TRTLLM_DRAFT not in configs
    assert "draft_model" not in configs[GATE].parameters


@pytest.mark.parametrize("change, message", [
    (dict(backend="vllm"), "unknown backend"),
    (dict(draft_max_tokens=0), "draft_max_tokens"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(num_draft_tokens=0), "num_draft_tokens"),
    (dict(kv_fraction_draft=0.0), "kv_fraction_draft"),
])
def test_bad_repo_spec_is_refused_in_one_place(change, message):
    with pytest.raises(ConfigError, match=message):
        replace(TRTLLM, **change)


def test_read_config_names_a_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        read_config(tmp_path / "nope")
    (tmp_path / "config.pbtxt").write_text('name: "x"\nmax_batch_size: ${triton_max_batch_size}\n')
    with pytest.raises(ConfigError, match="not a valid ModelConfig"):
        read_config(tmp_path)


# One stand-in for every python model, picked by model name: it loads the config we wrote and
# fills each output it doesn't compute with ones of the declared type, so a real server checks
# the written configs (types, shapes, the ensemble graph, decoupled streaming) without a model.
DUMMY_MODEL = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        self.outputs = json.loads(args["model_config"])["output"]

    def fill(self, request, **given):
        tensors = []
        for out in self.outputs:
            if out["name"] in given:
                value = given[out["name"]]
            else:
                dtype = pb_utils.triton_string_to_numpy(out["data_type"])
                value = np.ones([1] + [max(d, 1) for d in out["dims"]], dtype=dtype)
                if dtype == np.object_:
                    value[...] = b"x"
            tensors.append(pb_utils.Tensor(out["name"], value))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        if self.name == "speculation_gate":
            for request in requests:  # two chunks of the echoed prompt, then the end of the stream
                ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
                sender = request.get_response_sender()
                half = ids.shape[1] // 2
                for start, stop in ((0, half), (half, ids.shape[1])):
                    sender.send(self.fill(request, output_ids=ids[:, :stop],
                                          prefix_length=np.array([[start]], np.int32),
                                          accepted_tokens=np.array([[1]], np.int32),
                                          drafted_tokens=np.array([[2]], np.int32)))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        responses = []
        for request in requests:
            if self.name == "preprocessing":
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0, 0].decode()
                ids = np.array([[ord(c) for c in text]], np.int32)
                responses.append(self.fill(request, input_ids=ids,
                                           input_lengths=np.array([[ids.shape[1]]], np.int32)))
            elif self.name == "postprocessing":
                get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                ids, start = get("output_ids")[0], int(get("prefix_length")[0, 0])
                text = "".join(chr(i) for i in ids[start:]).encode()
                responses.append(self.fill(request, text_output=np.array([[text]], np.object_),
                                           num_accepted_tokens=get("accepted_tokens"),
                                           num_drafted_tokens=get("drafted_tokens")))
            else:
                responses.append(self.fill(request))
        return responses
'''


@pytest.mark.slow
def test_real_tritonserver_loads_the_written_repository_and_streams_through_the_ensemble(tmp_path):
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient
    import pipeline.triton.server as server_mod

    binary = server_mod.find_tritonserver()
    repo = tmp_path / "repo"
    for name, msg in repository_configs(TORCH).items():
        write_config(repo / name, msg)
        (repo / name / "1").mkdir()
        if msg.backend == "python":
            (repo / name / "1" / "model.py").write_text(DUMMY_MODEL)
    grpc, http, metrics = free_ports()
    options = server_mod.ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics)

    with server_mod.TritonServer(options, binary) as server:
        client = grpcclient.InferenceServerClient(server.endpoints.grpc)
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("ensemble", [
            grpc_input("text_input", np.array([[b"hello"]], np.object_), "BYTES"),
            grpc_input("max_tokens", np.array([[8]], np.int32), "INT32"),
            grpc_input("stream", np.array([[True]]), "BOOL"),
            grpc_input("speculation", np.array([[b"on"]], np.object_), "BYTES"),
            grpc_input("num_draft_tokens", np.array([[2]], np.int32), "INT32"),
        ], enable_empty_final_response=True)
        chunks, counts = [], []
        while True:
            result, error = got.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                chunks.append(result.as_numpy("text_output")[0, 0].decode())
                counts.append((int(result.as_numpy("num_accepted_tokens")[0, 0]),
                               int(result.as_numpy("num_drafted_tokens")[0, 0])))
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        client.close()
    assert "".join(chunks) == "hello" and len(chunks) == 2
    assert counts == [(1, 2), (1, 2)]


# ---- the TensorRT-LLM routes: `pipeline assemble` on compile's folders ----------------------------


def trt_checkpoint(folder, tokenizer_from, **shape):
    from test_compile import write_trt_checkpoint

    return write_trt_checkpoint(folder, tokenizer_from, **shape)


def compiled(tmp_path, target, draft, **kw):
    from pipeline.compiler import CompileOptions, compile_model

    out = tmp_path / "engines"
    compile_model(CompileOptions("trtllm", target, out, draft=str(draft), dry_run=True, **kw))
    return out


def assembled(engine, tmp_path, **kw):
    from pipeline.triton.assemble import AssembleOptions, assemble

    return assemble(AssembleOptions(engine=engine, **{"repo": tmp_path / "repo", **kw}))


def test_engine_route_assembles_target_and_draft_with_the_planned_kv_split(tiny_target, tmp_path):
    import json

    from pipeline.triton.assemble import AssembleOptions, repo_spec

    draft = trt_checkpoint(tmp_path / "d", tiny_target, num_hidden_layers=1)  # half the target's KV per token
    engine = compiled(tmp_path, trt_checkpoint(tmp_path / "t", tiny_target), draft, gpu="h100", num_draft_tokens=3,
                      max_batch_size=16)
    result = assembled(engine, tmp_path, gate_batch_size=8)
    repo = tmp_path / "repo"
    assert (result.backend, result.route) == ("trtllm", "engine")
    assert result.models == sorted(["ensemble", "preprocessing", "postprocessing", GATE, TRTLLM_TARGET, TRTLLM_DRAFT,
                                    "stop_request"])
    assert "build.sh" in result.notes[0]  # a dry run: the engines still have to be built
    configs = {name: read_config(repo / name) for name in result.models}
    assert configs == repository_configs(repo_spec(AssembleOptions(engine=engine, gate_batch_size=8)))
    params = {name: {k: v.string_value for k, v in configs[name].parameters.items()} for name in result.models}
    assert params[TRTLLM_TARGET]["gpt_model_path"] == str(engine / "target")
    assert params[TRTLLM_DRAFT]["gpt_model_path"] == str(engine / "draft")
    # A tiny draft beside a tiny target on an H100: the target keeps TensorRT-LLM's 0.9, the draft is bounded
    # to its batch x seq tokens, and both run on the orchestrator's GPUs (one here: tp 1).
    assert params[TRTLLM_TARGET]["kv_cache_free_gpu_mem_fraction"] == "0.9"
    sizes = json.loads((engine / "compile.json").read_text())["sizes"]
    assert params[TRTLLM_DRAFT]["max_tokens_in_paged_kv_cache"] == str(16 * sizes["max_seq_len"])
    assert params[TRTLLM_TARGET]["gpu_device_ids"] == params[TRTLLM_DRAFT]["gpu_device_ids"] == "0"
    assert json.loads((repo / "launch.json").read_text())["mode"] == "orchestrator"
    assert configs[TRTLLM_TARGET].backend == "tensorrtllm" and configs[TRTLLM_TARGET].max_batch_size == 16
    gate = params[GATE]
    assert (gate["backend"], gate["draft_model"], gate["num_draft_tokens"], gate["gate_max_batch_size"]) == (
        "trtllm", TRTLLM_DRAFT, "3", "8")
    assert gate["tokenizer_dir"] == str(tmp_path / "t")
    assert not (repo / TRTLLM_TARGET / "1" / "model.py").exists()  # the tensorrtllm backend has no model.py
    assert (repo / GATE / "1" / "model.py").is_file()


def test_kv_budget_leaves_the_draft_room_whichever_model_loads_first():
    """70B FP8 target + 1B INT4 draft on 2 x H100: if the target loads first and takes its fraction of what
    is free after its weights, what is left still holds the draft's weights, KV, CUDA context and workspace."""
    from pipeline.models.presets import get_preset
    from pipeline.plan.gpus import get_gpu
    from pipeline.plan.memory import CUDA_CONTEXT_BYTES, PlanDraft, PlanInputs, plan_memory
    from pipeline.triton.assemble import DRAFT_WORKSPACE_BYTES, kv_budget

    draft = get_preset("llama-3.2-1b")
    plan = plan_memory(PlanInputs("llama-70b", get_preset("llama-70b").shape, get_gpu("h100-80gb"), tp=2,
                                  target_qformat="fp8", draft=PlanDraft("model", "llama-1b", draft.shape),
                                  draft_qformat="int4_awq", max_batch_size=16, max_seq_len=4096)).to_dict()
    kv = kv_budget(plan, 16, 4096, has_draft=True)
    free = plan["gpu_memory_bytes"] - CUDA_CONTEXT_BYTES - plan["reserve_bytes"]["activations"] \
        - plan["target_weight_bytes"]["fp8"]["per_gpu"]
    left = (1 - kv.target_fraction) * free
    draft_need = plan["draft_weight_bytes"]["per_gpu"] + plan["kv_cache_bytes"]["draft"]["bf16"] \
        + CUDA_CONTEXT_BYTES + DRAFT_WORKSPACE_BYTES
    assert draft_need <= left < draft_need + 0.01 * free  # room for the draft, and not much more
    assert kv.target_fraction * free >= plan["kv_cache_bytes"]["target"]["bf16"]  # the target's planned KV fits
    assert kv.draft_max_tokens == 16 * 4096
    # Without a plan: the draft-target README's 0.5 each; alone, TensorRT-LLM's default 0.9.
    def triple(k):
        return k.target_fraction, k.draft_fraction, k.draft_max_tokens

    assert triple(kv_budget(None, 8, 1024, has_draft=True)) == (0.5, 0.5, 8 * 1024)
    assert triple(kv_budget(plan, 8, 1024, has_draft=False)) == (0.9, 0.9, None)


def test_engine_route_serves_a_target_alone_in_leader_mode_and_refuses_missing_engines(tiny_target, tmp_path):
    import json

    from pipeline.compiler import CompileOptions, compile_model

    no_draft = tmp_path / "no-draft"
    compile_model(CompileOptions("trtllm", trt_checkpoint(tmp_path / "t", tiny_target, tp=2), no_draft,
                                 dry_run=True))
    result = assembled(no_draft, tmp_path)
    assert TRTLLM_TARGET in result.models and TRTLLM_DRAFT not in result.models
    launch = json.loads((tmp_path / "repo" / "launch.json").read_text())
    assert (launch["mode"], launch["world_size"], launch["trtllm_models"]) == ("leader", 2, ["tensorrt_llm"])
    # In leader mode every rank takes its own GPU: gpu_device_ids stays the template's.
    target = read_config(tmp_path / "repo" / TRTLLM_TARGET)
    assert target.parameters["gpu_device_ids"].string_value == "${gpu_device_ids}"
    engine = compiled(tmp_path, tmp_path / "t", trt_checkpoint(tmp_path / "d", tiny_target, tp=2))
    manifest = json.loads((engine / "compile.json").read_text())
    (engine / "compile.json").write_text(json.dumps({**manifest, "dry_run": False}))  # as if built, but no engines
    with pytest.raises(ConfigError, match=r"target holds no built engine \(config.json\)"):
        assembled(engine, tmp_path, force=True)


def test_backend_is_told_from_the_folder_and_a_wrong_one_is_a_one_line_error(tiny_target, tmp_path):
    import json

    from click.testing import CliRunner
    from cli_checks import assert_one_line_error

    from pipeline.cli import main

    target, draft = trt_checkpoint(tmp_path / "t", tiny_target), trt_checkpoint(tmp_path / "d", tiny_target)
    engine = compiled(tmp_path, target, draft)
    runner = CliRunner()
    wrong = runner.invoke(main, ["assemble", "-e", str(engine), "-r", str(tmp_path / "r"), "--backend", "torch"])
    assert_one_line_error(wrong, "is a trtllm engine folder")
    empty = runner.invoke(main, ["assemble", "-e", str(tmp_path), "-r", str(tmp_path / "r")])
    assert_one_line_error(empty, "neither engine.json")
    no_tokenizer = runner.invoke(main, ["assemble", "-e", str(engine), "-r", str(tmp_path / "r"),
                                        "--tokenizer", str(tmp_path / "d" / "nothing")])
    assert_one_line_error(no_tokenizer, "has no tokenizer")
    ok = runner.invoke(main, ["assemble", "-e", str(engine), "-r", str(tmp_path / "r"), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["route"] == "engine"
    text = runner.invoke(main, ["assemble", "-e", str(engine), "-r", str(tmp_path / "r2")])
    assert "trtllm, engine route" in text.output and "Note: the engines are not built yet" in text.output


def test_llmapi_route_writes_the_llmapi_model_with_compiles_yaml(tiny_target, tiny_draft, tmp_path):
    import json

    import yaml

    from pipeline.triton.config import LLMAPI_FRONTEND, LLMAPI_MODEL_DIR
    from pipeline.trtllm import upstream

    engine = compiled(tmp_path, tiny_target, tiny_draft, route="llmapi", num_draft_tokens=3, max_batch_size=16,
                      gate_batch_size=6)
    result = assembled(engine, tmp_path)
    repo = tmp_path / "repo"
    assert (result.backend, result.route) == ("llmapi", "llmapi")
    assert result.models == ["ensemble", LLMAPI_FRONTEND, "tensorrt_llm"]
    assert any("max_concurrency=6" in note for note in result.notes)
    model = read_config(repo / "tensorrt_llm")
    # max_batch_size and decoupled as model.yaml's triton_config says: the MPI launch skips auto-complete.
    assert model.backend == "python" and model.max_batch_size == 0 and model.model_transaction_policy.decoupled
    assert model.parameters["llmapi_model_dir"].string_value == LLMAPI_MODEL_DIR
    assert [(t.name, pb.DataType.Name(t.data_type), tuple(t.dims)) for t in model.input] == [
        (t.name, t.config_dtype, t.dims) for t in upstream.LLMAPI_INPUTS]
    assert [t.name for t in model.output] == ["text_output"]
    config = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert config["model"] == str(tiny_target) and config["backend"] == "pytorch"
    assert config["triton_config"] == upstream.LLMAPI_TRITON_CONFIG
    assert config["speculative_config"] == {"decoding_type": "DraftTarget", "max_draft_len": 3,
                                            "speculative_model_dir": str(tiny_draft), "max_concurrency": 6}
    assert config["max_batch_size"] == 16 and config["kv_cache_config"]["enable_block_reuse"] is True
    from pipeline.trtllm.reference import LLM_API_KEYS
    assert set(config) - {"model", "backend", "triton_config"} <= LLM_API_KEYS
    assert (repo / "tensorrt_llm" / "1" / "model.py").read_text().startswith('"""Triton python model `tensorrt_llm`')
    assert json.loads((repo / "launch.json").read_text())["mode"] == "llmapi"
    # The ensemble speaks the engine route's interface; its one step is the frontend.
    ensemble = read_config(repo / "ensemble")
    assert [t.name for t in ensemble.input] == list(interface.names(interface.ENSEMBLE_INPUTS))
    assert [t.name for t in ensemble.output] == list(interface.names(interface.ENSEMBLE_OUTPUTS))
    [step] = ensemble.ensemble_scheduling.step
    assert step.model_name == LLMAPI_FRONTEND


LLMAPI_HELPERS = '''
import triton_python_backend_utils as pb_utils


def scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0].item()
'''


def llmapi_server(tmp_path, tiny_target, tiny_draft, upstream_dir):
    """The llmapi repository on the CPU server: launch.json set to plain (no MPI, no TensorRT-LLM here)."""
    import pipeline.triton.server as server_mod
    from pipeline.triton.launch import Launch, write_launch

    binary = server_mod.find_tritonserver()
    engine = compiled(tmp_path, tiny_target, tiny_draft, route="llmapi", gate_batch_size=6, num_draft_tokens=3)
    assembled(engine, tmp_path, llmapi_model_dir=str(upstream_dir))
    write_launch(tmp_path / "repo", Launch("llmapi", "plain"))
    grpc, http, metrics = free_ports()
    options = server_mod.ServeOptions(repo=tmp_path / "repo", grpc_port=grpc, http_port=http, metrics_port=metrics,
                                      log_file=tmp_path / "server.log")
    return server_mod.TritonServer(options, binary)


def stream_call(url: str, inputs: list, timeout: float = 30) -> tuple[list[dict], str | None]:
    """One streamed ensemble call: each response's outputs as numpy, and the error if any."""
    import queue

    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    responses, error = [], None
    while True:
        result, err = got.get(timeout=timeout)
        if err is not None:
            error = " ".join(str(err).split())
            break
        if result.get_response().outputs:
            responses.append({o.name: result.as_numpy(o.name) for o in result.get_response().outputs})
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return responses, error


@pytest.fixture(scope="module")
def llmapi_served(tiny_target, tiny_draft, tmp_path_factory):
    """The llmapi repository served with a stand-in for TensorRT-LLM's llmapi model where the container keeps it
    (upstream's contract: model.yaml from its own folder, the running text in every streamed response)."""
    import shutil
    from pathlib import Path

    folder = tmp_path_factory.mktemp("llmapi")
    upstream_dir = folder / "container" / "llmapi" / "tensorrt_llm" / "1"
    upstream_dir.mkdir(parents=True)
    shutil.copyfile(Path(__file__).parent / "trtllm_standin_llmapi.py", upstream_dir / "model.py")
    (upstream_dir / "helpers.py").write_text(LLMAPI_HELPERS)
    with llmapi_server(folder, tiny_target, tiny_draft, upstream_dir) as server:
        yield server


@pytest.mark.slow
def test_llmapi_route_speaks_the_engine_routes_interface(llmapi_served, tiny_target):
    """Through the ensemble with the same inputs as the other routes: our loader finds the llmapi model
    where the container keeps it, and the frontend answers with deltas and token counts."""
    import json

    import numpy as np

    from pipeline.models.tokenizer import load_tokenizer, prompt_text

    tokenizer = load_tokenizer(tiny_target)

    def request(stream: bool, **extra):
        tensors = [grpc_input("text_input", np.array([[b"hello"]], np.object_), "BYTES"),
                   grpc_input("max_tokens", np.array([[12]], np.int32), "INT32"),
                   grpc_input("stream", np.array([[stream]]), "BOOL")]
        return tensors + [grpc_input(name, *value) for name, value in extra.items()]

    server = llmapi_served
    url = server.endpoints.grpc
    streamed, error = stream_call(url, request(True, seed=(np.array([[7]], np.uint64), "UINT64")))
    assert error is None, error
    whole, error = stream_call(url, request(False))
    assert error is None, error
    refused, error = stream_call(url, request(True, speculation=(np.array([[b"off"]], np.object_), "BYTES")))
    assert refused == [] and "can't be set per request on the LLM-API route" in error
    beams, error = stream_call(url, request(True, beam_width=(np.array([[2]], np.int32), "INT32")))
    assert beams == [] and "beam_width 2" in error
    penalised, error = stream_call(url, request(True, repetition_penalty=(np.array([[1.2]], np.float32), "FP32")))
    assert penalised == [] and "repetition_penalty 1.2 isn't served on the LLM-API route" in error
    assert "\n" not in error
    after, error = stream_call(url, request(False))  # the server serves on after bad requests
    assert error is None and after
    # The autoscaler's per-pod metric (pipeline deploy kubernetes) exists on this route too, back at 0.
    assert scrape(server.endpoints.metrics).get('pipeline_gate_in_flight{model="llmapi_frontend"}') == 0.0

    texts = [r["text_output"].reshape(-1)[0].decode() for r in streamed]
    assert len(texts) == 3 and texts[1:] == [" second", " third"]  # deltas of the stand-in's running text
    full = "".join(texts)
    assert [r["text_output"].reshape(-1)[0].decode() for r in whole] == [full]
    counts = [int(r["num_output_tokens"].reshape(-1)[0]) for r in streamed]
    assert sum(counts) == len(tokenizer(full, add_special_tokens=False).input_ids) and all(c > 0 for c in counts)
    echoed = json.loads(texts[0])
    assert echoed["prompt"] == prompt_text(tokenizer, "hello", raw=False)  # the chat template, as preprocessing
    assert echoed["max_tokens"] == 12 and echoed["top_k"] == 1 and echoed["temperature"] is None  # greedy
    assert echoed["exclude_input_from_output"] is True
    assert echoed["model"] == str(tiny_target) and echoed["speculative_config"]["max_concurrency"] == 6


@pytest.mark.slow
def test_llmapi_route_refuses_a_request_without_a_required_input_naming_it_on_every_transport(llmapi_served):
    import numpy as np
    from serving_checks import assert_missing_inputs_refused

    assert_missing_inputs_refused(llmapi_served)
    answer, error = stream_call(llmapi_served.endpoints.grpc, [
        grpc_input("text_input", np.array([[b"hello"]], np.object_), "BYTES"),
        grpc_input("max_tokens", np.array([[12]], np.int32), "INT32")])
    assert error is None and answer


@pytest.mark.slow
def test_llmapi_repository_without_tensorrt_llm_fails_to_load_naming_the_container(tiny_target, tiny_draft, tmp_path):
    from pipeline.errors import ServeError

    server = llmapi_server(tmp_path, tiny_target, tiny_draft, tmp_path / "not-the-container")
    try:
        server.start()
        with pytest.raises(ServeError, match=r"model 'tensorrt_llm' failed to load: .*llmapi Triton model is not at "
                                             r".*trtllm-python-py3") as err:
            server.wait_ready(60)
    finally:
        server.stop()
    assert "\n" not in str(err.value)


def test_torch_engine_config_carries_the_device_and_stays_one_cpu_instance():
    """The repository's own device (assemble's --device, auto by default) is a torch_engine parameter; the engine
    places itself there, so the instance group stays one KIND_CPU instance (config.torch_engine_config says why)."""
    for device, written in (("auto", "auto"), ("cpu", "cpu"), ("cuda", "cuda:0"), ("CUDA:1", "cuda:1")):
        configs = repository_configs(replace(TORCH, device=device))
        engine = configs[TORCH_ENGINE]
        assert engine.parameters["device"].string_value == written, device
        assert [(g.kind, g.count) for g in engine.instance_group] == [(pb.ModelInstanceGroup.KIND_CPU, 1)]
        assert all("device" not in c.parameters for name, c in configs.items() if name != TORCH_ENGINE)
    assert 'key: "device"' in config_text(repository_configs(replace(TORCH, device="cuda:1"))[TORCH_ENGINE])


def test_repo_spec_refuses_a_bad_device_and_a_device_for_tensorrt_llm():
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        replace(TORCH, device="gpu")
    with pytest.raises(ConfigError, match="--device cuda:0 places the portable engine, and a repository of backend "
                                          "'trtllm' is for TensorRT-LLM"):
        replace(TRTLLM, device="cuda:0")
    assert replace(TRTLLM, device="auto").device == "auto"


def test_serves_device_wins_over_the_repositorys_and_auto_is_the_default():
    from pipeline.triton.config import DEVICE_ENV, served_device

    params = {"device": {"string_value": "cuda:1"}}
    assert served_device(params, {}) == "cuda:1"
    assert served_device(params, {DEVICE_ENV: "cpu"}) == "cpu"
    assert served_device({}, {}) == "auto"  # a repository assembled before the parameter existed
    assert served_device({}, {DEVICE_ENV: "cuda:0"}) == "cuda:0"
