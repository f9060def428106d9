"""graft-serve: an OpenAI-compatible HTTP server over graft_tk's decoding.

    protocol.py   request bodies checked into a Request; OpenAI error bodies
    scheduler.py  a bounded job queue and the decode thread (one Engine: the adjacency matrix stays warm)
    metrics.py    counters and the Prometheus text format
    app.py        the routes (Starlette, run by uvicorn): completions, chat, models, health, metrics

Start it with ``graft-serve`` (graft_tk/cli/serve.py).
"""
