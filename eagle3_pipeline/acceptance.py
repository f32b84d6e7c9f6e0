"""Greedy chain speculative decoding, simulated on an exported draft exactly as vLLM runs it.

Per prompt: the verifier's greedy continuation S (what any lossless speculation must output) and its
aux states at the ids the export's config names. A round starts with n known tokens, hidden states for
positions 0..n-2 and the last token just emitted: the draft's first pass over slots 0..n-2 proposes d1
from slot n-2, then k-1 chain steps feed the previous pre-norm output back with the previous draft token
at the next position. The verifier accepts the longest prefix of d1..dk equal to S[n..], then emits one
token itself, so the next round starts at n + accepted + 1. Counters follow vLLM's
(vllm:spec_decode_num_drafts, _num_accepted_tokens, _num_accepted_tokens_per_pos); mean acceptance
length = 1 + accepted / drafts.

A first-pass slot depends only on earlier slots (causal), so one first pass over the whole sequence
serves every round: round n uses its slots 0..n-2 and a cache truncated to them. That is what vLLM's
draft cache holds too: its first pass of each round rewrites the slots of the tokens just verified
(`llm_base_proposer.py`, padded or not), and a chain step reads only slots it or an earlier step of the
same round wrote.

The end of a request: vLLM 0.32's scheduler clamps the spec tokens of a step only at max_model_len, not
at max_tokens, so the last round verifies all k drafts and its counters include acceptances past
max_tokens that the output then drops (`scheduler.py`: num_accepted = sampled - 1 before the stop
check). The simulation therefore ends the request after `max_new_tokens` but compares the last drafts
with a trace that runs k - 1 tokens further (`trace_length`). Stopping the comparison at the end instead
made the simulation low at the deeper positions, by more the better the draft (issue 9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_pipeline.reference_draft import ReferenceDraft


@dataclass
class AcceptanceCounts:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_pos)

    def summary(self) -> dict[str, Any]:
        d = max(self.num_drafts, 1)
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": self.accepted_per_pos,
            "acceptance_rate_per_pos": [a / d for a in self.accepted_per_pos],
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / d,
        }


def trace_length(max_new_tokens: int, k: int) -> int:
    """Greedy tokens a trace needs for a request of `max_new_tokens` at k drafts per step: the last
    round starts with at most max_new_tokens - 1 emitted and vLLM verifies all k of its drafts."""
    return max_new_tokens + k - 1


def simulate_sequence(
    draft: ReferenceDraft,
    aux: torch.Tensor,
    seq: torch.Tensor,
    prompt_len: int,
    k: int,
    counts: AcceptanceCounts,
    max_new_tokens: int | None = None,
) -> None:
    """Count the drafts and acceptances of one prompt. aux: [len(seq), n_aux*H]; seq = prompt + greedy.

    The request ends after `max_new_tokens` tokens (default: all of seq); seq should run
    `trace_length(max_new_tokens, k)` tokens past the prompt so the last round is verified as in vLLM.
    """
    total = seq.numel()
    end = total if max_new_tokens is None else min(total, prompt_len + max_new_tokens)
    positions = torch.arange(total - 1)
    out0, logits0, cache = draft.first_pass(aux[: total - 1], seq[1:], positions)
    n = prompt_len + 1  # the verifier's prefill emitted seq[prompt_len]
    while n < end:
        proposals = [int(draft.to_target(logits0[n - 2].argmax()[None])[0])]
        g, c = out0[n - 2 : n - 1], cache.truncate(n - 1)
        for j in range(1, k):
            token = torch.tensor([proposals[-1]])
            g, lg, c = draft.step(g, token, torch.tensor([n - 2 + j]), c)
            proposals.append(int(draft.to_target(lg[0].argmax()[None])[0]))
        accepted = 0
        for j, tok in enumerate(proposals):
            if n + j >= total or tok != int(seq[n + j]):
                break
            accepted += 1
        counts.num_drafts += 1
        counts.num_draft_tokens += k
        for j in range(accepted):
            counts.accepted_per_pos[j] += 1
        n += accepted + 1


def verifier_greedy_with_aux(
    model: Any, capture: Any, prompt: list[int], max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt + greedy continuation, aux states of every position of it) from the Hugging Face verifier.

    Exactly `max_new_tokens` tokens, an end token included where the verifier emits one, like vLLM's
    `ignore_eos=True` in the worker (an end token is emitted and decoding goes on). transformers'
    generate() cannot do that: it stops at the checkpoint's generation_config eos even when given
    eos_token_id=None (transformers 5.19), so the loop is written out with the KV cache.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(max_new_tokens - 1):
            step = torch.tensor([[tokens[-1]]], device=device)
            out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        capture.states.clear()
        seq = torch.cat([ids[0], torch.tensor(tokens, device=device)])
        model(input_ids=seq[None], use_cache=False)
    aux, _ = capture.pop()
    return seq.cpu(), aux.flatten(1).float().cpu()
