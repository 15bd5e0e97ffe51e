"""`pipeline draft train`: ModelOpt EAGLE-3 training on a tiny target, export, resume, the engine
running the exported head losslessly, and the budget holding for the whole run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli_checks import assert_one_line_error
from pipeline.cli import main
from pipeline.draft.data import draft_vocab, load_prompts, split_prompts
from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.model import Transformer
from pipeline.engine.sampling import SamplingParams
from tiny_models import GEMMA3_WINDOW, make_tiny_llama

# The speculative module takes 7-10 s to import on 2 cores; import it once here, so the budget tests
# time the training run rather than whichever test happens to import it first.
import modelopt.torch.speculative  # noqa: E402,F401  (required by pyproject: a missing one fails, never skips)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("train-target"), seed=0, layers=8)


def train_args(target: Path, prompts_file: Path, out: Path, budget_minutes: float) -> list[str]:
    return ["draft", "train", "--target", str(target), "--data", str(prompts_file), "--max-new-tokens", "16",
            "--draft-vocab-size", "64", "--text-samples", "8", "--answer-rounds", "1",
            "--budget-minutes", str(budget_minutes), "-o", str(out)]


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(f"Write a Python function number {i} that adds two numbers." for i in range(12)))
    return f


def test_builtin_prompts_ship_with_a_notice_and_a_held_out_slice():
    prompts = load_prompts("builtin")
    train, held = split_prompts(prompts)
    assert len(prompts) >= 100 and len(held) == len(prompts) // 10
    assert not set(train) & set(held)
    assert (Path(__file__).parents[1] / "pipeline" / "draft" / "data" / "NOTICE").is_file()


def test_draft_vocab_keeps_the_most_frequent_tokens_in_id_order():
    d2t = draft_vocab([[5, 5, 5, 9, 9, 2]], vocab_size=12, draft_vocab_size=3)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 9]
    filled = torch.arange(5) + draft_vocab([[7]], vocab_size=12, draft_vocab_size=5)
    assert filled.tolist() == [0, 1, 2, 3, 7]


def test_the_default_draft_vocabulary_keeps_the_lm_head_within_its_share_of_the_head():
    from pipeline.draft.data import DRAFT_VOCAB_MAX, LM_HEAD_SHARE, default_draft_vocab_size

    smol = dict(hidden=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate=1536, vocab_size=49152)
    assert default_draft_vocab_size(**smol) == 4096  # 0.58 of the layer's 4.1 M weights; 8192 would be 1.15
    layer = 2 * 576 * 15 * 64 + 576 * 576 + 3 * 576 * 1536
    assert 4096 * 576 <= LM_HEAD_SHARE * layer < 8192 * 576
    llama8b = dict(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate=14336, vocab_size=128256)
    assert default_draft_vocab_size(**llama8b) == 32768  # the published EAGLE-3 heads' 32000, rounded up
    llama70b = {**llama8b, "hidden": 8192, "num_heads": 64, "intermediate": 28672}
    assert default_draft_vocab_size(**llama70b) == DRAFT_VOCAB_MAX
    assert default_draft_vocab_size(**{**smol, "vocab_size": 600}) == 600  # never past the target's vocabulary


def test_the_work_folder_is_keyed_by_the_resolved_draft_vocabulary(tmp_path):
    from pipeline.draft.train import TrainOptions, _work_dir

    # A folder's d2t.pt and checkpoint are a head over that many tokens: a changed default must not resume them.
    default, explicit = TrainOptions("t", tmp_path), TrainOptions("t", tmp_path, draft_vocab_size=4096)
    assert _work_dir(tmp_path, default, ["p"], 4096) == _work_dir(tmp_path, explicit, ["p"], 4096)
    assert _work_dir(tmp_path, default, ["p"], 4096) != _work_dir(tmp_path, default, ["p"], 8192)


def test_train_exports_a_head_the_engine_runs_and_a_rerun_resumes(tmp_path, target, prompts_file, monkeypatch):
    out = tmp_path / "head"
    args = ["draft", "train", "--target", str(target), "--data", str(prompts_file), "--max-new-tokens", "16",
            "--draft-vocab-size", "64", "--text-samples", "8", "--budget-minutes", "3", "--json", "-o", str(out)]
    # One answer a prompt, so the step counts below are known; a last rerun adds a sampled round.
    res = CliRunner().invoke(main, [*args, "--answer-rounds", "1", "--epochs", "2"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    # 11 answers + 8 text samples, batch 4 -> 5 steps per epoch
    assert report["answers"] == 11 and report["steps"] == 10 and report["stopped_by"] == "epochs"
    assert report["epochs"] == 2
    assert report["resumed_from_step"] == 0 and report["aux_layers"] == [1, 3, 4]
    assert report["train_precision"] in ("fp32", "bf16")
    assert report["head"]["hidden_size"] == 64 and report["head"]["intermediate_size"] == 128
    assert set(report["acceptance"]["by_k"]["6"]) >= {"accepted_through_position", "mean_acceptance_length"}
    cost = report["acceptance"]["by_k"]["6"]["draft_cost"]  # the head's proposals against the target's steps
    assert cost["proposal_ms"] > 0 and cost["verify_step_ms"] > 0 and cost["proposal_vs_verify_step"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert (out / "train_report.json").is_file()

    # The engine runs the exported head, and the output is still the target's own.
    cfg = EngineConfig(max_batch_size=4, max_seq_len=128, num_draft_tokens=3, gate=GatePolicy(min_tokens=0))
    prompts = [[10, 20, 30, 40], [50, 60, 70]]
    spec = LLMEngine.load(target, cfg, draft=f"eagle3:{out}")
    plain = LLMEngine.load(target, cfg)
    a = spec.generate(prompts, SamplingParams(max_tokens=20))
    b = plain.generate(prompts, SamplingParams(max_tokens=20))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert spec.stats.drafted_tokens > 0 and spec.describe()["draft"]["layout"] == "modelopt"

    # Same settings, more epochs: answers and hidden states come from the cache, training resumes. This half
    # runs in bf16 autocast, which this tiny shape would not pick on its own: ModelOpt's training steps under it.
    monkeypatch.setattr("pipeline.draft.train.train_precision", lambda hidden, vocab: "bf16")
    res = CliRunner().invoke(main, [*args, "--answer-rounds", "1", "--epochs", "3", "--force"])
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)
    assert again["work_dir"] == report["work_dir"] and again["train_precision"] == "bf16"
    assert again["resumed_from_step"] == 10 and again["steps"] == 15
    assert again["final_loss"] is not None and again["final_loss"] == again["final_loss"]  # finite, not NaN

    # A second round of answers, sampled: 11 more sequences, a new epoch over (22 + 8) / 4 -> 8 steps.
    res = CliRunner().invoke(main, [*args, "--answer-rounds", "2", "--epochs", "4", "--force"])
    assert res.exit_code == 0, res.output
    more = json.loads(res.stdout)
    assert more["answers"] == 22 and more["resumed_from_step"] == 15 and more["steps"] == 23
    answers = torch.load(Path(more["work_dir"]) / "answers.pt")
    assert answers[:11] != answers[11:] and [a[:5] for a in answers[:11]] == [a[:5] for a in answers[11:]]


def test_automatic_answers_keep_the_hidden_states_within_memory_and_short_budgets_for_training():
    from pipeline.draft.train import FEATURE_MEMORY_BYTES, MAX_ANSWER_ROUNDS, _auto_answers

    ids = [[1] * 62] * 207
    smol = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "intermediate_size": 1536, "vocab_size": 49152}
    llama8b = {**smol, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    per_answer = (62 + 128) * 4 * 576 * 2  # bf16 states of three aux layers and the last, per token
    assert _auto_answers(ids, 128, 3, smol, budget_minutes=20) == 207 * 11  # one sampled round per 2 minutes
    assert _auto_answers(ids, 128, 3, smol, budget_minutes=60) == FEATURE_MEMORY_BYTES // per_answer < 207 * 24
    assert _auto_answers(ids[:20], 128, 3, smol, budget_minutes=60) == 20 * MAX_ANSWER_ROUNDS
    assert _auto_answers(ids, 128, 3, llama8b, budget_minutes=20) == FEATURE_MEMORY_BYTES // (per_answer * 64 // 9)
    # The cap counts answers: a prompt set larger than it stops partway through its first round.
    assert _auto_answers(ids * 40, 128, 3, llama8b, budget_minutes=20) == _auto_answers(ids, 128, 3, llama8b, 20) < 8280
    # A short budget keeps its time for training: one sampled round per 2 minutes.
    assert _auto_answers(ids, 128, 3, smol, budget_minutes=0.4) == 207
    assert _auto_answers(ids, 128, 3, smol, budget_minutes=5) == 207 * 3


def test_the_learning_rate_warms_up_once_then_falls_to_its_floor_by_the_end_of_each_run():
    from pipeline.draft.train import LR_FLOOR, WARMUP_STEPS, lr_factor

    warmup = [lr_factor(s, 0.0) for s in range(WARMUP_STEPS)]
    assert warmup == sorted(warmup) and warmup[0] == pytest.approx(1 / WARMUP_STEPS) and warmup[-1] == 1.0
    decay = [lr_factor(WARMUP_STEPS + 50, d / 10) for d in range(11)]
    assert decay == sorted(decay, reverse=True) and decay[0] == 1.0 and decay[-1] == pytest.approx(LR_FLOOR)
    assert lr_factor(WARMUP_STEPS, 0.5) == pytest.approx((1 + LR_FLOOR) / 2)
    # A resumed run (its steps counted from the head's first) starts at the peak: no second warmup.
    assert lr_factor(500, 0.0) == 1.0
    assert lr_factor(500, 1.7) == lr_factor(500, 1.0)  # a step past the phase's end stays at the floor


def test_the_head_starts_as_the_targets_last_layer_and_output_side_reading_the_highest_captured_layer(target):
    from safetensors.torch import load_file

    from pipeline.draft.train import _modelopt_eagle, head_architecture

    cfg = json.loads((target / "config.json").read_text())
    d2t = draft_vocab([[5, 6, 7, 5]], cfg["vocab_size"], 64)
    head = _modelopt_eagle(target, head_architecture(cfg, 64), d2t).eagle_module
    sd = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items()}
    last = f"model.layers.{cfg['num_hidden_layers'] - 1}."
    layer = head.layers[0]
    for name in ("q_proj", "k_proj", "v_proj"):  # [embedding | fused state] in, half the target's projection each
        w = sd[f"{last}self_attn.{name}.weight"]
        assert torch.equal(getattr(layer.self_attn, name).weight, torch.cat([w / 2, w / 2], dim=1))
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm",
                 "input_layernorm"):
        assert torch.equal(layer.get_submodule(name).weight, sd[f"{last}{name}.weight"]), name
    assert torch.equal(layer.hidden_norm.weight, sd[f"{last}input_layernorm.weight"])
    lm_head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head.weight, lm_head[torch.arange(64) + d2t])
    assert torch.equal(head.norm.weight, sd["model.norm.weight"])
    # fc fuses [low | middle | high] captured states: it starts passing the high one through.
    H = cfg["hidden_size"]
    assert torch.equal(head.fc.weight, torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], dim=1))


def test_a_gemma3_targets_head_starts_from_its_last_layer_as_a_llama_layer_reads_it(tmp_path):
    """Gemma 3's norms scale by (1 + w) and its norm before the MLP is pre_feedforward_layernorm: the head's Llama
    layer starts with 1 + w in each norm's place, and its rope is the one the architecture asks for, not the
    target's two (a per-layer-type rope_parameters, which a Llama layer can't read)."""
    from safetensors.torch import load_file

    from pipeline.draft.train import _modelopt_eagle, head_architecture

    target = make_tiny_llama(tmp_path / "gemma3", seed=0, layers=8, model_type="gemma3_text", head_dim=16,
                             config=GEMMA3_WINDOW)
    cfg = json.loads((target / "config.json").read_text())
    d2t = draft_vocab([[5, 6, 7, 5]], cfg["vocab_size"], 64)
    arch = head_architecture(cfg, 64)
    head = _modelopt_eagle(target, arch, d2t).eagle_module
    sd = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items()}
    last, layer = f"model.layers.{cfg['num_hidden_layers'] - 1}.", head.layers[0]
    for ours, theirs in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm",
                                                                  "pre_feedforward_layernorm")):
        assert torch.equal(layer.get_submodule(ours).weight, sd[f"{last}{theirs}.weight"] + 1), ours
    assert torch.equal(layer.hidden_norm.weight, sd[f"{last}input_layernorm.weight"] + 1)
    assert torch.equal(head.norm.weight, sd["model.norm.weight"] + 1)
    assert arch["rope_theta"] == 1_000_000.0  # the global layers' base
    assert torch.allclose(head.rotary_emb.inv_freq[1], torch.tensor(1e6 ** (-2 / 16)))


def test_answer_states_load_chunk_by_chunk_and_drop_a_chunk_its_answers_never_counted(tmp_path):
    from pipeline.draft.train import _load_answer_states, _save

    folder = tmp_path / "answer-states"
    folder.mkdir()
    state = lambda i: {"aux": torch.full((2, 3), float(i)), "final": torch.full((2, 1), float(i))}  # noqa: E731
    _save([state(0), state(1)], folder / "0000000.pt")
    _save([state(2)], folder / "0000002.pt")
    _save([state(3), state(4)], folder / "0000003.pt")  # saved, then the run stopped before the answers' save
    loaded = _load_answer_states(folder, answers=3)
    assert [int(f["aux"][0, 0]) for f in loaded] == [0, 1, 2]
    assert sorted(p.name for p in folder.iterdir()) == ["0000000.pt", "0000002.pt"]  # the next chunk starts at 3
    assert _load_answer_states(folder, answers=0) == [] and not list(folder.iterdir())
    # A work folder of an earlier version kept every answer's states in one file: they are the first chunk now.
    _save([state(7), state(8)], tmp_path / "features.pt")
    assert [int(f["aux"][0, 0]) for f in _load_answer_states(folder, answers=2)] == [7, 8]
    assert not (tmp_path / "features.pt").exists() and [p.name for p in folder.iterdir()] == ["0000000.pt"]


def test_bad_options_are_one_line_errors(tmp_path, target, prompts_file):
    existing = tmp_path / "exists"
    existing.mkdir()
    base = ["draft", "train", "--target", str(target), "--data", str(prompts_file)]
    cases = [
        ([*base, "--method", "medusa", "-o", str(tmp_path / "a")], "--method"),
        ([*base, "-o", str(existing)], "--force"),
        (["draft", "train", "--target", str(target), "--data", str(tmp_path / "none.txt"), "-o", str(tmp_path / "b")],
         "--data"),
        ([*base, "--draft-vocab-size", "100000", "-o", str(tmp_path / "c")], "--draft-vocab-size"),
    ]
    for args, needle in cases:
        assert_one_line_error(CliRunner().invoke(main, args), needle)


def test_the_draft_vocabularys_logits_are_modelopts_own(target):
    """The distillation targets train.py hands ModelOpt (the draft vocabulary's rows of the target's lm_head alone) are
    the ones its offline forward would compute from the whole lm_head and then map to the draft vocabulary."""
    import json as _json

    from pipeline.draft.train import _collate, _draft_logits, _modelopt_eagle, head_architecture

    cfg = _json.loads((target / "config.json").read_text())
    d2t = draft_vocab([[5, 9, 9, 40, 77, 77, 77]], cfg["vocab_size"], 64)
    model = _modelopt_eagle(target, head_architecture(cfg, 64), d2t)
    g = torch.Generator().manual_seed(0)
    feats = {"aux": torch.randn(6, 3 * cfg["hidden_size"], generator=g),
             "final": torch.randn(6, cfg["hidden_size"], generator=g)}
    batch = _collate([([1, 2, 3, 4, 5, 6], feats)])
    _draft_logits(model, batch)
    with torch.no_grad():
        full = model._base_model_lm_head(model._base_model_norm(batch["base_model_outputs"]["base_model_hidden_states"]))
        want = type(model)._map_logits_to_draft_vocab(model, full)
    torch.testing.assert_close(batch["base_model_outputs"]["base_model_logits"], want, atol=1e-5, rtol=1e-5)
    assert model._map_logits_to_draft_vocab(want) is want  # already mapped: ModelOpt's own mapping is skipped


def test_acceptance_report_derives_mean_length_per_k_from_one_run():
    from pipeline.draft.report import acceptance_from_stats, acceptance_table
    from pipeline.engine.stats import EngineStats

    stats = EngineStats()
    for accepted in (0, 1, 3, 3):  # four verify steps with K=3
        stats.record_verification(3, accepted)
    acc = acceptance_from_stats(stats)
    assert acc["accepted_through_position"] == [0.75, 0.5, 0.5]
    assert acc["mean_acceptance_length"] == 1 + 7 / 4
    assert acc["mean_acceptance_length_at_k"] == {1: 1.75, 2: 2.25, 3: 2.75}  # K=3 equals the measured one
    assert "| 3 | 0.75 0.50 0.50 | 2.75 |" in acceptance_table({"by_k": {3: acc}})
    assert acc["draft_cost"] is None  # nothing was timed
    from pipeline.engine.stats import cost_line

    stats.proposer_time_s, stats.proposals, stats.proposed_tokens = 0.012, 4, 12
    stats.plain_verify_s, stats.plain_verifies = 0.04, 4
    assert cost_line(stats.draft_cost()) == "a proposal 3.0 ms (1.0 ms a drafted token), 0.30 of a plain step (10.0 ms)"
    stats.spec_verify_s, stats.spec_verifies = 0.06, 4
    assert stats.draft_cost()["proposal_vs_verify_step"] == 0.2


def test_answers_come_with_the_states_a_separate_target_forward_computes(target, monkeypatch):
    """The engine records each answer's hidden states while it decodes (prefill, prefix-cache hits, decode steps,
    a preempted request recomputed): they must be a second forward's over the same tokens, bit for bit (the CPU
    engine's rows are invariant by construction). And a deadline keeps a prefix of the answers, each cut to its
    tokens with states."""
    from pipeline.draft import budget
    from pipeline.draft.data import answer_engine, generate_answers, target_features
    from pipeline.engine.weights import load_transformer

    config = EngineConfig(max_batch_size=3, max_seq_len=64, dtype="fp32", gate=GatePolicy(min_tokens=0),
                          kv_cache_bytes=6 * 16 * 2 * 8 * 2 * 16 * 4)  # a few blocks: rows get preempted
    model = load_transformer(target, 64, torch.float32, keep_plain=False)
    aux = (1, 3, 4)
    engine = answer_engine(model, config, (), aux)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # a cached prefix for the later rows
    prompts = [shared + [30 + i] for i in range(5)]
    added, add = [], engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, **kw: added.append(add(*a, **kw)) or added[-1])
    seqs, feats = generate_answers(engine, prompts, 24, temperature=1.0, seed=3)
    assert len(seqs) == 5 and engine.stats.preemptions > 0 and any(r.num_cached_tokens for r in added)
    for seq, prompt, feat in zip(seqs, prompts, feats):
        assert seq[:len(prompt)] == prompt and len(seq) == len(prompt) + 24 - 1  # the last token is never fed
        again = target_features(model, [seq], aux, dtype=torch.bfloat16)[0]
        assert torch.equal(feat["aux"], again["aux"]) and torch.equal(feat["final"], again["final"])
    assert not engine.proposer.states and not engine.proposer.restart

    clock = iter(range(1000))
    monkeypatch.setattr(budget, "now", lambda: next(clock))
    seqs, feats = generate_answers(engine, prompts, 24, deadline=8)
    assert 1 <= len(seqs) < 5 and [s[:len(p)] for s, p in zip(seqs, prompts)] == prompts[:len(seqs)]
    assert all(len(s) == len(f["final"]) < len(p) + 23 for s, f, p in zip(seqs, feats, prompts))
    assert not engine.proposer.states


@pytest.fixture
def no_time_to_train(monkeypatch):
    """The budget's phases as a too-small budget plans them on any machine: the data is made, then training's
    phase is already over. Driving the phases, not the wall, keeps the tests below from depending on how fast
    this machine is (under load, a 0.1-minute budget ran out in the data phase instead, and said so)."""
    import math

    from pipeline.draft.budget import PhasePlan

    monkeypatch.setattr(PhasePlan, "answers_end", property(lambda self: math.inf))
    monkeypatch.setattr(PhasePlan, "data_end", property(lambda self: math.inf))
    monkeypatch.setattr(PhasePlan, "train_end", property(lambda self: self.start))


def test_a_budget_too_small_to_train_the_minimum_steps_fails_in_one_line_and_exports_nothing(
        tmp_path, target, prompts_file, no_time_to_train):
    out = tmp_path / "head"
    res = CliRunner().invoke(main, [*train_args(target, prompts_file, out, 0.1), "--json"])
    assert_one_line_error(res, "--budget-minutes", "steps")
    assert not out.exists() and not list(tmp_path.glob(".head*"))  # no head, no staging folder beside it


@pytest.mark.slow  # trains with ModelOpt, a few steps
def test_a_busy_machine_still_ends_within_the_budget_and_trains_the_minimum_steps(
        tmp_path, target, prompts_file, monkeypatch):
    from pipeline.draft import budget, train
    from pipeline.draft.budget import allowed_overrun_s
    from pipeline.draft.train import MIN_TRAIN_STEPS

    # A loaded box, on the budget's own clock, which only this test moves: every forward of the target (its
    # answers, its hidden states, the acceptance run) takes 0.4 s, and every training step 0.1 s. The old
    # trainer then spent the budget on data, trained 0 steps, and ran on to measure acceptance unbounded: 49 s
    # for this 18-s budget. Driving the clock rather than sleeping keeps the outcome the same on any machine.
    clock = [1000.0]
    monkeypatch.setattr(budget, "now", lambda: clock[0])
    forward, collate = Transformer.forward, train._collate

    def slow_forward(self, *args, **kwargs):
        clock[0] += 0.4
        return forward(self, *args, **kwargs)

    def slow_step_batch(*args, **kwargs):  # once per training step, inside the time the step measures
        clock[0] += 0.1
        return collate(*args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", slow_forward)
    monkeypatch.setattr(train, "_collate", slow_step_batch)
    budget_minutes = 0.3
    t0 = clock[0]
    res = CliRunner().invoke(main, [*train_args(target, prompts_file, tmp_path / "head", budget_minutes), "--json"])
    took = clock[0] - t0
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert took <= budget_minutes * 60 + allowed_overrun_s(budget_minutes * 60), (took, report.get("phase_seconds"))
    assert report["steps"] >= MIN_TRAIN_STEPS
    assert report["phase_seconds"]["train"] > 0 and report["stopped_by"] == "budget"  # the clock, not the epochs


def test_the_summary_prints_when_metrics_are_missing(tmp_path, monkeypatch):
    from pipeline.draft import train
    from pipeline.draft.report import acceptance_table

    def no_metrics(opts):
        return train.TrainResult(
            output=str(opts.output), target=opts.target, method="eagle3", work_dir="w", train_prompts=11,
            heldout_prompts=1, answers=11, train_tokens=300, draft_vocab_size=64, aux_layers=[1, 3, 4], text_samples=0,
            head={}, epochs=4.0, steps=20, resumed_from_step=20, train_seconds=9.0, total_seconds=12.0,
            budget_minutes=0.2, stopped_by="epochs", final_loss=None, train_acc=[], acceptance=None)

    monkeypatch.setattr(train, "train_draft", no_metrics)
    res = CliRunner().invoke(main, ["draft", "train", "--target", "t", "-o", str(tmp_path / "head")])
    assert res.exit_code == 0, res.output
    assert "loss none" in res.output and "acceptance: not measured" in res.output
    assert "| 6 | not measured" in acceptance_table({"by_k": {6: None}})  # cut before its first verify step


def test_the_build_stage_fails_the_same_way_naming_its_own_budget_flag(tmp_path, target, no_time_to_train):
    engines = tmp_path / "engines"
    res = CliRunner().invoke(main, ["build", "--target", str(target), "--backend", "torch", "--draft", "eagle3",
                                    "--draft-budget-minutes", "0.1", "--max-batch-size", "2", "--max-seq-len", "256",
                                    "--engines-dir", str(engines), "--repo", str(tmp_path / "repo"), "--quiet"])
    assert_one_line_error(res, "--draft-budget-minutes", "steps")
    assert not list((engines / target.name).glob("*draft-eagle3*"))
