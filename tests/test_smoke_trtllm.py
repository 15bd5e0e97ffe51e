"""scripts/smoke_trtllm.py, the container smoke check, on this machine's CPU.

Its checks run against a TensorRT-LLM repository whose two engine models are python stand-ins
(tests/trtllm_standin.py) on the CPU tritonserver bundled in nvidia-pytriton, served by the script's own
`pipeline serve` step; the build step needs the container, so here it is only seen failing cleanly.
The shell wrapper is only parsed (`bash -n`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("smoke_trtllm", ROOT / "scripts" / "smoke_trtllm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


smoke = _load_script()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return smoke.make_tiny_pair(tmp_path_factory.mktemp("pair"))


def standin_repo(root: Path, target: Path, draft: Path, gate) -> Path:
    """test_draft_target's stand-in repository, with our own gate and K."""
    from pipeline.triton.assemble import write_repository
    from pipeline.triton.config import TRTLLM_DRAFT, TRTLLM_TARGET, RepoSpec, read_config, write_config

    spec = RepoSpec(backend="trtllm", tokenizer_dir=str(target), engine_dir=str(target), draft_engine_dir=str(draft),
                    max_batch_size=64, max_seq_len=256, num_draft_tokens=4, gate=gate)
    repo = root / "repo"
    repo.mkdir(parents=True)
    write_repository(repo, spec)
    for name in (TRTLLM_TARGET, TRTLLM_DRAFT):
        msg = read_config(repo / name)
        msg.backend = "python"
        msg.parameters["standin_max_draft_len"].string_value = str(spec.num_draft_tokens)
        write_config(repo / name, msg)
        shutil.copyfile(Path(__file__).parent / "trtllm_standin.py", repo / name / "1" / "model.py")
    return repo


def port_args() -> list[str]:
    from pipeline.triton.ports import free_ports

    grpc, http, metrics = free_ports()
    return ["--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)]


# ---- served ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_check_passes_on_a_served_standin_repository_with_forty_concurrent_requests(pair, tmp_path, capsys):
    from pipeline.policy.gate_policy import GatePolicy
    from pipeline.triton.server import find_tritonserver

    find_tritonserver()
    # Off above 4 in flight, on again at 3; no min tokens, so 6-token requests speculate (the stand-in
    # recomputes the whole sequence per token: short answers keep 80+ requests quick on 2 cores).
    repo = standin_repo(tmp_path, *pair, GatePolicy(max_batch_size=4, hysteresis=1, min_tokens=0))
    code = smoke.main(["--repo", str(repo), "--workdir", str(tmp_path / "work"), "--json", "--max-tokens", "6",
                       "--requests", "40", "--ready-timeout", "120", *port_args()])
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert (code, report["failed"]) == (0, []), (report["checks"], report["serve"])
    assert list(checks) == ["serve", "greedy_off_on_auto", "speculation_drafts", "concurrent_auto_equals_off",
                            "gate_flips", "gate_load_requests"]
    assert checks["concurrent_auto_equals_off"]["detail"] == "40/40 identical"
    assert report["serve"]["lines"][0].startswith("launch: ") and "tritonserver" in report["serve"]["lines"][0]
    assert (tmp_path / "work" / "serve.log").is_file()  # a given --workdir is left in place


# ---- a failing step is reported, not raised -----------------------------------------------------


def test_a_serve_that_fails_is_one_failed_check_with_its_error_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = smoke.main(["--repo", str(tmp_path / "empty"), "--workdir", str(tmp_path / "work"), "--ready-timeout",
                       "60", *port_args()])
    out = capsys.readouterr().out
    assert code == 1
    assert "TensorRT-LLM smoke check FAILED: serve" in out
    assert "pipeline serve exited with code 1: Error: model repository" in out and "has no models" in out
    assert "Traceback" not in out


def test_a_build_that_fails_is_one_failed_check_and_nothing_is_served(pair, tmp_path, capsys):
    target, draft = pair
    code = smoke.main(["--target", str(target), "--draft", str(draft), "--workdir", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["failed"] == ["build"] and [c["name"] for c in report["checks"]] == ["build"]
    # This machine has no GPU and no TensorRT-LLM: the build's own one-line refusal, and its last lines.
    assert report["checks"][0]["detail"].startswith("pipeline build exited with code 1: Error: ")
    assert report["build"]["tail"] and "serve" not in report
    assert report["build"]["command"].startswith("pipeline build --backend trtllm --target ")


# ---- the pure parts ----------------------------------------------------------------------------


def test_differing_texts_fail_the_comparison_and_the_report_names_the_check():
    same = smoke.compare_texts("concurrent_auto_equals_off", ["p1", "p2"], ["abc", "xyz"], ["abc", "xyz"])
    differ = smoke.compare_texts("concurrent_auto_equals_off", ["p1", "p2"], ["abc", "xyz"], ["abc", "xyQ"])
    errored = smoke.compare_texts("concurrent_auto_equals_off", ["p1", "p2"], ["abc", "xyz"],
                                  [RuntimeError("lost\ntritonserver"), "xyz"])
    assert same.ok and same.detail == "2/2 identical"
    assert not differ.ok and differ.detail == "1/2 differ; first 'p2' differs at char 2: expected 'z', got 'Q'"
    assert not errored.ok and errored.detail == "1/2 differ; first 'p1' failed: lost tritonserver"
    checks = [smoke.Check("serve", True, "ready"), differ]
    assert smoke.exit_status(checks) == 1 and smoke.exit_status([checks[0], same]) == 0
    assert smoke.render_report(checks, {}).splitlines()[0] == "TensorRT-LLM smoke check FAILED: concurrent_auto_equals_off"
    assert smoke.report_json(checks, {})["failed"] == ["concurrent_auto_equals_off"]
    assert smoke.exit_status([]) == 1  # no check ran: not a pass


def test_speculation_check_needs_drafts_from_auto_and_on_and_accepted_ones_from_on():
    def result(drafted, accepted):
        return SimpleNamespace(drafted=drafted, accepted=accepted)

    good = smoke.speculation_check({"off": result(0, 0), "auto": result(12, 9), "on": result(12, 8)})
    assert good.ok and good.detail == "accepted/drafted: on 8/12, auto 9/12, off 0/0"
    never_accepted = smoke.speculation_check({"off": result(0, 0), "auto": result(12, 9), "on": result(12, 0)})
    assert not never_accepted.ok and never_accepted.detail.startswith("on had none of its 12 drafts accepted")
    gate_shut = smoke.speculation_check({"off": result(0, 0), "auto": result(0, 0), "on": result(12, 8)})
    assert not gate_shut.ok and "auto drafted nothing" in gate_shut.detail


SAMPLE = """\
# HELP pipeline_gate_flips_total Times the load gate changed state
# TYPE pipeline_gate_flips_total counter
pipeline_gate_flips_total{model="speculation_gate"} 0
pipeline_gate_in_flight{model="speculation_gate"} 0
pipeline_gate_threshold{model="speculation_gate"} 8
pipeline_gate_speculating{model="speculation_gate"} 1
pipeline_requests_total{model="speculation_gate",mode="speculative",reason="override"} 1
nv_inference_count{model="ensemble",version="1"} 44 1700000000000
odd_label{path="a \\"quoted\\" \\\\ path"} 2.5
"""


def test_parse_metrics_reads_names_labels_and_values():
    samples = smoke.parse_metrics(SAMPLE)
    assert len(samples) == 7  # comments skipped
    assert samples[("pipeline_gate_threshold", (("model", "speculation_gate"),))] == 8.0
    assert samples[("nv_inference_count", (("model", "ensemble"), ("version", "1")))] == 44.0  # timestamp dropped
    assert samples[("odd_label", (("path", 'a "quoted" \\ path'),))] == 2.5
    assert smoke.metric(samples, "pipeline_requests_total", mode="speculative") == 1.0
    assert smoke.metric(samples, "pipeline_requests_total", reason="load") == 0.0  # not created yet


def test_gate_checks_pass_only_when_the_gate_flipped_and_turned_requests_away():
    before = smoke.parse_metrics(SAMPLE)
    after = smoke.parse_metrics(SAMPLE.replace("flips_total{model=\"speculation_gate\"} 0",
                                               "flips_total{model=\"speculation_gate\"} 2")
                                + 'pipeline_requests_total{model="speculation_gate",mode="standard",reason="load"} 30\n')
    assert [c.ok for c in smoke.gate_checks(before, after, 40.0)] == [True, True]
    assert [c.ok for c in smoke.gate_checks(before, before, 40.0)] == [False, False]
    missing = smoke.gate_checks({}, {}, 0.0)
    assert not missing[0].ok and missing[0].detail.startswith("no pipeline_gate_flips_total")


def test_build_and_serve_use_only_flags_the_cli_has():
    from pipeline.cli.build import build
    from pipeline.cli.serve import serve

    def flags(command):
        return {opt for param in command.params for opt in param.opts}

    args = smoke.build_args(Path("t"), Path("d"), Path("w"), 1024)
    assert args[0] == "build" and {a for a in args if a.startswith("--")} <= flags(build)
    args = smoke.serve_args(Path("r"), {"grpc": 1, "http": 2, "metrics": 3}, 60, Path("log"))
    assert args[0] == "serve" and {a for a in args if a.startswith("--")} <= flags(serve)


def test_max_seq_len_stays_within_the_targets_limit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert smoke.max_seq_len_for(tmp_path) == 512
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    assert smoke.max_seq_len_for(tmp_path) == smoke.SMOKE_MAX_SEQ_LEN


def test_tiny_pair_is_two_loadable_folders_with_one_tokenizer_and_a_draft_right_most_of_the_time(pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, draft = pair
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(draft)
    assert tokenizer.chat_template is None  # prompts go in raw: their last character picks the answer
    t = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    d = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    assert (t.config.num_hidden_layers, d.config.num_hidden_layers) == (4, 1)
    answers, agree = [], 0
    with torch.no_grad():
        for prompt in smoke.prompts_for(3):
            ids = tokenizer(prompt).input_ids
            for _ in range(20):
                ids.append(int(t(torch.tensor([ids])).logits[0, -1].argmax()))
            answer = ids[-20:]
            answers.append(tokenizer.decode(answer))
            predicted = d(torch.tensor([ids])).logits[0, -21:-1].argmax(-1).tolist()  # draft's next token at each
            agree += sum(p == a for p, a in zip(predicted, answer))
            logits = t(torch.tensor([ids])).logits[0, -21:-1]  # [20, vocab]
            top2 = logits.topk(2, dim=-1).values
            # Every step's winner leads by far more than bf16's ~0.4% resolution.
            assert ((top2[:, 0] - top2[:, 1]) / top2[:, 0]).min() > 0.2
    assert len(set(answers)) == 3 and all(a.isalnum() and len(a) == 20 for a in answers)
    assert 0.6 < agree / 60 < 1.0  # mostly right, and some drafts rejected


def test_the_shell_wrapper_parses_and_is_executable():
    script = ROOT / "scripts" / "smoke_trtllm.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert script.stat().st_mode & 0o111
    text = script.read_text()
    assert "set -euo pipefail" in text and "--no-deps --no-build-isolation -e ." in text


def test_the_smoke_scripts_name_the_container_the_release_table_does():
    """The container a user is told to run in is the one pipeline.trtllm.version records for 1.2.1 (26.07, the
    newest Triton container shipping it; 25.12 shipped 1.1.0), and the shell script reads it from there."""
    from pipeline.trtllm.version import TRITON_CONTAINER

    for name in ("smoke_trtllm.sh", "smoke_trtllm.py"):
        text = (ROOT / "scripts" / name).read_text()
        named = set(re.findall(r"nvcr\.io/nvidia/tritonserver:[\w.-]+", text))
        assert named == {TRITON_CONTAINER}, (name, named)
    assert "from pipeline.trtllm.version import TRITON_CONTAINER" in (ROOT / "scripts" / "smoke_trtllm.sh").read_text()
