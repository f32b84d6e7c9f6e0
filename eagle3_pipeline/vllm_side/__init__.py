"""How the project talks to vLLM's own environment (eagle3_vllm) for generation and states."""
