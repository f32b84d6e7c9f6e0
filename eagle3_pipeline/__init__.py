"""EAGLE-3 draft-head pipeline for Kimi-K2.5, served by vLLM.

The numbered stage scripts at the repository root are thin: they parse flags, resolve the config and
call one module here. Importing this package is cheap (no torch); modules import what they need.

The package is grouped by concern, in layers: a module imports from its own group and the groups before
it in LAYERS, never from a later one (tests/test_layout.py holds every module to it).
"""

__version__ = "0.1.0"

LAYERS = (
    "core",  # errors, output folders (storage), the settings machinery, the run's layout (stage order, folders)
    "models",  # the verifier, the draft spec, the draft as vLLM reads it, vLLM's acceptance rule
    "vllm_side",  # vLLM's own environment: its worker, the client that runs it, the CPU plugin
    "data",  # stages 00-03: conversations -> samples -> shards, vocabulary mapping, split
    "training",  # stage 04: the TTT trainer, checkpoints, DDP, kernels, online states, plots
    "export_eval",  # stages 05-06: the vLLM export behind its gate, acceptance measured
    "sizing",  # --plan: disk, memory, KV cache, co-location
)
