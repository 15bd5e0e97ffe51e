"""The paged KV cache: prefix caching, chunked prefill and preemption change no output, memory follows use, and request
groups (one client's n choices) share the slots fairly."""

import pytest
import torch

from pipeline.engine.block_manager import BlockManager, BlockTable
from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.kv_cache import BLOCK_SIZE, blocks_for
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import RequestError
from pipeline.policy.cost_model import CostModel
from tiny_models import greedy_reference

MAX_TOKENS = 30


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_batch_size": 8, "max_seq_len": 256, "gate": GatePolicy(min_tokens=0), **kw})


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Target-only greedy decoding, one request at a time, nothing cached or chunked."""
    return greedy_reference(LLMEngine.load(tiny_target, config(max_batch_size=1, prefix_caching=False,
                                                               prefill_chunk=4096)), MAX_TOKENS)


def chat_prompts(n: int, system: int = 70, seed: int = 0) -> list[list[int]]:
    """A shared system prompt (several whole blocks) and a different question each."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 256, (system,), generator=g).tolist()
    return [head + torch.randint(0, 256, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ---- the block manager alone ----------------------------------------------------------------------

def test_a_prefix_is_reused_only_when_every_token_before_it_matches():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = BlockTable()
    tokens = list(range(14))
    assert bm.admit(a, tokens) and len(a.blocks) == 4 and a.cached_tokens == 0
    bm.commit(a, tokens, 14)  # three full blocks registered; the fourth holds 2 tokens
    b = BlockTable()
    assert bm.admit(b, tokens[:12] + [99, 98]) and b.blocks[:3] == a.blocks[:3] and b.cached_tokens == 12
    c = BlockTable()
    assert bm.admit(c, [0, 1, 2, 3, 4, 5, 6, 7, 9, 9, 10, 11, 12]) and c.cached_tokens == 8  # differs in block 3
    d = BlockTable()
    assert bm.admit(d, [1] + tokens[1:]) and d.cached_tokens == 0  # the first token differs: nothing shared
    e = BlockTable()
    assert bm.admit(e, tokens[:12]) and e.cached_tokens == 8  # the last token is always computed


def test_blocks_are_shared_by_reference_and_evicted_least_recently_released_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = BlockTable(), BlockTable()
    assert bm.admit(a, [1, 2, 3, 4, 5])
    bm.commit(a, [1, 2, 3, 4, 5], 4)
    assert bm.admit(b, [1, 2, 3, 4, 9]) and b.blocks[:2] == a.blocks[:2]
    assert bm.refs[a.blocks[0]] == 2 and bm.num_free == 2
    shared = a.blocks[:2]
    bm.free(a)
    assert bm.num_free == 3  # a's last block only: the shared two are still b's
    bm.free(b)
    assert bm.num_free == 6 and bm.match([1, 2, 3, 4, 7]) == shared  # free, and still cached
    c = BlockTable()
    assert bm.admit(c, list(range(100, 110)))  # needs 5 blocks: the 4 unregistered, then the LRU cached one
    assert bm.match([1, 2, 3, 4, 7]) == shared[:1]  # the prefix's tail went first, its head survives
    assert not bm.admit(BlockTable(), [1, 2, 3, 4, 5, 6])  # 3 blocks, 1 free: refused, nothing changed
    assert bm.num_free == 1


def test_trim_gives_back_the_blocks_only_rejected_drafts_wrote():
    bm = BlockManager(num_blocks=8, block_size=4)
    t = BlockTable()
    assert bm.admit(t, list(range(6))) and bm.grow(t, 6 + 1 + 7)  # pending + 7 drafts: 4 blocks
    assert len(t.blocks) == 4
    bm.trim(t, 9)  # one draft accepted: positions < 9 -> 3 blocks
    assert len(t.blocks) == 3 and bm.num_free == 5


# ---- the engine ----------------------------------------------------------------------------------

@pytest.mark.identity
@pytest.mark.parametrize("draft", [None, "ngram", "small-draft"])
def test_prefix_hits_and_chunked_prefills_change_no_output(tiny_target, tiny_draft, reference, draft):
    prompts = chat_prompts(6)
    engine = LLMEngine.load(tiny_target, config(num_draft_tokens=3, prefill_chunk=24),
                            draft={"small-draft": tiny_draft}.get(draft, draft))
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS))  # caches the system prompt
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=MAX_TOKENS))
    for p, r in zip(prompts, first + rest):
        assert r.output_ids == reference(p)
    assert [r.num_cached_tokens for r in rest] == [64] * 5  # 4 whole blocks of the 70-token system prompt
    assert engine.blocks.hit_tokens == 5 * 64
    assert engine.stats.prefill_steps > 2  # chunks: 24 tokens a step


@pytest.mark.identity
def test_a_resent_conversation_reuses_its_own_answer(tiny_target, reference):
    """A chat's next turn resends the history: the previous answer's blocks were committed while decoding, the
    accepted drafts' tokens among them (the target drafting for itself: every draft is accepted, so block ends
    fall inside accepted runs)."""
    engine = LLMEngine.load(tiny_target, config(num_draft_tokens=3), draft=tiny_target)
    for n in (40, 41, 42, 43):
        turn1 = chat_prompts(1, system=n, seed=n)[0][:n]
        [a1] = engine.generate([turn1], SamplingParams(max_tokens=MAX_TOKENS))
        history = turn1 + a1.output_ids  # the last answer token was never fed: its K/V doesn't exist
        assert len(engine.blocks.match(history)) == (len(history) - 1) // BLOCK_SIZE
        turn2 = history + [7, 8, 9]
        [a2] = engine.generate([turn2], SamplingParams(max_tokens=MAX_TOKENS))
        assert a2.output_ids == reference(turn2)
        assert a2.num_cached_tokens == (len(history) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert engine.stats.accepted_tokens > 4 * MAX_TOKENS // 2


def test_decoding_goes_on_while_a_long_prompt_is_prefilled_in_chunks(tiny_target, reference):
    engine = LLMEngine.load(tiny_target, config(prefill_chunk=16))
    short = engine.add_request([1, 2, 3], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    long_prompt = chat_prompts(1, system=150, seed=4)[0]
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=5))
    made = []
    while long.prefilling or not long.output_ids:
        before = len(short.output_ids)
        engine.step()
        made.append(len(short.output_ids) - before)
    assert len(made) == blocks_for(len(long_prompt), 16) and all(n == 1 for n in made[:-1])
    while engine.has_unfinished():
        engine.step()
    assert short.output_ids == reference([1, 2, 3]) and long.output_ids == reference(long_prompt, 5)


@pytest.mark.identity
def test_preempted_requests_resume_with_the_same_output(tiny_target, tiny_draft, reference):
    prompts = chat_prompts(8, system=20, seed=5)
    probe = LLMEngine.load(tiny_target, config())
    per_block = probe.cache.bytes_per_block()
    # 14 blocks for 8 requests that each end up needing 4: some must give their blocks back and wait.
    engine = LLMEngine.load(tiny_target, config(num_draft_tokens=3, kv_cache_bytes=14 * per_block), draft=tiny_draft)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference(p) and r.error is None
    assert engine.stats.preemptions > 0 and engine.blocks.num_held == 0
    assert not engine._held  # the scheduler's per-group counts leave with their requests: nothing kept per request


# ---- sharing the slots between groups (one client request's n choices) ----------------------------------------

@pytest.mark.identity
def test_a_request_beside_a_group_holding_every_slot_starts_at_the_next_step(tiny_target, tiny_draft, reference):
    """One client's 8 choices hold all 4 slots; a request arriving then takes one from them at the next step (the
    group's newest gives its blocks back and resumes later) instead of waiting for a whole choice. Nothing changes
    what anyone decodes."""
    engine = LLMEngine.load(tiny_target, config(max_batch_size=4, num_draft_tokens=3), draft=tiny_draft)
    prompts = chat_prompts(8, system=20, seed=7)
    group = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), group=1) for p in prompts]
    for _ in range(3):
        engine.step()
    assert [r.status.value for r in group] == ["running"] * 4 + ["waiting"] * 4  # nobody else: it takes every slot
    lone = engine.add_request([5, 6, 7], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    assert lone.status.value == "running" and sum(r.status.value == "running" for r in group) == 3
    assert engine.stats.preemptions == 1
    while engine.has_unfinished():
        engine.step()
    assert lone.output_ids == reference([5, 6, 7])
    assert all(r.output_ids == reference(p) and r.error is None for p, r in zip(prompts, group))
    assert engine.blocks.num_held == 0 and not engine._held


@pytest.mark.identity
def test_the_slot_of_a_request_that_ended_beside_a_group_waits_for_the_next_request_before_the_group(
        tiny_target, reference):
    """A client sending requests back to back beside one client's many choices: each of its requests ends, and its
    slot waits FAIR_HOLD_STEPS steps before the group takes it back, so its next request, arriving meanwhile, starts
    at once without taking a slot from the group again (a preemption, and the group's return a step of all its rows
    and a prefill, which that request used to wait behind). Past the hold the group takes the slot."""
    from pipeline.engine.llm_engine import FAIR_HOLD_STEPS

    engine = LLMEngine.load(tiny_target, config(max_batch_size=4))
    prompts = chat_prompts(8, system=20, seed=7)
    group = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), group=1) for p in prompts]
    engine.step()
    first = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    while not first.finished:
        engine.step()
    assert engine.stats.preemptions == 1  # the first request took a slot from the group
    engine.step()  # the client's round trip: its next request comes a step later
    assert sum(r.status.value == "running" for r in group) == 3  # the slot is held
    second = engine.add_request([6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert second.status.value == "running" and engine.stats.preemptions == 1  # no slot taken from the group
    while not second.finished:
        engine.step()
    for _ in range(FAIR_HOLD_STEPS):  # held through the next FAIR_HOLD_STEPS steps' admissions
        engine.step()
        assert sum(r.status.value == "running" for r in group) == 3
    engine.step()
    assert sum(r.status.value == "running" for r in group) == 4  # nobody came: the group has its slot back
    while engine.has_unfinished():
        engine.step()
    assert first.output_ids == reference([5, 6, 7], 3) and second.output_ids == reference([6, 7, 8], 3)
    assert all(r.output_ids == reference(p) for p, r in zip(prompts, group))


def test_two_groups_end_up_with_half_the_slots_each_and_lone_requests_keep_first_come_first_served(tiny_target):
    engine = LLMEngine.load(tiny_target, config(max_batch_size=4))
    a = [engine.add_request([1, 2, i], SamplingParams(max_tokens=200), group=1) for i in range(8)]
    engine.step()
    b = [engine.add_request([3, 4, i], SamplingParams(max_tokens=200), group=2) for i in range(8)]
    engine.step()
    assert sum(r.status.value == "running" for r in a) == sum(r.status.value == "running" for r in b) == 2
    # Requests of no group are groups of one: four hold the slots, the fifth waits its turn and takes nobody's.
    engine = LLMEngine.load(tiny_target, config(max_batch_size=4))
    lone = [engine.add_request([1, 2, i], SamplingParams(max_tokens=200)) for i in range(5)]
    engine.step()
    engine.step()
    assert [r.status.value for r in lone] == ["running"] * 4 + ["waiting"] and engine.stats.preemptions == 0


def cost_model(ms_at_1_2_4_8: tuple[float, ...], context_token_s: float = 0.0) -> CostModel:
    """A decode step's cost at 1, 2, 4 and 8 rows, whatever the width, no draft cost; each cached token a row
    attends to adds context_token_s."""
    K = EngineConfig().num_draft_tokens
    return CostModel((1, 2, 4, 8), tuple(range(1, K + 2)), tuple((ms / 1000,) * (K + 1) for ms in ms_at_1_2_4_8),
                     (0.0,) * 4, (0.0,) * 4, source="test", context_token_s=context_token_s)


# A 2-core CPU (the embedded default's calibration there) and a bandwidth-bound GPU, where rows cost nothing.
CPU_STEPS, FLAT_STEPS = (10.1, 10.6, 12.9, 21.0), (10.0, 10.0, 10.0, 10.1)


@pytest.mark.identity
def test_beside_another_request_a_group_decodes_the_rows_its_cost_allows_in_turn(tiny_target, reference):
    """On the CPU's costs, 2 of the group's 7 rows keep a step within FAIR_STEP_GROWTH of the lone request's
    (10.1 ms alone, 11.75 with 2 more rows, 12.9 with 3); each row takes its turn, and nothing changes what anyone
    decodes. Where rows cost nothing the group keeps them all, unless its rows' contexts make them cost (1 ms a
    token here: the group's prompts are about 30 tokens, the lone request's 3). In the lone request's first step
    (its prompt) the group sits out: its rows would be a second forward."""
    for steps, per_token, rows in ((CPU_STEPS, 0.0, 2), (FLAT_STEPS, 0.0, 7), (FLAT_STEPS, 1e-3, 1)):
        engine = LLMEngine.load(tiny_target, config(max_batch_size=8), cost_model=cost_model(steps, per_token))
        prompts = chat_prompts(7, system=20, seed=9)
        group = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS), group=1) for p in prompts]
        engine.step()
        engine.step()
        lone = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        made = []
        for _ in range(8):  # the lone request's prefill (its first token), then 7 decode steps
            before = [len(r.output_ids) for r in group]
            engine.step()
            made.append([len(r.output_ids) - b for r, b in zip(group, before)])
        assert not any(made[0]) and all(sum(1 for n in step if n) == rows for step in made[1:]), made
        assert all(any(step[i] for step in made) for i in range(7)), made  # each in turn
        assert engine.stats.rows_held_back == 7 + 7 * (7 - rows) and engine.stats.preemptions == 0
        while engine.has_unfinished():
            engine.step()
        assert len(lone.output_ids) == 8
        assert all(r.output_ids == reference(p) for p, r in zip(prompts, group))


def test_a_group_sits_out_a_smaller_groups_prompt_step_but_never_two_in_a_row_and_never_a_long_prompts(
        tiny_target, reference):
    """Beside a prompt read in chunks, one client's choices decode every other step (their rows a second forward
    the first time, the chunks never starving them); beside one long chunk, whose forward dwarfs theirs, every
    step. A request of its own never sits out."""
    for chunk, pattern in ((8, [0, 2, 0, 2, 0]), (512, [2])):
        engine = LLMEngine.load(tiny_target, config(max_batch_size=8, prefill_chunk=chunk),
                                cost_model=cost_model(CPU_STEPS))
        prompts = chat_prompts(7, system=20, seed=9)
        group = [engine.add_request(p, SamplingParams(max_tokens=200), group=1) for p in prompts]
        while not all(r.output_ids for r in group):  # every prompt read, in chunks
            engine.step()
        long = chat_prompts(1, system=30, seed=3)[0][:40]
        lone = engine.add_request(long, SamplingParams(max_tokens=4, ignore_eos=True))
        made = []
        while lone.prefilling or lone.status.value == "waiting":
            before = sum(len(r.output_ids) for r in group)
            engine.step()
            made.append(sum(len(r.output_ids) for r in group) - before)
        assert made == pattern, made
        while not lone.finished:
            engine.step()
        assert lone.output_ids == reference(long, 4)
        assert all(reference(p)[:len(r.output_ids)] == r.output_ids[:MAX_TOKENS] for p, r in zip(prompts, group))
    engine = LLMEngine.load(tiny_target, config(max_batch_size=8), cost_model=cost_model(CPU_STEPS))
    first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=MAX_TOKENS))
    before = len(first.output_ids)
    engine.step()
    assert len(first.output_ids) == before + 1


def test_groups_of_one_size_never_hold_each_other_back_and_a_larger_keeps_the_smallers_rows(tiny_target):
    for sizes, held_back in (((4, 4), 0), ((3, 5), 2)):  # 5 beside 3 on the CPU's costs: 3 rows (the cost says 1)
        engine = LLMEngine.load(tiny_target, config(max_batch_size=8), cost_model=cost_model(CPU_STEPS))
        for group, size in enumerate(sizes, 1):
            for i in range(size):
                engine.add_request([group, 2, i], SamplingParams(max_tokens=200), group=group)
        engine.step()  # every prompt
        engine.step()
        assert engine.stats.rows_held_back == held_back, sizes


def test_a_request_given_back_while_its_prompt_is_scored_scores_it_again_from_the_start(tiny_target):
    prompt = chat_prompts(1, system=60, seed=8)[0]
    params = SamplingParams(max_tokens=4, prompt_logprobs=2)
    [alone] = LLMEngine.load(tiny_target, config()).generate([prompt], params)
    engine = LLMEngine.load(tiny_target, config(max_batch_size=2, prefill_chunk=16))
    engine.add_request([9, 9, 9], SamplingParams(max_tokens=60), group=1)
    scored = engine.add_request(prompt, params, group=1)
    engine.step()
    engine.step()  # the group holds both slots, its newest half scored
    assert 0 < len(scored.prompt_logprobs) < len(prompt) - 1
    engine.add_request([4, 4], SamplingParams(max_tokens=2))
    engine.step()
    assert scored.status.value == "waiting"
    while engine.has_unfinished():
        engine.step()
    assert scored.prompt_logprobs == alone.prompt_logprobs and scored.output_ids == alone.output_ids


def test_64_short_requests_hold_only_the_blocks_they_fill(tiny_target):
    engine = LLMEngine.load(tiny_target, config(max_batch_size=64, max_seq_len=2048, prefix_caching=False))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(64)]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.blocks.num_held)
    use = sum(blocks_for(len(p) + 12) for p in prompts)
    assert peak <= use  # what they use, not 64 x 2048 positions (8192 blocks)
    assert all(len(r.output_ids) == 12 or r.finish_reason.value == "stop" for r in reqs)
    assert peak * engine.cache.bytes_per_block() < engine.cache.nbytes() / 50


def test_a_prompt_larger_than_the_pool_is_refused_in_one_line(tiny_target):
    per_block = LLMEngine.load(tiny_target, config()).cache.bytes_per_block()
    engine = LLMEngine.load(tiny_target, config(kv_cache_bytes=4 * per_block))
    with pytest.raises(RequestError, match="the KV cache holds 64; shorten the prompt or raise kv_cache_bytes"):
        engine.add_request(list(range(70)), SamplingParams())


def test_compile_writes_the_kv_settings_and_the_engine_loads_them(tiny_target, tmp_path):
    from pipeline.compiler import CompileOptions, compile_model
    from pipeline.engine.folder import load_engine

    per_block = LLMEngine.load(tiny_target, config()).cache.bytes_per_block()
    compile_model(CompileOptions("torch", tiny_target, tmp_path / "e", kv_cache_bytes=40 * per_block,
                                 prefill_chunk=64, prefix_caching=False, calibrate=False))
    engine = load_engine(tmp_path / "e")
    assert engine.blocks.num_blocks == 40 and engine.config.prefill_chunk == 64
    assert not engine.blocks.prefix_caching


@pytest.mark.identity
@pytest.mark.parametrize("draft", ["ngram", "small-draft"])
def test_everything_in_the_mix_is_still_each_requests_own_greedy_output(tiny_target, tiny_draft, draft):
    """Prefix hits, chunked prefills, preemption, stop strings, penalties, log probs and gate flips at once: every
    answer equals the one it gets alone, uncached, unchunked and unspeculated."""
    from tiny_models import flip_gate

    def detok(ids):
        return "".join(chr(97 + i % 26) for i in ids)

    prompts = chat_prompts(6, system=40, seed=8)
    plist = [SamplingParams(max_tokens=MAX_TOKENS),
             SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.2, frequency_penalty=0.3),
             SamplingParams(max_tokens=MAX_TOKENS, logprobs=3),
             SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.5, logprobs=0),
             SamplingParams(max_tokens=MAX_TOKENS),
             SamplingParams(max_tokens=12)]
    alone = LLMEngine.load(tiny_target, config(max_batch_size=1, prefix_caching=False, prefill_chunk=4096))
    alone.detokenize = detok
    want = [alone.generate([p], sp)[0] for p, sp in zip(prompts, plist)]
    # a stop string from the middle of request 4's answer
    stop = detok(want[4].output_ids)[9:12]
    plist[4] = SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,))
    want[4] = alone.generate([prompts[4]], plist[4])[0]
    assert want[4].finish_reason.value == "stop" and want[4].stop_reason == stop

    per_block = alone.cache.bytes_per_block()
    engine = LLMEngine.load(tiny_target, config(num_draft_tokens=3, gate=flip_gate(), prefill_chunk=9,
                                                kv_cache_bytes=12 * per_block),
                            draft="ngram" if draft == "ngram" else tiny_draft)
    engine.detokenize = detok
    reqs = [engine.add_request(prompts[0], plist[0])]
    for _ in range(8):  # the first one decodes alone (and caches the system prompt) before the rest arrive
        engine.step()
    reqs += [engine.add_request(p, sp) for p, sp in zip(prompts[1:], plist[1:])]
    while engine.has_unfinished():
        engine.step()
    for got, exp in zip(reqs, want):
        assert got.output_ids == exp.output_ids and got.logprobs == exp.logprobs
        assert (got.finish_reason, got.stop_text_len) == (exp.finish_reason, exp.stop_text_len)
    assert engine.blocks.hit_tokens > 0 and engine.stats.preemptions > 0
    assert engine.gate.flips >= 1 and engine.stats.drafted_tokens > 0


def test_the_attention_mask_lets_a_query_see_keys_up_to_its_own_position_and_a_pad_key_0():
    from pipeline.engine.kv_cache import ForwardBatch, KVCache

    cache = KVCache(1, 2, 64, 1, 4, torch.float32)
    fb = ForwardBatch.build([0, 1], [3, 1], [2, 1], cache)  # row 0: positions 3, 4; row 1: position 1, then a pad
    assert fb.attn_mask.shape == (2, 1, 2, 5)
    assert fb.attn_mask[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    assert fb.attn_mask[1, 0].tolist() == [[True, True, False, False, False], [True] + [False] * 4]
    assert ForwardBatch.build([0, 1], [7, 7], [1, 1], cache).attn_mask is None  # every key is visible to every row


def test_a_batch_too_large_for_the_fixed_priors_drafts_learns_they_pay_and_a_seeded_request_still_replays(
        tiny_target, monkeypatch):
    """Four greedy requests whose drafts always pass (the target drafts for itself), where the cost model says
    drafts pay at 4 rows only above the fixed prior's acceptance: with no draft ever checked nobody would draft
    (as with the probes off). The engine probes a row while its evidence is thin, learns, and the batch speculates;
    the output is the target's. A seeded sampled request gives the same answer before and after the engine learned."""
    from pipeline.policy.draft_plan import EXPLORE_CHECKS, SharedAcceptance

    K = 4
    rows = (1, 2, 4, 8)  # 1 s a plain step at any batch; at 4+ rows each drafted position adds 0.8 s
    target = tuple(tuple(1.0 + (0.8 * (w - 1) if b >= 4 else 0.0) for w in range(1, K + 2)) for b in rows)
    cost = CostModel(rows, tuple(range(1, K + 2)), target, (0.0,) * 4, (0.0,) * 4, source="test")
    prompts = chat_prompts(4, system=10, seed=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)  # all four to the end together: 4 rows throughout
    plain = [r.output_ids for r in LLMEngine.load(tiny_target, config()).generate(prompts, params, speculation="off")]
    for explore in (False, True):
        if not explore:  # never thin: no row skipped for cost is ever probed
            monkeypatch.setattr(SharedAcceptance, "thin", property(lambda self: False))
        else:
            monkeypatch.undo()
        engine = LLMEngine.load(tiny_target, config(num_draft_tokens=K, prefill_chunk=256), draft=str(tiny_target),
                                cost_model=cost)
        sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
        [first] = engine.generate([[7, 8, 9]], sampled)
        reqs = engine.generate(prompts, params)
        assert [r.output_ids for r in reqs] == plain
        if not explore:
            assert all(r.num_drafted == 0 for r in reqs) and engine.shared_acceptance[""].checks == 0
            continue
        assert all(r.num_drafted >= MAX_TOKENS // 2 for r in reqs) and engine.stats.spec_steps > 2 * engine.stats.nonspec_steps
        assert engine.shared_acceptance[""].checks >= EXPLORE_CHECKS and engine.shared_acceptance[""].first > 0.9
        [again] = engine.generate([[7, 8, 9]], sampled)
        assert again.output_ids == first.output_ids
