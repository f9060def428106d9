"""Tokenizer of a checkpoint folder: tokenizer.json (HF `tokenizers`) plus its chat template."""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import CorruptFileError, InputError, UnsupportedModelError


def _raise(message: str):
    raise TemplateError(message)


class Tokenizer:
    """encode / decode / apply_chat_template over a checkpoint's tokenizer files."""

    def __init__(self, path: Path):
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise UnsupportedModelError(f"{path} has no tokenizer.json; graft_tk needs a fast (tokenizers) "
                                        "tokenizer file next to config.json")
        try:
            self._tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust library raises plain Exception
            raise CorruptFileError(f"{tok_file} cannot be parsed ({e}); restore it") from e
        cfg_file = path / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        except (OSError, json.JSONDecodeError) as e:
            raise CorruptFileError(f"{cfg_file} cannot be read ({e}); restore it") from e
        if not isinstance(cfg, dict):
            raise CorruptFileError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not an object; restore it")
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        self.chat_template: str | None = template
        self._specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def differences(self, other: "Tokenizer") -> list[tuple[str, int, int | None]]:
        """Every token of this vocabulary (added and special tokens too) whose id in ``other`` is not
        its id here, as (token, id here, id there or None): empty when ``other`` holds this
        vocabulary, or extends it with ids after."""
        mine, theirs = self.vocab, other.vocab
        if mine.items() <= theirs.items():
            return []
        return [(t, i, theirs.get(t)) for t, i in sorted(mine.items(), key=lambda kv: kv[1]) if theirs.get(t) != i]

    @functools.cached_property
    def vocab(self) -> dict[str, int]:
        """token -> id, added and special tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self._specials["eos_token"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template (as transformers does)."""
        if self.chat_template is None:
            raise InputError("this model has no chat template; pass chat=False to use the prompt as is")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        context = {**self._specials, **kwargs}
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context)


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value
