"""What a prompt's chunk costs a decode step: B rows' verify and a chunk in two forwards, or in one.

    python -m bench.packed_step --model qwen2.5-coder-1.5b --dtype bf16 --rows 4 --nodes 1,4 --chunk 32,128

A batch of B rows decoding (``--context`` cached tokens each) and a prompt being read in the row
after theirs: the rows' verify (``--nodes`` per row, a chain) and the chunk's next tokens, as two
forwards (``Transformer.forward`` each) or as one packed forward (``Transformer.forward_packed``:
every linear layer reads its weight once for both). Median ms of ``--repeats`` of each, the two
alternating call by call so both see the same machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import graft_tk
from graft_tk.models.attention import AttentionPlan
from graft_tk.models.transformer import Part


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rows", type=int, default=4, help="B: rows decoding")
    p.add_argument("--nodes", default="1,4", help="comma list of nodes verified per row")
    p.add_argument("--chunk", default="32,128", help="comma list of prompt tokens read in the step")
    p.add_argument("--context", type=int, default=300, help="tokens cached in every row")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    model = graft_tk.load_model(args.model, dtype=args.dtype, progress=False)
    net, B, L, V = model.net, args.rows, args.context, model.config.vocab_size
    net.setup_cache(L + 512, batch_size=B + 1)
    gen = torch.Generator().manual_seed(0)
    print(f"{model.name} {args.dtype}, {torch.get_num_threads()} threads, {B} rows of {L} cached tokens")
    print("| nodes per row | chunk tokens | two forwards ms | one packed forward ms | saved |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for b in range(B + 1):
            with net.cache_rows(b, b + 1):
                net(torch.randint(0, V, (1, L), generator=gen), torch.arange(L), 0, logits_at=-1)
        for n in (int(x) for x in args.nodes.split(",")):
            for c in (int(x) for x in args.chunk.split(",")):
                tree = torch.randint(0, V, (B, n), generator=gen)
                prefix = torch.full((B,), L)
                block = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(B, -1, -1).contiguous()
                plan, positions = AttentionPlan.tree(prefix, block, L + n), prefix[:, None] + torch.arange(n)
                chunk = torch.randint(0, V, (1, c), generator=gen)

                def apart() -> None:
                    with net.cache_rows(0, B):
                        net(tree, positions, plan)
                    with net.cache_rows(B, B + 1):
                        net(chunk, torch.arange(L, L + c), L, logits_at=-1)

                def packed() -> None:
                    with net.cache_rows(0, B + 1):
                        net.forward_packed([Part(tree, positions, plan, (0, B)),
                                            Part(chunk, torch.arange(L, L + c)[None], AttentionPlan.causal(L, 1, c, "cpu"),
                                                 (B, B + 1), -1)])
                times: dict = {apart: [], packed: []}
                for _ in range(args.repeats + 1):
                    for fn in times:
                        t = time.perf_counter()
                        fn()
                        times[fn].append(time.perf_counter() - t)
                two, one = (statistics.median(times[f][1:]) * 1000 for f in (apart, packed))
                print(f"| {n} | {c} | {two:.0f} | {one:.0f} | {two - one:.0f} ms ({two / one:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
