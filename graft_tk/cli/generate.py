"""graft-generate: decode one prompt and stream the text, then print one line of statistics.

By default it runs ``graft`` with the drafter that pairs with the model in the registry (the
calibrated profile of the pair when graft-calibrate wrote one); a model with no paired drafter
runs ``retrieval+pld``, which needs none."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from tqdm import tqdm

from ._models import add_quant_args, at_least, default_drafter, drafter_quant, load_drafter
from ..compiled import Compile
from ..config import GraftConfig
from ..methods import METHODS
from ..decode import decode
from ..errors import GraftError
from ..models import load_model, registry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graft-generate", description=__doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b",
                   help="target: built-in name, checkpoint folder, .gguf file or cached HF repo id "
                        "(default: %(default)s)")
    p.add_argument("--drafter", default=None,
                   help="drafter for the drafting methods: a model name or path, or self:L (the target's first L "
                        "layers); not loaded otherwise (default: the registry's pair for --model, e.g. "
                        "qwen2.5-coder-0.5b for the 1.5B)")
    p.add_argument("--eagle3", default=None, metavar="PATH",
                   help="draft with this EAGLE-3 head folder instead of --drafter (graft-train-eagle3 --out)")
    p.add_argument("--prompt", help="the prompt; read from stdin when omitted")
    p.add_argument("--method", default=None, choices=list(METHODS),
                   help="default: graft when a drafter is known for --model, else retrieval+pld")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--budget", type=int, default=None, help="N: tree nodes verified per step (GraftConfig)")
    p.add_argument("--tau", type=float, default=None, help="pruning threshold on drafter path probability")
    p.add_argument("--top-k", type=int, default=None, help="K: children per drafted node")
    p.add_argument("--max-depth", type=int, default=None, help="D: drafter expansions per step at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default bf16)")
    add_quant_args(p)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--compile", nargs="?", const=Compile.ON, default=Compile.OFF, type=Compile,
                   choices=list(Compile),
                   help="run the step forwards compiled (torch.compile; the first call compiles, minutes on a "
                        "CPU); 'drafter': only the drafter model's")
    p.add_argument("--exact", action="store_true",
                   help="every row of the target's forwards computed as it is alone, so each method's output equals "
                        "--method ar --exact's in bf16 too (CPU, eager; costs time: docs/exactness.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object (tokens, text, stats) instead")
    p.add_argument("--verify-cache", action="store_true",
                   help="hash the converted folders of --model and its drafter (every quantization) against the "
                        "sha256 each file had when converted, print what is damaged, and exit: 0 when intact")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.verify_cache:
        return verify_cache([args.model, args.drafter or default_drafter(args.model)])
    if args.prompt is None and sys.stdin.isatty():
        print("graft-generate: reading the prompt from the terminal; end it with Ctrl-D (or pass --prompt TEXT)",
              file=sys.stderr)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        spec = f"eagle3:{args.eagle3}" if args.eagle3 else (args.drafter or default_drafter(args.model))
        if args.method is None:
            args.method = "graft" if spec is not None else "retrieval+pld"
            if spec is None:
                print(f"graft-generate: no drafter pairs with {args.model}; running retrieval+pld (pass --drafter "
                      "NAME or self:L for graft)", file=sys.stderr)
        target = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
        drafter = (load_drafter(spec, target, args.model, dtype=args.dtype, device=args.device,
                           quant=drafter_quant(args, target))
                   if METHODS[args.method].drafts else None)
        overrides = {k: v for k, v in (("budget", args.budget), ("tau", args.tau), ("top_k", args.top_k),
                                       ("max_depth", args.max_depth)) if v is not None}
        # No flags: decode picks this pair's graft-calibrate profile, or the defaults.
        config = GraftConfig(**overrides) if overrides else None
        streamer = None if args.json else _Streamer(target.tokenizer)
        result = decode(target, prompt, drafter=drafter, method=args.method, config=config,
                        max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed, chat=not args.no_chat,
                        on_tokens=streamer, on_prefill=_PrefillBar(), compile=args.compile,
                        exact=args.exact)
    except GraftError as e:
        print(f"graft-generate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": target.name, "tokens": result.tokens, "text": result.text,
                          "stats": result.stats}, indent=1))
        return 0
    print()
    print(summary_line(result.stats), file=sys.stderr)
    return 0


def verify_cache(names: list[str | None]) -> int:
    """``--verify-cache``: every converted folder of these models under GRAFT_TK_HOME, hashed."""
    root = registry.converted_dir("")
    folders = sorted(f for f in (root.iterdir() if root.is_dir() else ()) if f.is_dir() and any(
        n and (f.name == n or f.name.startswith(n + "-")) for n in names))
    if not folders:
        print(f"graft-generate: no converted folder of {', '.join(n for n in names if n)} under {root}; "
              "nothing to verify (the first load converts it)", file=sys.stderr)
        return 0
    bad = 0
    for folder in folders:
        problems = registry.verify_stamp(folder, progress=True)
        print(f"{folder}: " + ("intact" if not problems else "DAMAGED\n  " + "\n  ".join(problems)), file=sys.stderr)
        bad += bool(problems)
    if bad:
        print("graft-generate: delete the damaged folder(s); the next load converts them again", file=sys.stderr)
    return 2 if bad else 0


def summary_line(s: dict) -> str:
    """One line a newcomer understands: speed, tokens per target forward, where accepted tokens came from."""
    line = f"[{s['method']}] {s['tokens']} tokens in {s['seconds']:.2f} s = {s['tokens_per_s']:.2f} tokens/s"
    if s["method"] == "ar":
        return line + " (plain decoding: one target forward per token)"
    steps = max(s["steps"], 1)
    by_source = ", ".join(f"{name.replace('_', ' ')} {n / steps:.2f}" for name, n in
                          sorted(s["accepted_by_source"].items(), key=lambda kv: -kv[1])) or "none"
    return (f"{line}; {s['mat']:.2f} tokens per target forward over {s['steps']} steps; accepted per step: "
            f"{by_source} (+1 from the target itself); config: {s['config_source']}")


class _PrefillBar:
    """A progress bar on stderr while the target reads a prompt of more than one chunk (a terminal only)."""

    def __init__(self):
        self.bar = None

    def __call__(self, read: int, total: int) -> None:
        if self.bar is None:
            if read == total:       # one chunk: nothing to wait for
                return
            self.bar = tqdm(total=total, desc="reading the prompt", unit="tok", leave=False, disable=None)
        self.bar.update(read - self.bar.n)
        if read == total:
            self.bar.close()


class _Streamer:
    """Print text as tokens arrive; decoding the whole tail keeps multi-byte characters intact."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text


if __name__ == "__main__":
    sys.exit(main())
