"""Speculative decoding is lossless.

Greedy: the output is exactly the target's argmax chain. Sampled: the output follows the target's
distribution exactly (rejection sampling with the residual distribution, Leviathan et al. 2023 /
Chen et al. 2023). The sampled claim is checked with chi-square goodness-of-fit tests on tiny
vocabularies, first on `accept_sampled` alone, then end to end through the engine against the exact
distribution of a tiny model; negative controls show the same checks reject wrong acceptance rules.

All seeds are fixed, so every p-value is deterministic; the thresholds (1e-4 to pass, 1e-6 for a
wrong rule to fail) sit far from the values the tests actually see.
"""

from __future__ import annotations

import itertools
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from pipeline.engine.request import Request
from pipeline.engine.sampling import SamplingParams, probs_from_logits, sample
from pipeline.engine.speculative import accept_greedy, accept_sampled

PASS_P = 1e-4  # a correct rule must give p-values above this
FAIL_P = 1e-6  # a wrong rule must give p-values below this


@contextmanager
def single_thread():
    """These tests run thousands of tiny ops; intra-op threads only add overhead (and thrash badly on
    a loaded machine), so run them on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# ---- chi-square ------------------------------------------------------------------------------------

def chi_square(counts: dict, probs: dict, min_expected: float = 5.0) -> tuple[float, float, int, int]:
    """Goodness of fit of observed counts {outcome: n} to exact probabilities {outcome: p}.

    Outcomes with p = 0 that were observed make the fit impossible (p-value 0). Cells expected to
    hold fewer than min_expected are pooled into one cell so the chi-square approximation holds.
    Returns (p_value, statistic, degrees of freedom, number of impossible observations).
    """
    n = sum(counts.values())
    impossible = sum(c for o, c in counts.items() if probs.get(o, 0.0) <= 0.0)
    cells, small_o, small_e = [], 0.0, 0.0
    for o, p in probs.items():
        if p <= 0.0:
            continue
        e, c = n * p, counts.get(o, 0)
        if e < min_expected:
            small_o, small_e = small_o + c, small_e + e
        else:
            cells.append((c, e))
    if small_e > 0:
        if small_e >= min_expected or not cells:
            cells.append((small_o, small_e))
        else:  # fold a too-small pool into the smallest regular cell
            i = min(range(len(cells)), key=lambda j: cells[j][1])
            cells[i] = (cells[i][0] + small_o, cells[i][1] + small_e)
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    if impossible:
        return 0.0, float("inf"), df, impossible
    if df == 0:
        return 1.0, stat, df, 0
    # chi2 survival function: the regularized upper incomplete gamma Q(df/2, stat/2)
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return p_value, stat, df, 0


def test_chi_square_helper():
    probs = {0: 0.5, 1: 0.25, 2: 0.25, 3: 0.0}
    p, stat, df, bad = chi_square({0: 500, 1: 250, 2: 250}, probs)
    assert (p, stat, df, bad) == (1.0, 0.0, 2, 0)
    p, stat, df, _ = chi_square({0: 520, 1: 240, 2: 240}, probs)
    assert stat == pytest.approx(20 ** 2 / 500 + 2 * 10 ** 2 / 250) and df == 2
    assert p == pytest.approx(0.449329, abs=1e-6)  # scipy.stats.chi2.sf(1.6, 2) = exp(-0.8)
    assert chi_square({0: 499, 1: 250, 2: 250, 3: 1}, probs)[0] == 0.0  # an impossible outcome
    # small cells are pooled: 3 cells of expected 2 become one of expected 6
    p, stat, df, _ = chi_square({0: 94, 1: 2, 2: 2, 3: 2}, {0: 0.94, 1: 0.02, 2: 0.02, 3: 0.02})
    assert df == 1 and stat == pytest.approx(0.0)


# ---- accept_greedy -----------------------------------------------------------------------------------

def test_accept_greedy_all_accepted_takes_bonus():
    # argmax at [pending, d1, d2, d3]: the drafts match the first three, the bonus is argmax[3]
    assert accept_greedy([4, 7, 1, 9], [4, 7, 1]) == (3, 9)


@pytest.mark.parametrize("argmax, drafts, expect", [
    ([4, 7, 1, 9], [5, 7, 1], (0, 4)),  # first draft wrong: the target's own token replaces it
    ([4, 7, 1, 9], [4, 2, 1], (1, 7)),  # later drafts are not looked at past the first mismatch
    ([4, 7, 1, 9], [4, 7, 0], (2, 1)),
    ([4, 4, 4, 4], [4, 4, 4], (3, 4)),
])
def test_accept_greedy_first_mismatch(argmax, drafts, expect):
    assert accept_greedy(argmax, drafts) == expect


def test_accept_greedy_no_drafts():
    assert accept_greedy([6], []) == (0, 6)


def test_accept_greedy_reproduces_the_argmax_chain():
    """Whatever a proposer drafts, the emitted stream equals the target's own greedy chain."""
    g = torch.Generator().manual_seed(0)
    V, N = 5, 12

    def target_next(ctx):  # a deterministic toy "target": argmax is a hash of the context
        return hash(tuple(ctx)) % V

    prompt = [1, 2]
    chain = list(prompt)
    for _ in range(N):
        chain.append(target_next(chain))
    for trial in range(50):
        out = list(prompt)
        while len(out) < len(prompt) + N:
            k = int(torch.randint(0, 4, (1,), generator=g))
            # drafts: the right continuation, corrupted at random positions
            drafts, ctx = [], list(out)
            for _ in range(k):
                t = target_next(ctx)
                if torch.rand(1, generator=g).item() < 0.3:
                    t = int(torch.randint(0, V, (1,), generator=g))
                drafts.append(t)
                ctx.append(t)
            argmax = [target_next(out + drafts[:j]) for j in range(k + 1)]
            m, nxt = accept_greedy(argmax, drafts)
            out += drafts[:m] + [nxt]
        assert out[: len(chain)] == chain


# ---- accept_sampled on a fixed table -----------------------------------------------------------------
#
# A context-free toy model: the target's logits at output position t are TARGET[t], the draft's
# distribution is Q[t] (or, for a deterministic proposer, the draft token is DRAFT[t]). A stream of
# N tokens is generated the way the engine does it: draft up to min(K, remaining - 1) tokens, verify
# with accept_sampled, emit the accepted drafts plus the target's token, repeat. Losslessness means
# the N emitted tokens are independent with x_t ~ p_t exactly.

N_TOKENS, K_DRAFT = 3, 2


def simulate(target_logits, params, n_trials, seed, q=None, drafts_fixed=None, accept=accept_sampled):
    """Returns (streams, first_step): the emitted N-token streams, and per trial the number of drafts
    accepted in the first verification."""
    req = Request(prompt_ids=[1], params=params)
    req.generator.manual_seed(seed)
    streams, first_step = [], []
    for _ in range(n_trials):
        out: list[int] = []
        m0 = None
        while len(out) < N_TOKENS:
            t = len(out)
            k = min(K_DRAFT, N_TOKENS - t - 1)
            if q is not None:
                qk = q[t:t + k]
                drafts = [sample(qk[j], req.generator) for j in range(k)]
            else:
                qk = None
                drafts = drafts_fixed[t:t + k]
            m, nxt = accept(target_logits[t:t + k + 1], drafts, qk, req)
            if m0 is None:
                m0 = m
            out += drafts[:m] + [nxt]
        streams.append(tuple(out[:N_TOKENS]))
        first_step.append(m0)
    return streams, first_step


def marginal_probs(p: torch.Tensor, positions: tuple[int, ...]) -> dict:
    """Exact joint distribution of the tokens at `positions` under independent x_t ~ p[t]."""
    V = p.shape[-1]
    out = {}
    for combo in itertools.product(range(V), repeat=len(positions)):
        pr = 1.0
        for pos, tok in zip(positions, combo):
            pr *= float(p[pos, tok])
        out[combo] = pr
    return out


def fit(streams, p, positions):
    counts = Counter(tuple(s[i] for i in positions) for s in streams)
    return chi_square(counts, marginal_probs(p, positions))


def fits(streams, p):
    """p-values of the first token, the first two jointly, and all three jointly."""
    return {name: fit(streams, p, pos) for name, pos in
            (("x1", (0,)), ("x1,x2", (0, 1)), ("x1,x2,x3", (0, 1, 2)))}


def table(seed: int, rows: int, V: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


# Unseeded: rejection sampling, with each test's generator seeded by hand (a seed would make them keyed).
T1 = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
NEG = float("-inf")


def scenario(name: str):
    """(target logits [N, V], params, q [N, V] or None, fixed drafts or None)."""
    if name == "dense":  # full support on both sides, q far from p
        V = 6
        logits = table(10, N_TOKENS, V)
        q = torch.softmax(table(11, N_TOKENS, V), -1)
        return logits, T1, q, None
    if name == "disjoint":  # q = 0 where p > 0 and q > 0 where p = 0
        V = 6
        logits = table(20, N_TOKENS, V)
        logits[:, 4:] = NEG  # p = 0 on tokens 4, 5
        q_logits = table(21, N_TOKENS, V)
        q_logits[:, :2] = NEG  # q = 0 on tokens 0, 1: they are only reachable through the residual
        return logits, T1, torch.softmax(q_logits, -1), None
    if name == "q_equals_p":  # every draft must be accepted; the residual is never needed
        V = 6
        logits = table(30, N_TOKENS, V)
        return logits, T1, probs_from_logits(logits, T1), None
    if name == "filtered":  # temperature + top-k + top-p on both sides, V = 8; the filters leave
        V = 8               # p and q with different, partly overlapping supports
        logits = table(40, N_TOKENS, V)
        q = probs_from_logits(logits + table(41, N_TOKENS, V), FILTERED)
        return logits, FILTERED, q, None
    if name == "onehot":  # q=None: a deterministic proposer; the second draft has p(d) = 0
        V = 6
        logits = table(50, N_TOKENS, V)
        logits[1, 3] = NEG
        return logits, T1, None, [int(logits[0].argmax()), 3, 0]
    if name == "onehot_filtered":  # q=None; top-k filters out the second draft (p(d) = 0 after top-k)
        V = 8
        logits = table(60, N_TOKENS, V)
        return logits, FILTERED, None, [int(logits[0].argmax()), int(logits[1].argmin()), 2]
    raise ValueError(name)


SCENARIOS = ["dense", "disjoint", "q_equals_p", "filtered", "onehot", "onehot_filtered"]
N_TRIALS = 10_000  # per scenario; a wrong rule fails with far fewer (N_TRIALS_NEG)
N_TRIALS_NEG = 4_000


@pytest.mark.parametrize("name", SCENARIOS)
def test_accept_sampled_matches_target_distribution(name):
    logits, params, q, drafts = scenario(name)
    p = probs_from_logits(logits, params).double()
    with single_thread():
        streams, first_step = simulate(logits, params, N_TRIALS, seed=1234, q=q, drafts_fixed=drafts)
    results = fits(streams, p)
    for what, (pv, stat, df, bad) in results.items():
        print(f"{name} {what}: p={pv:.4g} chi2={stat:.1f} df={df}")
        assert bad == 0, f"{name}: {bad} emitted tokens have target probability 0 ({what})"
        assert pv > PASS_P, f"{name}: {what} does not follow the target (p={pv:.3g}, chi2={stat:.1f}, df={df})"

    # The token after an accepted first draft is a fresh draw from p_2, whatever the first token was.
    after_accept = Counter(s[1] for s, m in zip(streams, first_step) if m >= 1)
    if sum(after_accept.values()) >= 200:
        pv = chi_square(after_accept, {v: float(p[1, v]) for v in range(p.shape[-1])})[0]
        print(f"{name} x2 | d1 accepted: p={pv:.4g}")
        assert pv > PASS_P

    # The scenario really exercises rejection (or, for q = p, really never rejects).
    accepted = sum(m >= 1 for m in first_step) / len(first_step)
    if name == "q_equals_p":
        assert accepted == 1.0
    else:
        assert 0.0 < accepted < 1.0


def test_accept_sampled_is_deterministic_per_seed():
    logits, params, q, _ = scenario("dense")
    with single_thread():
        a = simulate(logits, params, 200, seed=5, q=q)
        b = simulate(logits, params, 200, seed=5, q=q)
        c = simulate(logits, params, 200, seed=6, q=q)
    assert a == b and a != c


def test_accept_sampled_first_token_exact_probability():
    """A direct check of P(first emitted token = x) = p_1(x) without sampling noise from the draft:
    enumerate every draft token d1 with weight q(d1) and integrate out the acceptance coin exactly."""
    logits, params, q, _ = scenario("disjoint")
    p = probs_from_logits(logits, params).double()
    qd = q.double()
    V = p.shape[-1]
    total = torch.zeros(V, dtype=torch.float64)
    for d in range(V):
        if qd[0, d] == 0:
            continue
        a = min(1.0, float(p[0, d] / qd[0, d]))
        residual = (p[0] - qd[0]).clamp_min(0)
        total[d] += qd[0, d] * a
        total += qd[0, d] * (1 - a) * residual / residual.sum()
    torch.testing.assert_close(total, p[0])
    # and the implementation's acceptance rate for d matches min(1, p/q)
    with single_thread():
        req = Request(prompt_ids=[1], params=params)
        req.generator.manual_seed(99)
        d = int(torch.nonzero((qd[0] > 0) & (p[0] > 0) & (p[0] < qd[0]))[0])
        n = 4000
        acc = sum(accept_sampled(logits[:2], [d], q[:1], req)[0] for _ in range(n)) / n
    expect = float(p[0, d] / qd[0, d])
    assert abs(acc - expect) < 4 * (expect * (1 - expect) / n) ** 0.5 + 1e-9


# ---- negative controls: the same checks reject wrong acceptance rules -------------------------------

def accept_always(logits, drafts, q, req):
    """WRONG: keep every draft; the output then follows q, not p."""
    k = len(drafts)
    p = probs_from_logits(logits[: k + 1], req.params)
    return k, sample(p[k], req.generator)


def resample_from_p(logits, drafts, q, req):
    """WRONG: the right acceptance test, but a rejection resamples from p instead of the residual."""
    k = len(drafts)
    p = probs_from_logits(logits[: k + 1], req.params)
    u = torch.rand(k, generator=req.generator).tolist()
    for j, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[j, d])
        if u[j] * q_d < float(p[j, d]):
            continue
        return j, sample(p[j], req.generator)
    return k, sample(p[k], req.generator)


def accept_on_ratio_without_residual_clamp(logits, drafts, q, req):
    """WRONG (subtly): accept with probability p/q but resample from the unclamped |p - q|."""
    k = len(drafts)
    p = probs_from_logits(logits[: k + 1], req.params)
    u = torch.rand(k, generator=req.generator).tolist()
    for j, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[j, d])
        if u[j] * q_d < float(p[j, d]):
            continue
        qj = torch.zeros_like(p[j]) if q is None else q[j]
        r = (p[j] - qj).abs()
        return j, sample(r / r.sum(), req.generator)
    return k, sample(p[k], req.generator)


@pytest.mark.slow  # negative controls of the checks themselves: CI runs them, the fast loop need not
@pytest.mark.parametrize("name, rule", [
    ("dense", accept_always),
    ("dense", resample_from_p),
    ("dense", accept_on_ratio_without_residual_clamp),
    ("disjoint", resample_from_p),
    ("filtered", resample_from_p),
    ("onehot", resample_from_p),
])
def test_wrong_rules_fail_the_same_check(name, rule):
    logits, params, q, drafts = scenario(name)
    p = probs_from_logits(logits, params).double()
    with single_thread():
        streams, _ = simulate(logits, params, N_TRIALS_NEG, seed=1234, q=q, drafts_fixed=drafts, accept=rule)
    results = fits(streams, p)
    for what, (pv, stat, df, bad) in results.items():
        print(f"{name}/{rule.__name__} {what}: p={pv:.4g} chi2={stat:.1f} df={df} impossible={bad}")
    # the first token alone already exposes the wrong rule
    assert results["x1"][0] < FAIL_P
    assert min(pv for pv, *_ in results.values()) < FAIL_P


# ---- end to end: the engine against the exact distribution of a tiny model ---------------------------

E2E_PROMPT = list(range(16)) + [3, 5, 3]  # every token occurs, so the n-gram proposer always drafts
E2E_VOCAB = 16
E2E_MAX_TOKENS = 4  # x1 from prefill (no speculation), then k = 2 drafts verify x2, x3 (+ bonus x4)
E2E_K = 2


@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory):
    from tiny_models import make_tiny_llama

    common = dict(vocab_size=E2E_VOCAB, init_std=0.2)
    target = make_tiny_llama(tmp_path_factory.mktemp("tv_target"), seed=0, layers=2, **common)
    draft = make_tiny_llama(tmp_path_factory.mktemp("tv_draft"), seed=1, layers=1, hidden=32, heads=2,
                            kv_heads=1, intermediate=64, **common)
    return target, draft


@pytest.fixture(scope="module")
def tiny_vocab_head(tmp_path_factory, tiny_vocab_models):
    """A random EAGLE-3 head for the tiny-vocabulary target, over 12 of its 16 tokens: its q is zero outside them."""
    from tiny_models import make_tiny_eagle3_head

    return make_tiny_eagle3_head(tmp_path_factory.mktemp("tv_head"), tiny_vocab_models[0], seed=2, draft_vocab=12)


@pytest.fixture(scope="module")
def exact_joint(tiny_vocab_models):
    """P(x1, x2, x3 | prompt) of the target, computed by transformers (an independent forward)."""
    from transformers import AutoModelForCausalLM

    target, _ = tiny_vocab_models
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    V = E2E_VOCAB

    def penalised(logits: torch.Tensor, ctx: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """logits [N, V] after each context ctx [N, L] (prompt + output): the penalties as transformers'
        RepetitionPenaltyLogitsProcessor and OpenAI's formula give them, written apart from the engine's."""
        if not params.penalized:
            return logits
        from transformers import RepetitionPenaltyLogitsProcessor

        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ctx, logits.float()).double()
        out = ctx[:, len(E2E_PROMPT):]
        counts = torch.stack([torch.bincount(row, minlength=V) for row in out]) if out.shape[1] else \
            torch.zeros_like(logits)
        return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)

    def masked(logits: torch.Tensor, position: int, allowed) -> torch.Tensor:
        """The position's tokens a guide allows, the others at -inf (after the penalties, as the engine does)."""
        if allowed is None:
            return logits
        keep = torch.zeros(V, dtype=torch.bool)
        keep[list(allowed[position])] = True
        return logits.masked_fill(~keep, float("-inf"))

    def joint(params: SamplingParams, allowed=None) -> dict:
        """allowed: per position, the token ids a guide allows there (None: no guide)."""
        with torch.no_grad():
            prompt = torch.tensor([E2E_PROMPT])
            p1 = probs_from_logits(masked(penalised(model(prompt).logits[:, -1].double(), prompt, params)[0], 0,
                                          allowed), params)  # [V]
            x1 = torch.arange(V)[:, None]
            ctx1 = torch.cat([prompt.expand(V, -1), x1], 1)
            p2 = probs_from_logits(masked(penalised(model(ctx1).logits[:, -1].double(), ctx1, params), 1, allowed),
                                   params)  # [V, V]
            pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))
            ctx2 = torch.cat([prompt.expand(V * V, -1), pairs], 1)
            p3 = probs_from_logits(masked(penalised(model(ctx2).logits[:, -1].double(), ctx2, params), 2, allowed),
                                   params).view(V, V, V)
        j = p1[:, None, None] * p2[:, :, None] * p3
        assert float(j.sum()) == pytest.approx(1.0, abs=1e-9)
        return {(a, b, c): float(j[a, b, c]) for a, b, c in itertools.product(range(V), repeat=3)}

    return joint


def run_engine(target, draft, params: SamplingParams, n_requests: int, batch: int, keyed: bool = False):
    """Each request sampled with speculation on: unseeded (rejection sampling, its generator seeded from a counter
    so the run replays) or, keyed, seeded 10_000 + i (sampling.sample_keyed)."""
    from unittest import mock

    from pipeline.engine.config import EngineConfig, GatePolicy
    from pipeline.engine.llm_engine import LLMEngine

    cfg = EngineConfig(max_batch_size=batch, max_seq_len=32, num_draft_tokens=E2E_K,
                       gate=GatePolicy(max_batch_size=batch, hysteresis=0, min_tokens=0))
    engine = LLMEngine.load(target, cfg, draft=draft)
    if params.guide is not None:
        from pipeline.models.tokenizer import load_tokenizer

        engine.tokenizer = load_tokenizer(target)
    streams = []
    with mock.patch("pipeline.engine.request.fresh_seed", itertools.count(10_000).__next__):
        for start in range(0, n_requests, batch):
            plist = [replace(params, max_tokens=E2E_MAX_TOKENS, seed=10_000 + start + i if keyed else None)
                     for i in range(batch)]
            reqs = engine.generate([E2E_PROMPT] * batch, plist, speculation="on")
            streams += [tuple(r.output_ids[:3]) for r in reqs]
    assert all(len(s) == 3 for s in streams)
    return streams, engine


def test_exact_joint_is_not_degenerate(exact_joint):
    joint = exact_joint(SamplingParams(temperature=1.0))
    p1 = Counter()
    for (a, _, _), pr in joint.items():
        p1[a] += pr
    assert max(p1.values()) < 0.6  # a real distribution over many tokens, not near one-hot
    assert sum(pr > 1e-3 for pr in p1.values()) >= 8


@pytest.mark.parametrize("draft_kind, params, keyed", [
    ("model", SamplingParams(temperature=1.0), False),
    # seeded: each token drawn by (seed, position), drafts kept where they equal it (speculative.accept_keyed); the
    # draws follow p one at a time (test_keyed_sampling.py), here jointly, through the engine
    pytest.param("model", SamplingParams(temperature=1.0), True, marks=pytest.mark.slow),
    ("ngram", SamplingParams(temperature=1.0), False),
    # an EAGLE-3 head behind n-gram lookup: after "3 5 3", x1 = 4 or 5 makes a 2-token match and the row drafts by
    # lookup (one-hot q); any other x1 drafts from the head's q. One verify holds both kinds of rows.
    pytest.param("eagle3", SamplingParams(temperature=1.0), False, marks=pytest.mark.slow),
    pytest.param("model", SamplingParams(temperature=0.8, top_k=8, top_p=0.9), False, marks=pytest.mark.slow),
    # every row of a verify penalised by the drafts before it, as plain decoding would have been
    pytest.param("model", SamplingParams(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.7,
                                         frequency_penalty=0.9), False, marks=pytest.mark.slow),
])  # 8192 requests each, 5-15 s: the fast loop keeps a draft model's and n-gram's; CI runs every case
def test_engine_sampling_matches_exact_target_distribution(tiny_vocab_models, tiny_vocab_head, exact_joint,
                                                           draft_kind, params, keyed):
    target, draft_folder = tiny_vocab_models
    draft = {"model": draft_folder, "ngram": "ngram", "eagle3": f"eagle3:{tiny_vocab_head}"}[draft_kind]
    n = 8192
    with single_thread():
        streams, engine = run_engine(target, draft, params, n_requests=n, batch=512, keyed=keyed)
    stats = engine.stats
    # speculation really happened, with both acceptances and rejections
    assert stats.drafted_tokens > n
    assert 0.0 < stats.acceptance_rate < 1.0
    if draft_kind == "eagle3":  # both sources drafted, in the same batches (about 500 lookup rows, 15000 head rows)
        assert min(engine.describe()["draft"]["ngram_first"].values()) > n // 100
    results = engine_fits(streams, exact_joint(params))
    print(f"{draft_kind} T={params.temperature} top_k={params.top_k} top_p={params.top_p}: "
          f"drafted={stats.drafted_tokens} acceptance={stats.acceptance_rate:.3f}")
    for what, (pv, stat, df, bad) in results.items():
        print(f"  {what}: p={pv:.4g} chi2={stat:.1f} df={df}")
        assert bad == 0, f"{what}: {bad} outputs have target probability 0"
        assert pv > PASS_P, f"{what}: engine output does not follow the target (p={pv:.3g})"


# The tiny vocabulary's 16 tokens are the byte-level characters '!' .. '0' (0x21 .. 0x30), in order: this regex
# allows ids 0-5 first, then 5-10, then 0-10 (and no end), so each position's mask is known without llguidance.
GUIDE_REGEX = "[!-&][&-+][!-+]+"
GUIDE_ALLOWED = (range(0, 6), range(5, 11), range(0, 11))


@pytest.mark.slow  # 8192 guided requests each, ~20 s
@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_engine_sampling_with_a_guide_matches_the_masked_target_distribution(tiny_vocab_models, exact_joint,
                                                                             draft_kind):
    """Guided sampling with speculation follows the target's distribution renormalized over what the guide allows
    at each position: drafts drawn from a masked q, verify rows masked by the state after the drafts before them,
    rejected drafts rolled back out of the grammar."""
    from pipeline.engine.guide import GuideSpec

    target, draft_folder = tiny_vocab_models
    params = SamplingParams(temperature=1.0, guide=GuideSpec("regex", GUIDE_REGEX))
    n = 8192
    with single_thread():
        streams, engine = run_engine(target, draft_folder if draft_kind == "model" else "ngram", params,
                                     n_requests=n, batch=512)
    stats = engine.stats
    assert stats.drafted_tokens > n and 0.0 < stats.acceptance_rate < 1.0
    assert all(s[0] in GUIDE_ALLOWED[0] and s[1] in GUIDE_ALLOWED[1] and s[2] in GUIDE_ALLOWED[2] for s in streams)
    results = engine_fits(streams, exact_joint(params, GUIDE_ALLOWED))
    for what, (pv, stat, df, bad) in results.items():
        print(f"  guided {draft_kind} {what}: p={pv:.4g} chi2={stat:.1f} df={df}")
        assert bad == 0, f"{what}: {bad} outputs have masked target probability 0"
        assert pv > PASS_P, f"{what}: guided output does not follow the masked target (p={pv:.3g})"


def engine_fits(streams, joint):
    results = {}
    for what, pos in (("x2", (1,)), ("x1,x2", (0, 1)), ("x2,x3", (1, 2)), ("x1,x2,x3", (0, 1, 2))):
        probs = Counter()
        for combo, pr in joint.items():
            probs[tuple(combo[i] for i in pos)] += pr
        counts = Counter(tuple(s[i] for i in pos) for s in streams)
        results[what] = chi_square(counts, dict(probs))
    return results


@pytest.mark.slow  # the end-to-end check's negative control
def test_engine_check_rejects_a_wrong_rule(tiny_vocab_models, exact_joint, monkeypatch):
    """Negative control for the end-to-end check: the engine with a wrong acceptance rule fails it."""
    import pipeline.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "accept_sampled", resample_from_p)
    target, draft = tiny_vocab_models
    params = SamplingParams(temperature=1.0)
    with single_thread():
        streams, _ = run_engine(target, draft, params, n_requests=4096, batch=512)
    results = engine_fits(streams, exact_joint(params))
    for what, (pv, stat, df, bad) in results.items():
        print(f"  wrong rule {what}: p={pv:.4g} chi2={stat:.1f} df={df}")
    assert results["x2"][0] < FAIL_P


@pytest.mark.identity
def test_engine_greedy_speculation_equals_target_greedy(tiny_vocab_models):
    """Greedy with a (poor) draft model or n-gram drafts emits exactly the target-only greedy chain."""
    from pipeline.engine.config import EngineConfig, GatePolicy
    from pipeline.engine.llm_engine import LLMEngine

    target, draft = tiny_vocab_models
    prompts = [E2E_PROMPT, [1, 2, 3], [7], [0, 0, 0, 0], [9, 4, 9, 4, 9, 4]]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    cfg = EngineConfig(max_batch_size=8, max_seq_len=32, num_draft_tokens=3, gate=GatePolicy(min_tokens=0))
    with single_thread():
        ref = [r.output_ids for r in LLMEngine.load(target, cfg).generate(prompts, params)]
        for d in (draft, "ngram"):
            engine = LLMEngine.load(target, cfg, draft=d)
            out = [r.output_ids for r in engine.generate(prompts, params)]
            assert out == ref, d
            assert engine.stats.drafted_tokens > 0
    # and the reference is the argmax chain of an independent forward
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ref):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(len(got)):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids[len(prompt):] == got
