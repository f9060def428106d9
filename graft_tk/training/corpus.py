"""Training text for draft heads, none of it from a benchmark set.

Three sources, each a list of token-id documents:

* ``stdlib_documents``: the source files of the Python standard library that runs this process
  (ships with every Python; code, like the HumanEval task the heads are measured on);
* ``distilled_documents``: the target's own greedy answers to prompts built from standard-library
  functions and methods (signature + docstring, "complete this function"), chat template applied:
  exactly the text a head sees when it drafts for this target (EAGLE trains on the target's own
  outputs too), generated in batches (``greedy_answers``);
* ``file_documents``: the user's files (``--data``): .jsonl rows with ``text`` or
  ``prompt`` + ``response``, anything else read as plain text.

``Corpus`` cuts documents into fixed-length windows and serves them in a seeded order that
depends only on the step number, so a resumed run sees exactly the batches it would have seen.
"""
from __future__ import annotations

import ast
import functools
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..batch import Batch
from ..bench.prompts import jsonl_rows
from ..engine import Engine
from ..errors import InputError
from ..models import Model

# Standard-library folders that are tests, GUI demos, generated tables or vendored data.
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
              "dist-packages", "encodings", "pydoc_data", "__pycache__", "__phello__"}
_MAX_FILE_BYTES = 200_000
INSTRUCTIONS = ("Complete this Python function.", "Implement the function below.",
                "Write the body of this Python function.")


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")
             and p.stat().st_size <= _MAX_FILE_BYTES]
    if not files:
        raise InputError(f"no standard-library sources under {root}; pass training text with --data")
    return sorted(files)


def stdlib_documents(model: Model, max_tokens: int, seed: int) -> list[list[int]]:
    """Whole standard-library files in a seeded order until ``max_tokens`` tokens are taken."""
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    docs, total = [], 0
    for path in files:
        if total >= max_tokens:
            break
        ids = model.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        ids = ids[:max_tokens - total]
        docs.append(ids)
        total += len(ids)
    return docs


def function_prompts(n: int, seed: int) -> list[str]:
    """``n`` "complete this function" prompts from the public standard-library functions and
    methods of public classes that have a docstring: signature + docstring, dedented."""
    candidates = list(_documented_functions())
    rng = random.Random(seed)
    rng.shuffle(candidates)
    return [f"{rng.choice(INSTRUCTIONS)}\n\n{c}\n" for c in candidates[:n]]


@functools.lru_cache(maxsize=1)
def _documented_functions() -> tuple[str, ...]:
    """Signature + docstring of every candidate, in file order (parsing the library takes ~3 s: once)."""
    candidates = []
    for path in stdlib_files():
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        for cls in tree.body:
            if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_"):
                functions += [node for node in cls.body if isinstance(node, ast.FunctionDef)]
        for node in functions:
            doc = ast.get_docstring(node)
            if node.name.startswith("_") or doc is None or not 40 <= len(doc) <= 800:
                continue
            header = "\n".join(lines[node.lineno - 1:node.body[0].end_lineno])
            candidates.append(textwrap.dedent(header))
    return tuple(candidates)


def distilled_documents(target: Model, n_prompts: int, max_new_tokens: int, seed: int,
                        progress: bool = True) -> list[list[int]]:
    """Chat-formatted function prompts followed by the target's own greedy answers."""
    from ..decode import encode_prompt

    prompts = [encode_prompt(target, text, chat=True) for text in function_prompts(n_prompts, seed)]
    answers = greedy_answers(target, prompts, max_new_tokens, progress=progress)
    return [ids + answer for ids, answer in zip(prompts, answers)]


def greedy_answers(target: Model, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 32,
                   progress: bool = True) -> list[list[int]]:
    """The target's greedy continuation of each prompt, up to and including its end-of-sequence token.

    Plain decoding of ``batch_size`` prompts at a time through the decode step (continuous
    batching: a prompt joins as soon as a row is free), the same tokens as ``decode(method="ar")``
    up to float rounding (batched matmuls sum in another order). A decode step on CPU is
    memory-bound: 32 rows cost about 5x one row's time.
    """
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    batch = Engine(target).batch(batch_size)
    answers: dict[int, list[int]] = {}
    index: dict[int, int] = {}
    pending = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))   # similar lengths together
    with tqdm(total=len(prompts), desc="distil", unit="prompt", disable=not progress) as bar:
        while pending or len(batch):
            while pending and not batch.full:
                i = pending.pop(0)
                request = batch.add(prompts[i], "ar", max_new_tokens)
                if request.done:
                    answers[i] = request.out
                    bar.update()
                else:
                    index[id(request)] = i
            for request in batch.step():
                answers[index.pop(id(request))] = request.out
                bar.update()
    return [answers[i] for i in range(len(prompts))]


def file_documents(paths: list[Path], model: Model) -> list[list[int]]:
    """Documents from the user's files: .jsonl rows (``text``, or ``prompt`` + ``response`` as a chat),
    other files as plain text."""
    from ..decode import encode_prompt

    docs = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise InputError(f"--data {path}: no such file")
        if path.suffix != ".jsonl":
            docs.append(model.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"),
                                               add_special_tokens=False))
            continue
        for lineno, row in jsonl_rows(path, "'text', or 'prompt' and 'response'"):
            if isinstance(row.get("text"), str):
                docs.append(model.tokenizer.encode(row["text"], add_special_tokens=False))
            elif isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
                ids = encode_prompt(model, row["prompt"], chat=True)
                docs.append(ids + model.tokenizer.encode(row["response"], add_special_tokens=False))
            else:
                raise InputError(f"{path}:{lineno}: each row needs a 'text' string, or 'prompt' and 'response'")
    return docs


@dataclass(frozen=True)
class Corpus:
    """Token windows of at most ``seq_len`` tokens (documents cut, never joined), padded."""
    tokens: Tensor    # int64 [W, seq_len], pad 0
    lengths: Tensor   # int64 [W]

    @classmethod
    def from_documents(cls, docs: list[list[int]], seq_len: int) -> Corpus:
        windows = [d[i:i + seq_len] for d in docs for i in range(0, len(d), seq_len)]
        windows = [w for w in windows if len(w) >= 3]   # a head entry needs (x_t, x_t+1) and a target
        if not windows:
            raise InputError("the training corpus is empty (every document is shorter than 3 tokens)")
        tokens = torch.zeros(len(windows), seq_len, dtype=torch.long)
        for i, w in enumerate(windows):
            tokens[i, :len(w)] = torch.tensor(w)
        return cls(tokens, torch.tensor([len(w) for w in windows]))

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def split(self, n_heldout: int, seed: int) -> tuple[Corpus, Corpus]:
        """(train, held-out) with ``n_heldout`` windows chosen by ``seed``. Every copy of a held-out
        window leaves the training set (documents repeated by ``distill_weight``, a file that occurs
        twice), so the held-out windows are unseen."""
        n = self.tokens.shape[0]
        if not 0 < n_heldout < n:
            raise InputError(f"the corpus has {n} windows; cannot hold out {n_heldout} for validation")
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        held = order[:n_heldout].sort().values
        windows = [tuple(row[:length]) for row, length in zip(self.tokens.tolist(), self.lengths.tolist())]
        held_out = {windows[i] for i in held.tolist()}
        train = torch.tensor([i for i in order[n_heldout:].sort().values.tolist() if windows[i] not in held_out])
        if train.numel() == 0:
            raise InputError(f"the corpus has {n} windows, all copies of the {n_heldout} held out for validation")
        return Corpus(self.tokens[train], self.lengths[train]), Corpus(self.tokens[held], self.lengths[held])

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
        """Batch ``step``: windows in a per-epoch seeded order -> (tokens [B, T], valid [B, T] bool),
        trimmed to the longest window in the batch."""
        n = self.tokens.shape[0]
        orders: dict[int, Tensor] = {}
        picks = []
        for i in range(step * batch_size, (step + 1) * batch_size):
            epoch, pos = divmod(i, n)
            if epoch not in orders:
                orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            picks.append(int(orders[epoch][pos]))
        return self.take(torch.tensor(picks))

    def take(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Windows ``idx`` -> (tokens [B, T], valid [B, T] bool), trimmed to the longest of them."""
        lengths = self.lengths[idx]
        T = int(lengths.max())
        return self.tokens[idx, :T], torch.arange(T)[None] < lengths[:, None]

    def token_counts(self, vocab_size: int) -> Tensor:
        """How often each token id occurs (pads excluded), int64 [vocab_size]."""
        valid = torch.arange(self.tokens.shape[1])[None] < self.lengths[:, None]
        return torch.bincount(self.tokens[valid], minlength=vocab_size)


def draft_vocab(counts: Tensor, size: int) -> Tensor:
    """EAGLE-3's reduced vocabulary: the ``size`` most frequent target ids (ties: lower id first),
    sorted -> ``d2t`` [size] with target id = draft id + d2t[draft id]."""
    if not 1 <= size <= counts.shape[0]:
        raise InputError(f"--draft-vocab must be in [1, {counts.shape[0]}] (the target's vocabulary), got {size}")
    # A stable sort on -count keeps ties in id order: the choice is deterministic.
    ids = torch.sort(-counts, stable=True).indices[:size].sort().values
    return ids - torch.arange(size)
