"""The vLLM side of the pipeline: a worker run inside vLLM's own environment (`python -m eagle3_vllm`),
importing only the standard library and vLLM (the pipeline's dependencies are not installed there).
`protocol` is how the pipeline talks to it and is imported from both environments; `cpu` holds every
setting only vLLM's CPU build needs; `worker` serves requests (a session on stdin/stdout, or a server).
"""
