"""Proposers: n-gram prompt lookup, and the draft model's cache bookkeeping."""

from pipeline.engine.proposers import NgramProposer


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    p = NgramProposer(max_ngram=3)
    # suffix [7, 8, 9] occurred at 0..2, followed by 1, 2, 3
    assert p.lookup([7, 8, 9, 1, 2, 3, 4, 7, 8, 9], k=3) == [1, 2, 3]
    # the most recent occurrence wins: [5] is followed by 6 at the start and by 9 later
    assert p.lookup([5, 6, 0, 5, 9, 5], k=1) == [9]


def test_ngram_falls_back_to_shorter_suffixes_and_returns_nothing_without_a_match():
    p = NgramProposer(max_ngram=3)
    assert p.lookup([4, 1, 2, 9, 9, 3, 4], k=2) == [1, 2]  # only the 1-gram [4] matches
    assert p.lookup([1, 2, 3], k=4) == []
    assert p.lookup([1], k=4) == []


def test_ngram_proposal_is_cut_at_k_and_at_the_end_of_the_sequence():
    p = NgramProposer()
    assert p.lookup([1, 2, 3, 4, 5, 1], k=2) == [2, 3]
    assert p.lookup([1, 2, 1], k=5) == [2, 1]
