"""The simulation's counters at the end of a request, where vLLM verifies the whole last draft."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline.models.acceptance import AcceptanceCounts, simulate_sequence, trace_length


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

    def first_pass(self, aux, next_tokens, positions, query_from=0):  # every slot: exact from any
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


# --- sampling (temperature > 0) --------------------------------------------------------------------


def test_processed_distribution_follows_vllms_top_k_top_p():
    from eagle3_pipeline.models.acceptance import Sampling

    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # ascending cumulative mass 0.05, 0.20, 0.50, 1.00: top_p 0.8 drops what is <= 0.2 -> {0.5, 0.3}
    assert torch.allclose(Sampling(1.0, 0.8).probs(logits), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(Sampling(1.0, 0.95).probs(logits), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    assert torch.allclose(Sampling(1.0, 1.0, top_k=1).probs(logits), torch.tensor([1.0, 0, 0, 0]))
    # top_p never drops the most likely token; temperature sharpens before the cut
    assert torch.allclose(Sampling(1.0, 1e-6).probs(logits), torch.tensor([1.0, 0, 0, 0]))
    hot = Sampling(0.5, 1.0).probs(logits)
    assert torch.allclose(hot, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)
    assert Sampling(1e-6).greedy and not Sampling(0.01).greedy


class BigramDraft:
    """Drafts f(previous token): slot t sees token t+1 and proposes token t+2, like ReferenceDraft."""

    def __init__(self, f: torch.Tensor):
        self.f, self.vocab = f, len(f)

    def _onehot(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(self.f[tokens], self.vocab).float()

    def first_pass(self, aux, next_tokens, positions, query_from=0):  # every slot: exact from any
        return positions[:, None].float(), self._onehot(next_tokens), _Cache()

    def step(self, g, token, position, cache):
        return position[:, None].float(), self._onehot(token), cache

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def _vllm_rejection_sampling(P, f, prompt, max_new, k, gen) -> tuple[int, list[int], list[int]]:
    """vLLM's rule for drafts without probabilities, written out: accept x_j with probability p(x_j),
    else emit a token from p without x_j and stop; after k accepts a bonus token from p. The prefill
    emits the first token; the last step verifies all k drafts even past max_new (the scheduler)."""
    seq, drafts, acc = list(prompt), 0, [0] * k
    seq.append(int(torch.multinomial(P[seq[-1]], 1, generator=gen)))  # the prefill's token
    while len(seq) - len(prompt) < max_new:
        proposals, prev = [], seq[-1]
        for _ in range(k):
            prev = int(f[prev])
            proposals.append(prev)
        drafts += 1
        for j, x in enumerate(proposals):
            p = P[seq[-1]]
            if torch.rand((), generator=gen) < p[x]:
                seq.append(x)
                acc[j] += 1
                continue
            rest = p.clone()
            rest[x] = 0
            seq.append(int(torch.multinomial(rest / rest.sum(), 1, generator=gen)))
            break
        else:
            seq.append(int(torch.multinomial(P[seq[-1]], 1, generator=gen)))
    return drafts, acc, seq[: len(prompt) + max_new]  # the output vLLM shows ends at max_new


def _bigram_world(V: int):
    """A bigram verifier P (rows: p(next | previous)), a draft f that is its argmax except after token 2
    (chains leave the trace there), and the verify pass over P."""
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=-1)
    f = P.argmax(dim=-1)
    f[2] = (f[2] + 1) % V

    def verify(seq, items):
        return [torch.stack([P[int(t)] for t in [int(seq[n - 1]), *d]]) for n, d in items]

    return P, f, verify


def test_replaying_vllms_sampled_outputs_gives_its_drafts_and_accepts_within_the_last_step():
    """Counting over the outputs a rejection sampler showed gives its drafts exactly and its accepted
    counts up to the last step's unshown positions; the expected counts on the same steps differ from
    its realised ones by coin flips only (variance sum q(1-q))."""
    from eagle3_pipeline.models.acceptance import AcceptanceCounts, simulate_sequence

    V, k, max_new, prompt = 6, 3, 12, [0, 1]
    P, f, verify = _bigram_world(V)
    gen = torch.Generator().manual_seed(7)
    counts, ref_drafts, ref_acc = AcceptanceCounts(k), 0, [0] * k
    for _ in range(400):
        d, a, out = _vllm_rejection_sampling(P, f, prompt, max_new, k, gen)
        ref_drafts, ref_acc = ref_drafts + d, [x + y for x, y in zip(ref_acc, a)]
        seq = torch.tensor(out)
        probs = torch.stack([P[out[t - 1]] for t in range(len(prompt), len(out))])
        simulate_sequence(BigramDraft(f), torch.zeros(len(out), 1), seq, len(prompt), k, counts, max_new,
                          probs, verify)  # fmt: skip
    s = counts.summary(sampled=True)
    assert s["num_drafts"] == ref_drafts
    for j in range(k):
        lo = s["accepted_per_pos"][j]
        assert lo <= ref_acc[j] <= lo + s["unverifiable_per_pos"][j], (s, ref_acc)
        sd = s["expected_variance_per_pos"][j] ** 0.5
        assert abs(s["expected_accepted_per_pos"][j] - ref_acc[j]) <= 4 * sd, (s, ref_acc)
    assert 0 < sum(s["unverifiable_per_pos"]) < 400 * k


def test_sampled_simulation_matches_vllms_rejection_sampler_in_expectation():
    """A bigram verifier P and a bigram draft f: the simulation's expected counts (and its realised
    ones) average to what vLLM's rejection sampler accepts, over many seeded requests."""
    from eagle3_pipeline.models.acceptance import AcceptanceCounts, simulate_sequence, trace_length

    V, k, max_new, prompt, n = 6, 3, 12, [0, 1], 1500
    P, f, verify = _bigram_world(V)

    counts = AcceptanceCounts(k)
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        seq = list(prompt)
        for _ in range(trace_length(max_new, k)):
            seq.append(int(torch.multinomial(P[seq[-1]], 1, generator=gen)))
        seq_t = torch.tensor(seq)
        probs = torch.stack([P[seq[t - 1]] for t in range(len(prompt), len(seq))])
        simulate_sequence(BigramDraft(f), torch.zeros(len(seq), 1), seq_t, len(prompt), k, counts,
                          max_new, probs, verify)  # fmt: skip
    s = counts.summary(sampled=True)
    ref_drafts, ref_acc = 0, [0] * k
    gen = torch.Generator().manual_seed(10**6)
    for _ in range(n):
        d, a, _ = _vllm_rejection_sampling(P, f, prompt, max_new, k, gen)
        ref_drafts += d
        ref_acc = [x + y for x, y in zip(ref_acc, a)]
    ref_rates = [a / ref_drafts for a in ref_acc]
    se = s["rate_standard_error_per_pos"]
    for j in range(k):
        # two estimates of the same rate, each with at most one realisation's standard error
        assert abs(s["acceptance_rate_per_pos"][j] - ref_rates[j]) < 4 * 2**0.5 * se[j], (s, ref_rates)
        assert abs(s["sampled_acceptance_rate_per_pos"][j] - ref_rates[j]) < 4 * 2**0.5 * se[j]
        assert 0.002 < se[j] < 0.02  # ~0.1 / sqrt(n): finite, and small enough to test anything
    assert 0.05 < s["acceptance_rate_per_pos"][-1] < s["acceptance_rate_per_pos"][0] < 0.95
    # the expectation removes the coin flips: its spread over requests is smaller than the realisation's
    assert sum(s["expected_accepted_per_pos"]) == pytest.approx(s["num_accepted_tokens"], rel=0.05)


def test_greedy_counts_are_their_own_expectation():
    prompt, max_new, k = 4, 12, 3
    seq = torch.arange(prompt + trace_length(max_new, k)) % 50
    counts = AcceptanceCounts(k)
    simulate_sequence(OracleDraft(seq, 50, {6, 13}), torch.zeros(len(seq), 4), seq, prompt, k, counts, max_new)
    assert counts.expected_accepted_per_pos == [4.0, 3.0, 2.0]
    assert counts.per_request == [(4, [4, 3, 2])]


class SoftBigramDraft(BigramDraft):
    """Draft probabilities Q[previous token] (logits log Q), for vLLM's probabilistic drafting."""

    def _onehot(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.f[tokens].log()

    def target_prob(self, logits: torch.Tensor, target_id: int, temperature: float) -> float:
        return float((logits / temperature).softmax(-1)[target_id])


def _vllm_probabilistic_sampling(P, Q, prompt, max_new, k, gen) -> tuple[int, list[int]]:
    """vLLM's rejection sampler with draft probabilities (draft_sample_method "probabilistic"), written
    out: x_j ~ Q[x_{j-1}], accepted with probability min(1, P(x_j) / Q(x_j)), else a token from
    (P - Q)+ and stop; after k accepts a bonus token from P. Returns (drafts, accepted per position)."""
    seq, drafts, acc = list(prompt), 0, [0] * k
    seq.append(int(torch.multinomial(P[seq[-1]], 1, generator=gen)))
    while len(seq) - len(prompt) < max_new:
        proposals, qs, prev = [], [], seq[-1]
        for _ in range(k):
            prev = int(torch.multinomial(Q[prev], 1, generator=gen))
            proposals.append(prev)
        drafts += 1
        for j, x in enumerate(proposals):
            p, q = P[seq[-1]], Q[seq[-1]]
            if torch.rand((), generator=gen) < min(1.0, float(p[x] / q[x])):
                seq.append(x)
                acc[j] += 1
                continue
            rest = (p - q).clamp(min=0)
            seq.append(int(torch.multinomial(rest / rest.sum(), 1, generator=gen)))
            break
        else:
            seq.append(int(torch.multinomial(P[seq[-1]], 1, generator=gen)))
    return drafts, acc


def _probabilistic_sim(P, Q, prompt, max_new, k, n):
    from eagle3_pipeline.models.acceptance import AcceptanceCounts, Sampling, simulate_sequence, trace_length

    counts, coins = AcceptanceCounts(k), torch.Generator().manual_seed(99)
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        seq = list(prompt)
        for _ in range(trace_length(max_new, k)):
            seq.append(int(torch.multinomial(P[seq[-1]], 1, generator=gen)))
        probs = torch.stack([P[seq[t - 1]] for t in range(len(prompt), len(seq))])
        simulate_sequence(SoftBigramDraft(Q), torch.zeros(len(seq), 1), torch.tensor(seq), len(prompt), k,
                          counts, max_new, probs, probabilistic=Sampling(1.0), coins=coins)  # fmt: skip
    return counts.summary(sampled=True)


def test_probabilistic_drafting_simulation_matches_vllms_rule_in_expectation():
    """Draft probabilities Q near the verifier's P: the simulation (maximal coupling with the trace)
    averages to what the probabilistic rejection sampler accepts; Q = P accepts every draft."""
    V, k, max_new, prompt, n = 6, 3, 12, [0, 1], 1500
    P, _, _ = _bigram_world(V)
    Q = torch.softmax(P.log() + torch.randn(V, V, generator=torch.Generator().manual_seed(3)), dim=-1)
    s = _probabilistic_sim(P, Q, prompt, max_new, k, n)
    gen, ref_drafts, ref_acc = torch.Generator().manual_seed(10**6), 0, [0] * k
    for _ in range(n):
        d, a = _vllm_probabilistic_sampling(P, Q, prompt, max_new, k, gen)
        ref_drafts, ref_acc = ref_drafts + d, [x + y for x, y in zip(ref_acc, a)]
    se = s["rate_standard_error_per_pos"]
    for j in range(k):
        ref = ref_acc[j] / ref_drafts
        assert abs(s["acceptance_rate_per_pos"][j] - ref) < 4 * 2**0.5 * se[j], (s, ref_acc, ref_drafts)
        assert abs(s["sampled_acceptance_rate_per_pos"][j] - ref) < 4 * 2**0.5 * se[j]
        assert 0.002 < se[j] < 0.03
    assert 0.05 < s["acceptance_rate_per_pos"][-1] < s["acceptance_rate_per_pos"][0] < 0.95
    perfect = _probabilistic_sim(P, P, prompt, max_new, k, 20)
    assert perfect["accepted_per_pos"] == [perfect["num_drafts"]] * k
    assert perfect["mean_acceptance_length"] == pytest.approx(k + 1)


def test_probabilistic_comparison_allows_vllm_the_drafts_past_each_outputs_end_and_nothing_more():
    """vLLM counts the last step's drafts past max_tokens; over its outputs the simulation cannot judge
    them (unverifiable_per_pos). The third position's 28 of 928 (the tier's llama run) may add to vLLM's
    rate above the simulation's expectation; below it, and above that allowance, only noise is allowed."""
    from eagle3_pipeline.export_eval.evaluate import compare

    sim = {"acceptance_rate_per_pos": [0.80, 0.70, 0.60], "expected_variance_per_pos": [0.0, 0.0, 0.0],
           "unverifiable_per_pos": [0, 12, 28], "num_drafts": 928}  # fmt: skip

    def agree(rates: list[float]) -> bool:
        return compare(sim, {"acceptance_rate_per_pos": rates, "num_drafts": 1000}, None, probabilistic=True)[
            "rates_agree"
        ]

    tol = 0.01  # RATE_TOLERANCE: the floor when the expected variance is 0
    assert agree([0.80, 0.70, 0.60])
    inside = tol - 1e-9
    assert agree([0.80 + inside, 0.70 + 12 / 928 + inside, 0.60 + 28 / 928 + inside])
    assert agree([0.80 - inside, 0.70 - inside, 0.60 - inside])
    assert not agree([0.80 + tol + 1e-3, 0.70, 0.60])  # nothing past the end at the first position
    assert not agree([0.80, 0.70, 0.60 + 28 / 928 + tol + 1e-3])
    assert not agree([0.80, 0.70 - tol - 1e-3, 0.60])  # the allowance is one-sided


# --- acceptance by context length ----------------------------------------------------------------------


def test_context_buckets_double_from_1k_and_are_labelled_in_k_tokens():
    from eagle3_pipeline.models.acceptance import bucket_label, context_bucket

    assert [context_bucket(c) for c in (0, 1023, 1024, 2047, 2048, 262143)] == [
        (0, 1024), (0, 1024), (1024, 2048), (1024, 2048), (2048, 4096), (131072, 262144)]  # fmt: skip
    assert [bucket_label(*context_bucket(c)) for c in (5, 1500, 200_000)] == ["0-1k", "1k-2k", "128k-256k"]


def test_steps_are_bucketed_by_prompt_plus_generated_tokens_and_add_up_to_the_totals():
    # prompt 1020 tokens, 12 new, k = 3, drafts wrong at targets 1022 and 1029. Steps start with
    # 1021 known (drafts 1021-1023: 1 accepted), 1023 (3 accepted), 1027 (drafts 1027-1029: 2), 1030 (3):
    # the first two in 0-1k (accepted 1, 3: AL 3.0, SE std/sqrt(2) = 1.0), the others in 1k-2k (2, 3:
    # AL 3.5, SE 0.5).
    prompt, max_new, k = 1020, 12, 3
    seq = torch.arange(prompt + trace_length(max_new, k)) % 50
    s = _run(seq, prompt, k, max_new, wrong_at={1022, 1029})
    by = s["acceptance_by_context"]
    assert "step" in by["unit"]
    got = [(b["context"], b["num_drafts"], b["num_accepted_tokens"], b["mean_acceptance_length"],
            b["standard_error"]) for b in by["buckets"]]  # fmt: skip
    assert got == [("0-1k", 2, 4, 3.0, pytest.approx(1.0)), ("1k-2k", 2, 5, 3.5, pytest.approx(0.5))]
    assert s["num_drafts"] == 4 and s["accepted_per_pos"] == [4, 3, 2]
    assert sum(b["num_drafts"] for b in by["buckets"]) == s["num_drafts"]
    assert sum(b["num_accepted_tokens"] for b in by["buckets"]) == s["num_accepted_tokens"]


def test_sampled_buckets_hold_the_expected_acceptance_empty_ones_omitted():
    from eagle3_pipeline.models.acceptance import by_context

    # (context, accepted, expected accepted) per step; nothing between 2k and 128k
    steps = [(10, 1, 0.5), (1500, 0, 0.25), (1900, 2, 1.0), (200_000, 1, 0.75)]
    buckets = by_context(steps, sampled=True)["buckets"]
    assert [b["context"] for b in buckets] == ["0-1k", "1k-2k", "128k-256k"]
    one = buckets[1]
    assert one["mean_acceptance_length"] == pytest.approx(1.625)  # 1 + mean(0.25, 1.0)
    assert one["standard_error"] == pytest.approx(0.375)  # sample std 0.530 / sqrt(2)
    assert one["sampled_mean_acceptance_length"] == pytest.approx(2.0)  # 1 + mean(0, 2)
    assert buckets[0]["standard_error"] is None  # one step: no spread to estimate

    # the simulator's sampled steps: bucket expectations weighted by drafts give the summary's
    V, k, max_new = 6, 3, 12
    P, f, verify = _bigram_world(V)
    counts = AcceptanceCounts(k)
    for i in range(3):
        gen = torch.Generator().manual_seed(i)
        seq = [0, 1] * 510  # 1020 tokens: the steps cross into 1k-2k
        for _ in range(trace_length(max_new, k)):
            seq.append(int(torch.multinomial(P[seq[-1]], 1, generator=gen)))
        probs = torch.stack([P[seq[t - 1]] for t in range(1020, len(seq))])
        simulate_sequence(BigramDraft(f), torch.zeros(len(seq), 1), torch.tensor(seq), 1020, k, counts,
                          max_new, probs, verify)  # fmt: skip
    s = counts.summary(sampled=True)
    buckets = s["acceptance_by_context"]["buckets"]
    assert [b["context"] for b in buckets] == ["0-1k", "1k-2k"]
    weighted = sum((b["mean_acceptance_length"] - 1) * b["num_drafts"] for b in buckets)
    assert weighted == pytest.approx(sum(s["expected_accepted_per_pos"]))
    assert sum(b["num_accepted_tokens"] for b in buckets) == s["num_accepted_tokens"]


def test_vllm_counters_are_reported_per_prompt_bucket_and_merged_in_request_order():
    from eagle3_pipeline.models.acceptance import Sampling
    from eagle3_pipeline.vllm_side.vllm_engine import merge_bucket_results, prompt_buckets, sampling_fields

    prompts = [[1] * 10, [1] * 3000, [1] * 20, [1] * 1500]
    groups = prompt_buckets(prompts)
    assert groups == [((0, 1024), [0, 2]), ((1024, 2048), [3]), ((2048, 4096), [1])]
    # each call's requests keep the seed of their place in the whole run
    assert sampling_fields(Sampling(1.0, seed=5), 2, [0, 2])["seeds"] == [5, 7]

    def answer(outputs, drafts, per_pos):
        return {"outputs": outputs, "finish_reasons": ["length"] * len(outputs), "num_drafts": drafts,
                "num_draft_tokens": 2 * drafts, "num_accepted_tokens": sum(per_pos),
                "accepted_per_pos": per_pos, "mean_acceptance_length": 1 + sum(per_pos) / drafts,
                "generate_s": 1.0}  # fmt: skip

    parts = [(groups[0][0], [0, 2], answer([[0], [2]], 4, [3, 1])),
             (groups[1][0], [3], answer([[3]], 2, [2, 2])),
             (groups[2][0], [1], answer([[1]], 2, [0, 0]))]  # fmt: skip
    m = merge_bucket_results(4, parts)
    assert m["outputs"] == [[0], [1], [2], [3]]
    assert (m["num_drafts"], m["num_accepted_tokens"], m["accepted_per_pos"]) == (8, 8, [5, 3])
    assert m["acceptance_rate_per_pos"] == [5 / 8, 3 / 8] and m["mean_acceptance_length"] == 2.0
    by = m["acceptance_by_context"]
    assert "prompt length" in by["unit"]
    assert [(b["context"], b["num_requests"], b["mean_acceptance_length"]) for b in by["buckets"]] == [
        ("0-1k", 2, 2.0), ("1k-2k", 1, 3.0), ("2k-4k", 1, 1.0)]  # fmt: skip
