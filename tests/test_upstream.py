"""The TensorRT-LLM route against the reference table of upstream facts (pipeline.trtllm.upstream).

TensorRT-LLM can't run here, so these are its tests: every parameter, tensor and launch step the repository
and `pipeline serve` emit is one the table records from upstream's source (the table names the file and
symbol), the container path (upstream's template + its fill_template.py) gives the same configs as the
table path, and every tritonserver flag we launch with is one the real tritonserver 2.51 knows.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from cli_checks import assert_one_line_error
from upstream_template import fake_container

from pipeline.cli import main
from pipeline.errors import ConfigError
from pipeline.routes import ENGINE, LLMAPI, PORTABLE
from pipeline.triton.config import GATE, TRTLLM_DRAFT, TRTLLM_TARGET, RepoSpec, read_config, repository_configs
from pipeline.triton.draft_target import SENT_INPUTS
from pipeline.triton.launch import LAUNCH_FILE, ORCHESTRATOR_ENV, Launch, launch_command, plan_launch
from pipeline.triton.trtllm_template import TrtllmModel, check_config, container_config, escape, find_container_tools
from pipeline.trtllm import upstream

from tritonclient.grpc import model_config_pb2 as pb  # noqa: E402

SPEC = RepoSpec(backend="trtllm", tokenizer_dir="/models/llama", engine_dir="/engines/target",
                draft_engine_dir="/engines/draft", kv_fraction_target=0.7, kv_fraction_draft=0.7,
                draft_max_tokens=65536, gpu_device_ids="0,1")


def params(msg) -> dict[str, str]:
    return {k: v.string_value for k, v in msg.parameters.items()}


# ---- the table itself ----------------------------------------------------------------------------------------------


def test_every_table_entry_names_an_upstream_file_and_symbol():
    for p in upstream.TEMPLATE_PARAMETERS:
        assert p.read_by.path in upstream.SOURCES and p.read_by.symbol, p.key
    for name, ref in upstream.TEMPLATE_FIELDS.items():
        assert ref.path in upstream.SOURCES and ref.symbol, name
    for name, fact in upstream.LAUNCH_FACTS.items():
        assert fact.ref.path in upstream.SOURCES and fact.ref.symbol and fact.what, name
    for ref in (upstream.TENSORS_REF, upstream.ENSEMBLE_REF, upstream.LLMAPI_REF, upstream.TRITON_OPENAI_REF,
                upstream.TRITON_OPENAI_RENDER_REF, upstream.GUIDED_DECODING_REF, upstream.GUIDED_DECODER_REF):
        assert ref.path in upstream.SOURCES
    for model_type, support in upstream.LLMAPI_EAGLE3.items():
        assert support.ref.path in upstream.SOURCES and support.ref.symbol and len(support.read_at) == 40, model_type
    assert len(upstream.TEMPLATE_COMMIT) == 40 and upstream.TRTLLM_VERSION == "1.2.1"
    keys = [p.key for p in upstream.TEMPLATE_PARAMETERS]
    assert len(keys) == len(set(keys)) == 46  # the template's parameter count at TEMPLATE_COMMIT
    # The keys the C++ reads without a guard ("Cannot find parameter with name" when missing).
    assert set(upstream.UNGUARDED) == {"gpt_model_type", "tokenizer_dir", "guided_decoding_backend",
                                       "xgrammar_tokenizer_info_path"}


@pytest.mark.parametrize("name", [TRTLLM_TARGET, TRTLLM_DRAFT])
def test_each_tensorrt_llm_model_writes_every_template_parameter_and_nothing_else(name):
    msg = repository_configs(SPEC)[name]
    got = params(msg)
    assert set(got) == {p.key for p in upstream.TEMPLATE_PARAMETERS}
    for key in upstream.UNGUARDED:  # present, and filled or deliberately "" (off)
        assert not got[key].startswith("${"), key
    assert got["gpt_model_type"] in upstream.GPT_MODEL_TYPES
    assert got["executor_worker_path"] == upstream.EXECUTOR_WORKER  # the template's literal, kept
    assert got["participant_ids"] == "${participant_ids}"  # must stay unset when the orchestrator spawns workers
    # Inputs and outputs: all of the template's, with its types, shapes, reshapes and ragged flags.
    assert [(t.name, pb.DataType.Name(t.data_type), tuple(t.dims), t.optional, t.allow_ragged_batch,
             t.HasField("reshape")) for t in msg.input] == [
        (t.name, t.config_dtype, t.dims, t.optional, t.ragged, t.squeeze) for t in upstream.TENSORRT_LLM_INPUTS]
    assert [t.name for t in msg.output] == [t.name for t in upstream.TENSORRT_LLM_OUTPUTS]
    check_config(msg, SENT_INPUTS)


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft-target", "target-alone"])
def test_each_tensorrt_llm_model_turns_on_chunked_context_and_kv_reuse_where_its_engine_takes_them(with_draft):
    """Filled "true", not left to the backend's default (chunked context: false). Each key is a template parameter
    pinned to the function that reads it, and the runtime takes it beside the engine's speculation mode: the
    target of a pair is built draft_tokens_external, the draft and a lone target plain."""
    from pipeline.trtllm.reference import combination

    spec = SPEC if with_draft else replace(SPEC, draft_engine_dir="")
    configs = repository_configs(spec)
    modes = {TRTLLM_TARGET: "draft_tokens_external" if with_draft else "plain", TRTLLM_DRAFT: "plain"}
    readers = {p.key: p.read_by for p in upstream.TEMPLATE_PARAMETERS}
    for name, mode in modes.items():
        if name not in configs:
            continue
        got = params(configs[name])
        for key in ("enable_chunked_context", "enable_kv_cache_reuse"):
            assert got[key] == "true", (name, key)
            assert readers[key].path == upstream.MODEL_INSTANCE_STATE, key
            assert combination(key, mode).allowed, (key, mode)
    assert (TRTLLM_DRAFT in configs) == with_draft


@pytest.mark.parametrize("info", ["/engines/xgrammar_tokenizer_info.json", ""], ids=["guided", "compiled-without"])
def test_the_target_alone_turns_guided_decoding_on_with_compiles_tokenizer_file(info):
    """getGuidedDecodingConfigFromParams builds a guided decoder only with both keys set, and only for xgrammar; the
    draft needs none (a guided request decodes on the target alone). The gate is told, to refuse guides in one line
    where the target has none."""
    from pipeline.trtllm.reference import GUIDE_INFO_FILE

    configs = repository_configs(replace(SPEC, guide_tokenizer_info=info))
    target, draft = params(configs[TRTLLM_TARGET]), params(configs[TRTLLM_DRAFT])
    readers = {p.key: p.read_by for p in upstream.TEMPLATE_PARAMETERS}
    assert readers["guided_decoding_backend"] == readers["xgrammar_tokenizer_info_path"] == upstream.GUIDED_DECODING_REF
    assert (target["guided_decoding_backend"], target["xgrammar_tokenizer_info_path"]) == (
        ("xgrammar", info) if info else ("", ""))
    assert (draft["guided_decoding_backend"], draft["xgrammar_tokenizer_info_path"]) == ("", "")
    assert params(configs[GATE])["guided_decoding"] == ("on" if info else "off")
    assert not info or info.endswith(GUIDE_INFO_FILE)


def test_the_seed_input_is_upstreams_name_everywhere():
    """InputFieldsNames::seed is "seed": random_seed would be silently ignored by the backend."""
    configs = repository_configs(SPEC)
    for name in (TRTLLM_TARGET, TRTLLM_DRAFT, "preprocessing", GATE):
        names = {t.name for t in configs[name].input}
        assert "seed" in names and "random_seed" not in names, name
    assert SENT_INPUTS["seed"] == "UINT64"


def test_check_config_refuses_what_the_backend_refuses_at_load():
    msg = repository_configs(SPEC)[TRTLLM_TARGET]
    for key in upstream.UNGUARDED:
        broken = type(msg)()
        broken.CopyFrom(msg)
        del broken.parameters[key]
        with pytest.raises(ConfigError, match=f"lacks parameter.*{key}.*Cannot find parameter with name"):
            check_config(broken, SENT_INPUTS)
    wrong = type(msg)()
    wrong.CopyFrom(msg)
    wrong.parameters["gpt_model_type"].string_value = "${batching_strategy}"
    with pytest.raises(ConfigError, match="gpt_model_type"):
        check_config(wrong, SENT_INPUTS)
    with pytest.raises(ConfigError, match="no input random_seed"):
        check_config(msg, {**SENT_INPUTS, "random_seed": "UINT64"})


# ---- NVIDIA's container: its own template, its own fill tool ---------------------------------------------------------


def test_fill_argument_escapes_survive_fill_templates_two_splits(tmp_path):
    tools = find_container_tools(fake_container(tmp_path / "app"))
    model = TrtllmModel(TRTLLM_DRAFT, "/engines/a:b,c", 0.5, 4096, "0,1")
    msg = container_config(tools, model, max_batch_size=8, tokenizer_dir="/models/tok:1,2")
    got = params(msg)
    assert (got["gpt_model_path"], got["tokenizer_dir"], got["gpu_device_ids"]) == (
        "/engines/a:b,c", "/models/tok:1,2", "0,1")
    assert escape("0,1") == "0\\,1"  # the README's own example: "gpu_device_ids:0\,1"


def test_assemble_in_the_container_fills_upstreams_template_to_the_same_configs(tiny_target, tmp_path, monkeypatch):
    from test_triton_config import assembled, compiled, trt_checkpoint

    engine = compiled(tmp_path, trt_checkpoint(tmp_path / "t", tiny_target, tp=2),
                      trt_checkpoint(tmp_path / "d", tiny_target, tp=2))
    table = assembled(engine, tmp_path)
    monkeypatch.setenv("PIPELINE_TRTLLM_BACKEND_DIR", str(fake_container(tmp_path / "app")))
    filled = assembled(engine, tmp_path, repo=tmp_path / "filled")
    assert any("filled by" in n and "fill_template.py" in n for n in filled.notes)
    assert not any("filled by" in n for n in table.notes)
    for name in (TRTLLM_TARGET, TRTLLM_DRAFT):
        assert read_config(tmp_path / "filled" / name) == read_config(tmp_path / "repo" / name), name
    assert params(read_config(tmp_path / "filled" / TRTLLM_DRAFT))["gpu_device_ids"] == "0,1"


def test_a_container_template_of_another_version_fills_what_it_has_and_refuses_what_breaks(tiny_target, tmp_path):
    older = find_container_tools(fake_container(tmp_path / "older", drop_parameters=("enable_trt_overlap",)))
    model = TrtllmModel(TRTLLM_TARGET, "/engines/t", 0.9)
    msg = container_config(older, model, max_batch_size=8, tokenizer_dir="/tok")
    assert "enable_trt_overlap" not in msg.parameters  # left out of the fill: fill_template asserts on unknown keys
    check_config(msg, SENT_INPUTS)
    no_seed = find_container_tools(fake_container(tmp_path / "no-seed", drop_inputs=("seed",)))
    with pytest.raises(ConfigError, match="no input seed of TYPE_UINT64.*not TensorRT-LLM 1.2.1's"):
        check_config(container_config(no_seed, model, max_batch_size=8, tokenizer_dir="/tok"), SENT_INPUTS)
    no_tokenizer_dir = find_container_tools(fake_container(tmp_path / "no-tok", drop_parameters=("tokenizer_dir",)))
    with pytest.raises(ConfigError, match="tokenizer_dir"):
        check_config(container_config(no_tokenizer_dir, model, max_batch_size=8, tokenizer_dir="/tok"), SENT_INPUTS)


# ---- launching: TP 1, TP 2, TP 2 with a draft ------------------------------------------------------------------------


def serve_dry_run(repo: Path) -> str:
    result = CliRunner().invoke(main, ["serve", "--repo", str(repo), "--dry-run"])
    assert result.exit_code == 0, result.output
    return result.output.strip()


def ranks(line: str) -> tuple[dict[str, str], list[list[str]]]:
    """A launch line -> (environment, one argv per rank)."""
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    assert words[:2] == ["mpirun", "--allow-run-as-root"], line
    out, current = [], []
    for w in words[2:] + [":"]:
        if w == ":":
            assert current[:2] == ["-n", "1"]
            out.append(current[2:])
            current = []
        else:
            current.append(w)
    return env, out


@pytest.mark.parametrize("tp, draft", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2+draft"])
def test_serve_launches_each_world_size_the_way_upstream_requires(tiny_target, tmp_path, tp, draft):
    from test_triton_config import assembled, trt_checkpoint

    from pipeline.compiler import CompileOptions, compile_model

    target = trt_checkpoint(tmp_path / "t", tiny_target, tp=tp)
    d = str(trt_checkpoint(tmp_path / "d", tiny_target, tp=tp)) if draft else "none"
    compile_model(CompileOptions("trtllm", target, tmp_path / "engine", draft=d, dry_run=True))
    assembled(tmp_path / "engine", tmp_path)
    repo = tmp_path / "repo"
    env, argvs = ranks(serve_dry_run(repo))
    configs = {n: params(read_config(repo / n)) for n in (TRTLLM_TARGET, TRTLLM_DRAFT) if (repo / n).is_dir()}
    for argv in argvs:
        assert argv[0] == upstream.CONTAINER_TRITONSERVER
        assert "--disable-auto-complete-config" in argv  # LAUNCH_FACTS["disable_auto_complete"]
        assert f"--model-repository={repo}" in argv
    prefixes = [a for argv in argvs for a in argv if a.startswith("--backend-config=python,shm-region-prefix-name=")]
    assert len(set(prefixes)) == len(argvs)  # LAUNCH_FACTS["shm_prefix"]: one per rank
    for argv in argvs:  # LAUNCH_FACTS["python_shm"]: every rank's python models get regions of one size
        assert f"--backend-config=python,shm-default-byte-size={16 << 20}" in argv
    if draft:
        # Two TensorRT-LLM models: the orchestrator, one rank, spawning each model's workers on its GPUs.
        assert env == ORCHESTRATOR_ENV and len(argvs) == 1
        assert "--pinned-memory-pool-byte-size=0" in argvs[0] and "--enable-peer-access=false" in argvs[0]
        assert [a for a in argvs[0] if a.startswith("--cuda-memory-pool-byte-size")] == [
            "--cuda-memory-pool-byte-size=0:0", "--cuda-memory-pool-byte-size=1:0"]
        assert set(configs) == {TRTLLM_TARGET, TRTLLM_DRAFT}
        for model in configs.values():
            assert model["gpu_device_ids"] == "0,1" and model["participant_ids"] == "${participant_ids}"
        assert "max_tokens_in_paged_kv_cache" in configs[TRTLLM_DRAFT]
    else:
        # One model: leader mode, tp*pp ranks; rank 0 serves, the others only load the engine and wait.
        assert env == {} and len(argvs) == tp
        for rank, argv in enumerate(argvs[1:], 1):
            assert "--model-control-mode=explicit" in argv and "--load-model=tensorrt_llm" in argv
            assert "--allow-grpc=false" in argv and "--allow-http=false" in argv, rank
        assert "--model-control-mode=explicit" not in argvs[0]
        assert set(configs) == {TRTLLM_TARGET}
        assert configs[TRTLLM_TARGET]["gpu_device_ids"] == "${gpu_device_ids}"  # each rank takes its own GPU
    launch = json.loads((repo / LAUNCH_FILE).read_text())
    assert launch["tensorrt_llm_version"] == upstream.TRTLLM_VERSION


def test_every_tritonserver_flag_we_launch_with_is_in_the_real_tritonservers_help():
    """tritonserver 2.51 (bundled in nvidia-pytriton) lists its options in --help: each flag we emit, for any
    mode, must be one of them (the container's 25.12 server keeps them)."""
    from pipeline.triton.server import ServeOptions, find_tritonserver, launch_argv, server_env

    binary = find_tritonserver()
    done = subprocess.run([str(binary.path), "--help"], capture_output=True, text=True, env=server_env(binary))
    help_text = done.stdout + done.stderr
    launches = [plan_launch(PORTABLE), plan_launch(ENGINE, world_size=2, trtllm_models=(TRTLLM_TARGET,)),
                plan_launch(ENGINE, world_size=2, trtllm_models=(TRTLLM_TARGET, TRTLLM_DRAFT)),
                plan_launch(LLMAPI, world_size=2)]
    flags = set()
    for launch in launches:
        argv, _ = launch_argv(ServeOptions(repo=Path("/r")), binary, Path("/b"), "p_", launch)
        flags |= {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    flags -= {"--allow-run-as-root"}  # mpirun's own
    missing = sorted(f for f in flags if f"{f} " not in help_text and f"{f}=" not in help_text
                     and f"{f}\n" not in help_text and f"{f}," not in help_text)
    assert not missing, missing


def test_launch_modes_check_their_world_size():
    with pytest.raises(ConfigError, match="orchestrator mode runs one rank"):
        Launch("engine", "orchestrator", world_size=2)
    argv, env = launch_command(plan_launch(PORTABLE), "tritonserver", ["--x"], "p_")
    # The portable route's repository is complete too: no auto-complete stub per model (the start ~3 s shorter)
    assert argv == ["tritonserver", "--x", "--disable-auto-complete-config",
                    "--backend-config=python,shm-region-prefix-name=p_",
                    f"--backend-config=python,shm-default-byte-size={16 << 20}",
                    f"--backend-config=python,shm-growth-byte-size={16 << 20}"] and env == {}


def test_the_multi_node_launch_emits_only_what_its_launch_facts_name():
    """Every mpirun option before the rank commands, and the LLM API's launcher, is in the fact it cites."""
    from pipeline.triton.launch import LLMAPI_LAUNCHER, multinode_command

    hosts_fact = upstream.LAUNCH_FACTS["hosts"].what
    for launch in (plan_launch(ENGINE, world_size=4, trtllm_models=(TRTLLM_TARGET,)),
                   plan_launch(LLMAPI, world_size=4)):
        argv = multinode_command(launch, "tritonserver", ["--x"], "p_", ["a", "b"], 2, "kubessh")
        head = argv[:argv.index("tritonserver") if launch.mode == "llmapi" else argv.index("-n")]
        for option in head[1:]:
            if option.startswith("-"):
                assert option in hosts_fact, option
        assert head[head.index("-mca") + 1:head.index("-mca") + 3] == ["plm_rsh_agent", "kubessh"]
        if launch.mode == "llmapi":
            assert head[-1] == LLMAPI_LAUNCHER and LLMAPI_LAUNCHER in upstream.LAUNCH_FACTS["llmapi_ranks"].what
    with pytest.raises(ConfigError, match="spawns its workers on one node"):
        multinode_command(plan_launch(ENGINE, world_size=2, trtllm_models=(TRTLLM_TARGET, "tensorrt_llm_draft")),
                          "tritonserver", [], "p_", ["a", "b"], 1, "kubessh")


# ---- refusals at serve time ------------------------------------------------------------------------------------------


def mpi_repo(tmp_path, version: str = upstream.TRTLLM_VERSION) -> Path:
    repo = tmp_path / "repo"
    (repo / "tensorrt_llm").mkdir(parents=True)
    (repo / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\n')
    (repo / LAUNCH_FILE).write_text(json.dumps(plan_launch(
        ENGINE, world_size=2, trtllm_models=(TRTLLM_TARGET,), tensorrt_llm_version=version).to_dict()))
    return repo


def test_serving_engines_outside_the_container_is_one_line_naming_the_container(tmp_path, monkeypatch):
    import pipeline.triton.server as server

    monkeypatch.setattr(server.shutil, "which", lambda name: None)
    result = CliRunner().invoke(main, ["serve", "--repo", str(mpi_repo(tmp_path))])
    assert_one_line_error(result, "TensorRT-LLM engines", upstream.TRITON_CONTAINER, "--dry-run")


def test_engines_built_by_another_tensorrt_llm_are_refused_naming_both_versions(tmp_path, monkeypatch):
    import pipeline.triton.server as server
    from pipeline.trtllm import version as trtllm_version

    tritonserver = tmp_path / "tritonserver"
    tritonserver.write_text("")
    monkeypatch.setattr(server.shutil, "which", lambda name: str(tritonserver))
    monkeypatch.setattr(trtllm_version, "installed", lambda: "1.2.0")
    result = CliRunner().invoke(main, ["serve", "--repo", str(mpi_repo(tmp_path, "1.2.1"))])
    assert_one_line_error(result, "made with TensorRT-LLM 1.2.1 but this container has 1.2.0", "rebuild them here")


def test_repo_spec_without_a_draft_keeps_one_model():
    assert TRTLLM_DRAFT not in repository_configs(replace(SPEC, draft_engine_dir=""))


def test_what_tritons_openai_frontend_sends_is_what_our_ensemble_takes():
    """Every tensor of upstream's request builder is an ensemble input of ours, with its dtype (the served check,
    with the real text, is tests/test_openai_api.py)."""
    from pipeline.triton.interface import ENSEMBLE_INPUTS

    ours = {t.name: t.dtype for t in ENSEMBLE_INPUTS}
    assert {name: ours.get(name) for name, _ in upstream.TRITON_OPENAI_INPUTS} == dict(upstream.TRITON_OPENAI_INPUTS)
