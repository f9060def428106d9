"""graft_tk inside other engines.

``chain``: Graft's proposals as one chain per request, for verifiers that take a chain (engine-free,
tested in the main suite). ``vllm``: the proposer plugin for vLLM's CPU build (tested in its own
venv: ``tests_vllm/``).
"""
