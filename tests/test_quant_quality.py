"""bench/quant_quality.py's judge: the code block it takes from an answer and the verdict of
HumanEval's own tests on it (the pass@1 of each weight format rests on these)."""
import sys
from pathlib import Path

import pytest

from graft_tk.bench.prompts import humaneval_problems

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def qq(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    sys.modules.pop("quant_quality", None)
    import quant_quality
    return quant_quality


def test_the_first_code_block_is_the_completion(qq):
    answer = "Here it is:\n```python\ndef f():\n    return 1\n```\nThen\n```\nmore\n```"
    assert qq.extract_code(answer) == "def f():\n    return 1\n"
    assert qq.block_closed(answer) and not qq.block_closed("```python\ndef f():\n")
    assert qq.extract_code("    return 1\n") == "    return 1\n"       # no block: the answer as it is


def test_humaneval_tests_judge_a_body_a_whole_function_a_wrong_one_and_a_hang(qq):
    problem = humaneval_problems()[0]            # has_close_elements
    assert qq.passes(problem, problem["canonical_solution"])             # a bare body completes the stub
    whole = ("from typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
             "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n")
    assert qq.passes(problem, whole)                                      # a complete function replaces it
    assert not qq.passes(problem, "    return False\n")
    assert not qq.passes(problem, "    while True:\n        pass\n", timeout=2.0)
