"""Prompt lookup: the longest suffix n-gram's latest earlier match decides the proposal."""
from graft_tk.reference.prompt_lookup import prompt_lookup


def test_docstring_example():
    assert prompt_lookup([5, 6, 7, 9, 5, 6], max_ngram=3) == [7, 9, 5, 6]


def test_longest_ngram_wins_over_a_later_shorter_match():
    # Suffix [1 2 3]: the 3-gram occurs at 0 (then 8); the 1-gram [3] also occurs later, then 4.
    assert prompt_lookup([1, 2, 3, 8, 0, 3, 4, 1, 2, 3], max_ngram=3, max_tokens=2) == [8, 0]


def test_latest_match_wins_and_length_is_capped():
    assert prompt_lookup([7, 1, 7, 2, 7, 3, 7], max_ngram=1, max_tokens=1) == [3]
    assert prompt_lookup([7, 1, 2, 3, 4, 5, 7], max_ngram=1, max_tokens=3) == [1, 2, 3]


def test_no_match_and_tiny_inputs():
    assert prompt_lookup([1, 2, 3]) == []
    assert prompt_lookup([4]) == []
    assert prompt_lookup([4, 4]) == [4]
