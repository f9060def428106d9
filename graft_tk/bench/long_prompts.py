"""Long-context prompts that any machine can build offline: ``graft-bench --prompts long`` (or
``long@2k``, ``long@1k+4k``, ...).

Three kinds of work people send with a long context, at about 1k, 2k, 4k and 8k prompt tokens
(``CONTEXTS``), each with the answer length a user would ask for (``Prompt.max_new_tokens``):

* ``code-edit``: a real Python source (graft_tk's own modules, shipped with it) and an edit: rename
  a function everywhere and return the whole file (a rewrite as long as the file: the first 512
  tokens are timed), or return one function with a change.
* ``document``: the documentation of a Python standard-library module (``pydoc``, as the running
  Python renders it) and a question: quote what it says about one function, or summarise it.
* ``conversation``: a chat whose earlier turn holds a whole module, then a request about it.

Category names carry the context size (``code-edit@2k``), so every table reads by both. The
texts depend only on the graft_tk version and the Python version, and on nothing downloaded.
"""
from __future__ import annotations

import pydoc
import re
from dataclasses import dataclass
from pathlib import Path

from graft_tk.errors import InputError

CONTEXTS = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192}
CODE_CHARS_PER_TOKEN = 3.9    # graft_tk's Python source, Qwen2.5's tokenizer (measured: 3.65-4.13)
DOC_CHARS_PER_TOKEN = 4.2     # pydoc's indented plain text (measured: 3.5-4.6)
# Standard-library modules whose pydoc pages are the documents, largest first (each cut to size).
DOC_MODULES = ("calendar", "argparse", "statistics", "json", "shutil", "csv", "dataclasses", "functools",
               "textwrap", "fractions", "heapq")
PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LongPrompt:
    id: str
    category: str
    text: str                                      # the last user turn
    max_new_tokens: int
    history: tuple[tuple[str, str], ...] = ()      # earlier (role, content) turns


def long_prompts(contexts: str = "1k+2k+4k+8k") -> list[LongPrompt]:
    """The long set at the given context sizes (``+``-separated keys of ``CONTEXTS``)."""
    sizes = [c.strip() for c in contexts.split("+") if c.strip()]
    unknown = [c for c in sizes if c not in CONTEXTS]
    if unknown or not sizes:
        raise InputError(f"long prompts: unknown context size(s) {unknown or contexts!r}; choose from "
                         f"{', '.join(CONTEXTS)}, e.g. long@2k+4k")
    out = []
    for size in sizes:
        tokens = CONTEXTS[size]
        code, function = _source(int(tokens * CODE_CHARS_PER_TOKEN))
        module, doc, name = _document(int(tokens * DOC_CHARS_PER_TOKEN))
        block = f"```python\n{code}\n```"
        out += [
            LongPrompt(f"long/{size}/rename", f"code-edit@{size}",
                       f"{block}\n\nRename the function `{function}` to `{function}_v2` everywhere in this code "
                       "(its definition and every call) and return the complete updated code, nothing else.", 512),
            LongPrompt(f"long/{size}/function", f"code-edit@{size}",
                       f"{block}\n\nReturn the function `{function}` from this code with a one-line docstring "
                       "added at its top; keep every other line exactly as it is.", 256),
            LongPrompt(f"long/{size}/quote", f"document@{size}",
                       f"{doc}\n\nUsing only the documentation above, quote word for word what it says about "
                       f"`{name}`, then say in one sentence when to use it.", 192),
            LongPrompt(f"long/{size}/summary", f"document@{size}",
                       f"{doc}\n\nSummarise the documentation of `{module}` above in about 120 words, naming its "
                       "main classes and functions.", 192),
            LongPrompt(f"long/{size}/conversation", f"conversation@{size}",
                       f"Thanks. Now show me the function `{function}` again, with a comment above each of its "
                       "lines saying what the line does.", 256,
                       history=(("user", "Write the Python module we discussed."), ("assistant", block))),
        ]
    return out


def _source(chars: int) -> tuple[str, str]:
    """About ``chars`` characters of graft_tk's own source, whole modules in name order, and the
    name of a top-level function of the last one (the edit's subject)."""
    skip = {"bench", "autotune", "calibration"}        # tools; the last two are links in a checkout
    files = sorted(p for p in PACKAGE.rglob("*.py") if not skip & set(p.relative_to(PACKAGE).parts)
                   and re.search(r"^def [a-z_]", p.read_text(encoding="utf-8"), flags=re.M))
    files.sort(key=lambda p: abs(p.stat().st_size - chars))       # the closest single module first
    parts, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        if size and size + len(text) > chars:
            continue
        parts.append(f"# {path.relative_to(PACKAGE.parent).as_posix()}\n{text.rstrip()}")
        size += len(text)
        if size >= 0.8 * chars:
            break
    code = "\n\n".join(parts)
    functions = re.findall(r"^def ([a-z_][a-z0-9_]*)\(", parts[-1], flags=re.M)
    if not functions:
        raise InputError("long prompts: no top-level function in the chosen source (a packaging problem)")
    return code, functions[len(functions) // 2]


def _document(chars: int) -> tuple[str, str, str]:
    """(module, its pydoc page cut to about ``chars`` characters at a line's end, a function or class
    it documents): the module whose page is nearest in size, not smaller unless none is larger."""
    pages = {m: _page(m) for m in DOC_MODULES}
    larger = [m for m in DOC_MODULES if len(pages[m]) >= chars]
    module = min(larger, key=lambda m: len(pages[m])) if larger else max(DOC_MODULES, key=lambda m: len(pages[m]))
    page = pages[module]
    page = page[:max(page.rfind("\n", 0, chars), chars // 2)]
    names = re.findall(r"^ {4}(?:class )?([a-zA-Z][a-zA-Z0-9_]*)\(", page, flags=re.M)
    if not names:
        raise InputError(f"long prompts: pydoc's page of {module} documents no function here")
    return module, page, names[len(names) // 2]


def _page(module: str) -> str:
    """pydoc's plain-text page of a module, without the FILE section (a path on this machine)."""
    text = pydoc.render_doc(module, renderer=pydoc.plaintext)
    return re.sub(r"\nFILE\n(    .*\n)+", "\n", text).strip()
