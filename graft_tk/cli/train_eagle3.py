"""graft-train-eagle3: train an EAGLE-3 draft head for a target on this machine.

The head is written to --out in the EAGLE / SpecForge layout (config.json + model.safetensors),
so ``--eagle3 OUT`` (graft-generate, graft-bench, graft-calibrate) and ``load_eagle3`` read it;
the folder also holds the resumable trainer state and training.png. Run the same command again to
resume an interrupted run, or with a larger --steps to train on.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from ..errors import GraftError
from ._models import add_quant_args
from ..models import load_model
from ..training.eagle3 import TrainConfig, train

_DEFAULTS = TrainConfig()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graft-train-eagle3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target: built-in name, checkpoint folder, .gguf or HF repo id")
    p.add_argument("--out", required=True, help="the run's folder (created; resumed when it holds a run)")
    p.add_argument("--data", nargs="*", default=[],
                   help="extra training files: .jsonl rows with 'text' or 'prompt' + 'response', other files as "
                        "plain text (default: the Python standard library's sources and the target's own answers "
                        "to prompts built from its functions; never benchmark text)")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="start from this head's weights and draft vocabulary (fine-tune a trained or published head)")
    p.add_argument("--steps", type=int, default=_DEFAULTS.steps)
    p.add_argument("--draft-vocab", type=int, default=_DEFAULTS.draft_vocab,
                   help="reduced draft vocabulary: the most frequent target tokens of the corpus "
                        "(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size)
    p.add_argument("--seq-len", type=int, default=_DEFAULTS.seq_len)
    p.add_argument("--lr", type=float, default=_DEFAULTS.lr)
    p.add_argument("--ttt-depth", type=int, default=_DEFAULTS.ttt_depth,
                   help="drafting steps unrolled in training (EAGLE-3's training-time test; default %(default)s)")
    p.add_argument("--stdlib-tokens", type=int, default=_DEFAULTS.stdlib_tokens,
                   help="tokens of standard-library source to train on (0 = none; default %(default)s)")
    p.add_argument("--distill-prompts", type=int, default=_DEFAULTS.distill_prompts,
                   help="target-generated answers to include (0 = none; default %(default)s)")
    p.add_argument("--distill-tokens", type=int, default=_DEFAULTS.distill_tokens)
    p.add_argument("--distill-weight", type=int, default=_DEFAULTS.distill_weight,
                   help="times each answer is seen per epoch (default %(default)s)")
    p.add_argument("--save-every", type=int, default=_DEFAULTS.save_every)
    p.add_argument("--fp32", action="store_true", help="train the head in fp32 (default: bf16 autocast)")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--restart", action="store_true", help="overwrite a run already in --out")
    p.add_argument("--dtype", default=None, help="the target's dtype: fp32 | bf16 | fp16 (default bf16)")
    add_quant_args(p, drafter=False)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    try:
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                          ttt_depth=args.ttt_depth, draft_vocab=args.draft_vocab, stdlib_tokens=args.stdlib_tokens,
                          distill_prompts=args.distill_prompts, distill_tokens=args.distill_tokens,
                          distill_weight=args.distill_weight, data=tuple(args.data), init=args.init, seed=args.seed,
                          save_every=args.save_every, mixed_precision=not args.fp32)
        target = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
        t0 = time.perf_counter()
        result = train(target, args.out, cfg, restart=args.restart, progress=not args.quiet)
    except GraftError as e:
        print(f"graft-train-eagle3: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"graft-train-eagle3: interrupted; the run is saved in {args.out}: run the same command to resume",
              file=sys.stderr)
        return 130
    acc = ", ".join(f"{a:.2f}" for a in result["accuracy"])
    print(f"head saved to {args.out} ({(time.perf_counter() - t0) / 60:.1f} min); held-out loss "
          f"{result['loss']:.3f}, top-1 agreement with the target per draft step: {acc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
