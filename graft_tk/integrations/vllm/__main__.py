"""``python -m graft_tk.integrations.vllm path NAME``: the Hugging Face style folder of a graft_tk
model (fetched and converted once), which vLLM loads as it is."""
from __future__ import annotations

import argparse

from ...models import resolve


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m graft_tk.integrations.vllm",
                                     description="Helpers for serving graft_tk's models with vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    path = sub.add_parser("path", help="print the checkpoint folder of a model (a built-in name, a folder, a .gguf)")
    path.add_argument("model")
    args = parser.parse_args(argv)
    print(resolve(args.model)[1])


if __name__ == "__main__":
    main()
