"""The simulation's counters at the end of a request, where vLLM verifies the whole last draft."""

from __future__ import annotations

import torch

from eagle3_pipeline.acceptance import AcceptanceCounts, simulate_sequence, trace_length


class _Cache:
    def truncate(self, n: int) -> _Cache:
        return self


class OracleDraft:
    """Drafts the sequence it is given, or (`wrong_at`) a wrong token at those target positions.

    Slot t of the first pass (verifier features at t, embedding of token t+1) proposes token t+2, as a
    chain step at position p does: the same alignment as ReferenceDraft.
    """

    def __init__(self, seq: torch.Tensor, vocab: int, wrong_at: set[int] = frozenset()):
        self.seq, self.vocab, self.wrong_at = seq, vocab, wrong_at

    def _logits(self, positions: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(positions), self.vocab)
        for i, p in enumerate(positions.tolist()):
            target = p + 2
            token = int(self.seq[target]) if target < len(self.seq) else 0
            out[i, (token + 1) % self.vocab if target in self.wrong_at else token] = 1.0
        return out

    def first_pass(self, aux, next_tokens, positions):
        return positions[:, None].float(), self._logits(positions), _Cache()

    def step(self, g, token, position, cache):
        return position[:, None].float(), self._logits(position), cache

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def _run(seq: torch.Tensor, prompt_len: int, k: int, max_new: int | None, wrong_at=frozenset()) -> dict:
    counts = AcceptanceCounts(k)
    draft = OracleDraft(seq, 50, set(wrong_at))
    simulate_sequence(draft, torch.zeros(len(seq), 4), seq, prompt_len, k, counts, max_new)
    return counts.summary()


def test_the_last_draft_is_verified_past_max_new_tokens_like_vllm():
    # prompt 5 tokens, 10 new, k = 3, a perfect draft. vLLM: the prefill emits token 5; steps start
    # with 6, 10, 14 tokens known; the third starts before the end (14 < 15) and all 3 of its drafts
    # are verified and counted, although the output keeps only token 14: 3 drafts, 9 accepted.
    prompt, max_new, k = 5, 10, 3
    seq = torch.arange(prompt + trace_length(max_new, k)) % 50
    assert trace_length(max_new, k) == 12
    s = _run(seq, prompt, k, max_new)
    assert (s["num_drafts"], s["accepted_per_pos"], s["mean_acceptance_length"]) == (3, [3, 3, 3], 4.0)
    # a trace that stops at max_new_tokens can only reject the last draft's tail: 1 + 7/3
    short = _run(seq[: prompt + max_new], prompt, k, None)
    assert (short["num_drafts"], short["accepted_per_pos"]) == (3, [3, 2, 2])


def test_a_rejection_starts_the_next_step_after_the_verifiers_own_token():
    prompt, max_new, k = 4, 12, 3
    seq = torch.arange(prompt + trace_length(max_new, k)) % 50
    # step 1 (5 known) drafts 5, 6, 7: 6 is wrong -> 1 accepted, the verifier emits 6; step 2 (7 known)
    # drafts 7, 8, 9 all right -> 11 known; step 3 drafts 11, 12, 13: 13 wrong -> 2 accepted, 14 known;
    # step 4 drafts 14, 15, 16 (16 = max_new + prompt: past the end, still verified) -> 18 known, done.
    s = _run(seq, prompt, k, max_new, wrong_at={6, 13})
    assert s["num_drafts"] == 4 and s["accepted_per_pos"] == [4, 3, 2]
    assert s["mean_acceptance_length"] == 1 + 9 / 4
