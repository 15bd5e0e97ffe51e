"""Triton repository configs: built as protobuf messages, written, parsed back, and checked as a graph."""

from dataclasses import replace

import pytest
from ports import free_ports

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

pb = pytest.importorskip("tritonclient.grpc.model_config_pb2")

TORCH = RepoSpec(backend="torch", tokenizer_dir="/models/smollm2", engine_dir="/engines/smollm2")
TRTLLM = RepoSpec(backend="trtllm", tokenizer_dir="/models/llama", engine_dir="/engines/target",
                  draft_engine_dir="/engines/draft", kv_fraction_target=0.7, kv_fraction_draft=0.3)

# TensorRT-LLM's ensemble (tensorrtllm_backend all_models/inflight_batcher_llm/ensemble/config.pbtxt):
# the names genai-perf and TensorRT-LLM client scripts send and read.
TRTLLM_ENSEMBLE_INPUTS = {"text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "random_seed",
                          "end_id", "stop_words"}


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
    for name, msg in repository_configs(spec).items():
        text = config_text(msg)
        assert "${" not in text, name
        assert msg.name == name
        assert msg.backend or msg.platform, name
        assert msg.max_batch_size == spec.max_batch_size
        for key, value in msg.parameters.items():
            assert value.string_value.strip(), f"{name}: parameter {key} is empty"


def test_repository_holds_the_engine_models_of_the_chosen_backend():
    assert set(repository_configs(TORCH)) == {"preprocessing", "postprocessing", GATE, ENSEMBLE, TORCH_ENGINE}
    assert set(repository_configs(TRTLLM)) == {"preprocessing", "postprocessing", GATE, ENSEMBLE,
                                               TRTLLM_TARGET, TRTLLM_DRAFT}


@both_backends()
def test_ensemble_interface_matches_the_table_and_tensorrt_llm_names(spec):
    ensemble = repository_configs(spec)[ENSEMBLE]
    assert ensemble.platform == "ensemble"
    for kind, table in (("input", interface.ENSEMBLE_INPUTS), ("output", interface.ENSEMBLE_OUTPUTS)):
        got = [(t.name, pb.DataType.Name(t.data_type), tuple(t.dims), t.optional if kind == "input" else False)
               for t in getattr(ensemble, kind)]
        assert got == [(t.name, t.config_dtype, t.dims, t.optional) for t in table]
    inputs = tensors(ensemble, "input")
    assert TRTLLM_ENSEMBLE_INPUTS <= set(inputs)
    assert {n for n, t in inputs.items() if not t.optional} == {"text_input", "max_tokens"}
    assert inputs["text_input"].data_type == pb.TYPE_STRING
    assert inputs["max_tokens"].data_type == pb.TYPE_INT32
    assert inputs["stream"].data_type == pb.TYPE_BOOL
    assert inputs["speculation"].data_type == pb.TYPE_STRING
    assert inputs["num_draft_tokens"].data_type == pb.TYPE_INT32
    outputs = tensors(ensemble, "output")
    assert outputs["text_output"].data_type == pb.TYPE_STRING
    assert {"num_accepted_tokens", "num_drafted_tokens"} <= set(outputs)


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
    configs = repository_configs(TRTLLM)
    target, draft = configs[TRTLLM_TARGET], configs[TRTLLM_DRAFT]
    for msg, path, fraction in ((target, "/engines/target", "0.7"), (draft, "/engines/draft", "0.3")):
        assert msg.backend == "tensorrtllm"
        params = {k: v.string_value for k, v in msg.parameters.items()}
        assert params["gpt_model_path"] == path
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["kv_cache_free_gpu_mem_fraction"] == fraction
        assert {"input_ids", "input_lengths", "request_output_len", "draft_input_ids"} <= set(tensors(msg, "input"))
        assert "output_ids" in tensors(msg, "output")
    assert configs[GATE].parameters["draft_model"].string_value == TRTLLM_DRAFT
    assert tensors(target, "input")["input_lengths"].HasField("reshape")


def test_kv_fractions_over_one_are_refused_with_a_fix():
    with pytest.raises(ConfigError, match=r"> 1 on one GPU; lower them"):
        replace(TRTLLM, kv_fraction_target=0.8, kv_fraction_draft=0.3)
    replace(TRTLLM, kv_fraction_target=0.8, kv_fraction_draft=0.2)  # exactly 1 is allowed


@pytest.mark.parametrize("change, message", [
    (dict(backend="vllm"), "unknown backend"),
    (dict(draft_engine_dir=""), "needs draft_engine_dir"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(num_draft_tokens=0), "num_draft_tokens"),
    (dict(acceptance_floor=1.5), "acceptance_floor"),
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


def test_real_tritonserver_loads_the_written_repository_and_streams_through_the_ensemble(tmp_path):
    import queue

    import numpy as np
    grpcclient = pytest.importorskip("tritonclient.grpc")
    server_mod = pytest.importorskip("pipeline.triton.server")
    from pipeline.errors import PipelineError

    try:
        binary = server_mod.find_tritonserver()
    except PipelineError as err:
        pytest.skip(str(err))
    repo = tmp_path / "repo"
    for name, msg in repository_configs(TORCH).items():
        write_config(repo / name, msg)
        (repo / name / "1").mkdir()
        if msg.backend == "python":
            (repo / name / "1" / "model.py").write_text(DUMMY_MODEL)
    grpc, http, metrics = free_ports()
    options = server_mod.ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics)

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    with server_mod.TritonServer(options, binary) as server:
        client = grpcclient.InferenceServerClient(server.endpoints.grpc)
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("ensemble", [
            tensor("text_input", np.array([[b"hello"]], np.object_), "BYTES"),
            tensor("max_tokens", np.array([[8]], np.int32), "INT32"),
            tensor("stream", np.array([[True]]), "BOOL"),
            tensor("speculation", np.array([[b"on"]], np.object_), "BYTES"),
            tensor("num_draft_tokens", np.array([[2]], np.int32), "INT32"),
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
