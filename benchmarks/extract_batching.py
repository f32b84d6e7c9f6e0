"""Extraction throughput: right-padded batches vs one sequence per forward, in one run.

  .venv/bin/python -m benchmarks.extract_batching [--arch deepseek_v3|llama] [--threads 1]

Prints verifier tokens (real, not padding) per second for each --max-batch-tokens setting and the ratio
to the batch-of-one baseline, on a tiny verifier made locally and the shipped conversations repeated.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import REPO
from eagle3_pipeline.data.conversations import normalize_messages, read_rows, tokenize_conversation
from eagle3_pipeline.data.extract import _forward_batched
from eagle3_pipeline.models.tiny import build_verifier
from eagle3_pipeline.models.verifier import AuxCapture, find_decoder_layers, load_verifier_model

DATA = REPO / "tests" / "data" / "conversations.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="deepseek_v3", choices=["deepseek_v3", "llama"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="copies of the 10 conversations")
    p.add_argument("--settings", type=int, nargs="+", default=[1, 2048, 8192])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = build_verifier(a.arch, Path(tmp) / "v")
        tok = AutoTokenizer.from_pretrained(str(path))
        model = load_verifier_model(path, torch.float32, trust_remote_code=False)
        capture = AuxCapture(find_decoder_layers(model, 8), [2, 4, 5])
        seqs = [
            tokenize_conversation(tok, normalize_messages(r.value)[1], 4096)[0]
            for r in read_rows(DATA, 0, 10)
        ] * a.repeat
        n_tokens = sum(map(len, seqs))
        _forward_batched(model, capture, seqs[:2], 1)  # warm-up
        base = None
        for setting in a.settings:
            t0 = time.perf_counter()
            _forward_batched(model, capture, seqs, setting)
            rate = n_tokens / (time.perf_counter() - t0)
            base = base or rate
            print(
                f"{a.arch} | threads {a.threads} | max_batch_tokens {setting:6d} | {len(seqs)} seqs, {n_tokens} tokens"
                f" | {rate:8.0f} tok/s | x{rate / base:.2f} vs batch of one"
            )


if __name__ == "__main__":
    main()
