"""graft-serve: an OpenAI-compatible server (completions, chat, streaming) over speculative decoding.

    graft-serve --model qwen2.5-coder-1.5b --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "qwen2.5-coder-1.5b", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}'

Up to --max-batch requests decode together (first come first served, continuous batching), with
one engine whose adjacency matrix (retrieval's source) stays warm across requests; a prompt that
arrives while others decode is read a chunk a step, in the forward of their verify
(--prefill-chunk, --prefill-seconds); up to --max-queue wait, more get 429. Each finished request
logs one line. SIGTERM (or Ctrl-C) stops accepting, lets requests in flight finish for --grace
seconds, then cancels the rest: their clients get a 503 error (a stream as its last event) and
the server exits 0. GET /metrics (Prometheus text): requests and tokens, time to first token and
inter-token latency histograms, accepted tokens by source, steps by batch size, the nodes they
verified per request (1: no speculation) and whether they carried a prompt's chunk.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

from ._models import add_quant_args, at_least, default_drafter, drafter_quant, load_drafter
from ..compiled import Compile
from ..methods import METHODS
from ..decode import resolve_config
from ..runtime import check_drafter
from ..errors import GraftError, InputError
from ..models import load_model
from ..server.scheduler import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SECONDS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graft-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b",
                   help="target: built-in name, checkpoint folder, .gguf file or cached HF repo id "
                        "(default: %(default)s)")
    p.add_argument("--drafter", default=None,
                   help="a model name or path, self:L (the target's first L layers) or none "
                        "(default: the registry's pair for --model)")
    p.add_argument("--eagle3", default=None, metavar="PATH", help="draft with this EAGLE-3 head folder")
    p.add_argument("--method", default=None, choices=list(METHODS),
                   help="default: graft when a drafter is known for --model, else retrieval+pld")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default bf16)")
    add_quant_args(p)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="default: %(default)s (loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    p.add_argument("--max-queue", type=at_least(1), default=64, help="requests waiting at most; more get 429 (default: %(default)s)")
    p.add_argument("--max-batch", type=at_least(1), default=DEFAULT_MAX_BATCH,
                   help="requests decoded together, one target forward per step for all (continuous batching), "
                        "each batch size speculating only as far as the device's measured costs say it pays; 1 "
                        "decodes one at a time (default: %(default)s: on a 2-core CPU four requests together "
                        "served 2.4x the tokens/s of one at a time)")
    p.add_argument("--max-model-len", type=at_least(2), default=None, metavar="TOKENS",
                   help="most tokens of one request, prompt + answer: the KV caches are one pool of --max-batch rows "
                        "of this many tokens, allocated at start-up and never grown; longer requests get a 400 "
                        "(default: the model's context, at most 4096)")
    p.add_argument("--prefill-chunk", type=at_least(1), default=DEFAULT_PREFILL_CHUNK, metavar="TOKENS",
                   help="a prompt arriving while other requests decode is read this many tokens per step, in the "
                        "same target forward as their verify, so their streams keep going while it is read; its "
                        "drafter reads between two steps, not in one (default: %(default)s)")
    p.add_argument("--prefill-seconds", type=at_least(0, float), default=DEFAULT_PREFILL_SECONDS, metavar="S",
                   help="... and fewer where the server's last steps carrying a chunk say such a step would take "
                        "longer than S seconds, the longest the streams decoding wait while a prompt is read; 0: "
                        "no bound but --prefill-chunk (default: %(default)s)")
    p.add_argument("--policy-hold", type=at_least(0), default=8, metavar="STEPS",
                   help="a batch plans its N, tau and D for the most requests of the last STEPS steps, so the "
                        "gap between a client's requests does not switch the policy (default: %(default)s)")
    p.add_argument("--compile", nargs="?", const=Compile.ON, default=Compile.OFF, type=Compile,
                   choices=list(Compile),
                   help="run the step forwards compiled (torch.compile), compiled at start-up before the port "
                        "opens (minutes on a CPU; inductor caches them for the next start); 'drafter': only the "
                        "drafter model's. On a CPU measure it first: docs/roofline.md (default: %(default)s)")
    p.add_argument("--exact", action="store_true",
                   help="every row of the target's forwards computed as it is alone: a request's output (greedy, "
                        "or sampled with its seed) is the same alone or beside others, and equals --method ar "
                        "--exact's (CPU, eager; costs time: docs/exactness.md)")
    p.add_argument("--grace", type=at_least(0, float), default=30.0,
                   help="seconds requests in flight may finish after SIGTERM (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("graft_tk.server").setLevel(logging.INFO)     # one line per request
    try:
        import uvicorn  # noqa: F401 - the [serve] extra, checked before the models load

        from ..server.app import create_app, http_server
        from ..server.metrics import Metrics
        from ..server.scheduler import Scheduler, batching_config
    except ImportError as e:
        print(f"graft-serve: error: {e.name} is missing: pip install 'graft-tk[serve]'", file=sys.stderr)
        return 2
    try:
        if not 0 <= args.port < 65536:
            raise InputError(f"--port must be in [0, 65535], got {args.port}")
        spec = f"eagle3:{args.eagle3}" if args.eagle3 else (args.drafter or default_drafter(args.model))
        method = args.method or ("graft" if spec not in (None, "none") else "retrieval+pld")
        target = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
        drafter = (load_drafter(spec, target, args.model, dtype=args.dtype, device=args.device,
                                quant=drafter_quant(args, target)) if METHODS[method].drafts else None)
        if METHODS[method].drafts and drafter is None:
            raise InputError(f"--method {method} needs a drafter: pass --drafter NAME or self:L")
        check_drafter(target, drafter)
        config, source = resolve_config(target, drafter, METHODS[method], None)
    except GraftError as e:
        print(f"graft-serve: error: {e}", file=sys.stderr)
        return 2
    policy = {}
    if args.max_batch > 1 and METHODS[method].speculates:
        from ..profiles import batch_policy
        policy = batch_policy(target, drafter, args.max_batch)
        config = batching_config(target, drafter, method, config, args.max_batch)
    plan = ", ".join(f"from {b}: N={c.budget} tau={c.tau:.3g} D={c.max_depth}" for b, c in policy.items())
    try:
        scheduler = Scheduler(target, drafter, method, config, args.max_queue, Metrics(), args.max_batch, policy,
                              hold=args.policy_hold, max_model_len=args.max_model_len, compile=args.compile,
                              prefill_chunk=args.prefill_chunk, prefill_seconds=args.prefill_seconds or None,
                              exact=args.exact)
    except GraftError as e:   # e.g. a batch of an EAGLE-3 head's requests
        print(f"graft-serve: error: {e}", file=sys.stderr)
        return 2
    if args.compile is not Compile.OFF:
        log = logging.getLogger("graft_tk.server")
        if args.max_batch > 1:
            log.warning("--compile with --max-batch %d: the warm-up compiles batches of 1, 2 and %d, but other "
                        "shapes of a batch (its size, the tokens each row drafts) can still compile while serving, "
                        "seconds to minutes each on a CPU (docs/roofline.md)", args.max_batch, args.max_batch)
        log.info("compiling %s step forwards before serving (minutes on a CPU the first time; inductor's cache "
                 "keeps them for the next start) ...", "the drafter's" if args.compile is Compile.DRAFTER else "every")
        try:
            log.info("compiled in %.0f s", scheduler.warm_up())
        except Exception as e:  # noqa: BLE001 - torch's compile errors have no common base
            print(f"graft-serve: error: compiling the step forwards failed ({type(e).__name__}: {e}); "
                  "serve without --compile", file=sys.stderr)
            return 2
    name = args.served_model_name or args.model
    app = create_app(scheduler, name)
    server = http_server(app, scheduler, args.grace)
    try:
        sock = socket.create_server((args.host, args.port))     # bound here: --port 0 tells its port below
    except OSError as e:
        print(f"graft-serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    logging.getLogger("graft_tk.server").info(
        "serving %s (%s, %s weights, config: %s, compile: %s%s, batches of up to %d%s, %d tokens per request) at "
        "http://%s:%d/v1", name, method, target.quant, source, args.compile, ", exact" if args.exact else "",
        args.max_batch,
        f"; by batch size {plan}" if plan else "", scheduler.max_model_len, host, port)
    # uvicorn handles SIGTERM / SIGINT while it runs and raises them again after its shutdown; these
    # handlers take that second delivery, so the process ends with the cleanup below and status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    scheduler.start()
    try:
        server.run(sockets=[sock])   # returns after SIGTERM / Ctrl-C, once open requests end or --grace passed
    finally:
        scheduler.shutdown(grace=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
