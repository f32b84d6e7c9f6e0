"""Greedy chain speculative decoding, simulated on an exported draft exactly as vLLM runs it.

Per prompt: the verifier's greedy continuation S (what any lossless speculation must output) and its
aux states at the ids the export's config names. A round starts with n known tokens, hidden states for
positions 0..n-2 and the last token just emitted: the draft's first pass over slots 0..n-2 proposes d1
from slot n-2, then k-1 chain steps feed the previous pre-norm output back with the previous draft token
at the next position (parallel drafting: drafts 2..k from k-1 masked slots at those positions in the
same forward, `ReferenceDraft.masked_logits`). The verifier accepts the longest prefix of d1..dk equal
to S[n..], then emits one token itself, so the next round starts at n + accepted + 1. Counters follow vLLM's
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
made the simulation low at the deeper positions, by more the better the draft.

Sampling (temperature > 0, the way Kimi-K2.5 is served in thinking mode: 1.0 / top_p 0.95). vLLM 0.32's
EAGLE-3 proposer still drafts the draft's argmax (`draft_sample_method` "greedy", its default), and the
rejection sampler accepts draft x_j with probability p~_j(x_j), p~_j the verifier's distribution after
temperature, top-k and top-p (`rejection_sampler.apply_sampling_constraints`), evaluated on the draft
chain (the verify pass); on a rejection it emits a token drawn from p~_j without x_j, after k accepts a
bonus token from p~_{k+1}. The output is then distributed as plain sampling from p~, so the simulation
samples the verifier's trace from p~ itself (seeded per prompt) and counts a draft accepted when it
equals the trace's token: the same joint law of accepted counts as vLLM's sampler (P(x_1 accepted) =
p~_1(x_1), and so on down the chain). Beside that realisation it adds, per step, the exact expected
acceptance per position, prod_{i<=j} p~_i(x_i) (`expected_accepted_per_pos`), with p~_i on the draft
chain (one verifier pass over the drafts where they leave the trace): no coin-flip noise, only the
trace's. Greedy (temperature < 1e-5, vLLM's _SAMPLING_EPS) is the exact path above, unchanged.

Replaying vLLM: given one of vLLM's own sampled outputs, the step boundaries and accepted counts of that
run are determined by it (an accepted draft is the output token; a rejected one is followed by a token
that differs from it), except at the request's last step, whose drafts past the output's end are
verified but not shown (`unverifiable_per_pos`). So the same counting over vLLM's outputs must give
vLLM's drafts exactly and its accepted counts up to those, and the expected counts on the same steps
differ from vLLM's realised ones only by the rejection sampler's coin flips, whose variance given the
steps is sum q (1 - q) per position (`expected_variance_per_pos`): a test of vLLM's acceptance rule
with no trace noise in it (evaluate.compare).

Acceptance by context length: every step is also recorded with its context, the tokens the verifier has
seen when it verifies the step's drafts (prompt + tokens emitted so far, `n` below), and its accepted count
(sampled: also the expected one). `by_context` groups the steps into power-of-two buckets of context
(`context_bucket`): each bucket's mean acceptance length and its standard error over the bucket's steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_pipeline.models.reference_draft import ReferenceDraft

# vLLM treats a temperature below this as greedy (vllm/v1/sample/sampler.py, _SAMPLING_EPS)
SAMPLING_EPS = 1e-5

# Context buckets: [0, 1k), [1k, 2k), [2k, 4k), ... doubling up to Kimi-K2.5's 256k positions and past.
# Powers of two because acceptance is reported to fall roughly with log(context) (EAGLE-3 on Qwen3-8B:
# acceptance length 2.3 at 2k, 1.7 at 8k, 1.1 at 16k), and serving prompts below 1k are one regime.
FIRST_CONTEXT_BUCKET_END = 1024
# What one observation of a bucket's standard error is (each step's accepted count; steps of one request
# share its trace, so the error is a lower bound where a bucket holds many steps of few requests).
BY_CONTEXT_UNIT = "verification step (accepted drafts + 1)"


@dataclass(frozen=True)
class Sampling:
    """The request's sampling parameters, as vLLM's SamplingParams reads them (top_k <= 0: off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of p~: logits / temperature, -inf where top-k or top-p drop a token, as vLLM's
        `apply_top_k_top_p` (ascending sort; top-p drops the tokens whose cumulative mass from the bottom
        is <= 1 - top_p, always keeping the most likely one). [..., V] -> [..., V], float32."""
        x = logits.float() / self.temperature
        if self.top_p >= 1.0 and not 0 < self.top_k < x.shape[-1]:
            return x
        srt, idx = x.sort(dim=-1, descending=False)
        if 0 < self.top_k < x.shape[-1]:
            srt = srt.masked_fill(srt < srt[..., -self.top_k, None], -math.inf)
        if self.top_p < 1.0:
            cum = srt.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= 1 - self.top_p
            drop[..., -1] = False
            srt = srt.masked_fill(drop, -math.inf)
        return srt.scatter(-1, idx, srt)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """p~: the softmax of `logits(logits)`. [..., V] -> probabilities [..., V], float32."""
        return self.logits(logits).softmax(dim=-1)


@dataclass
class AcceptanceCounts:
    """vLLM's spec-decode counters for one set of requests, plus (sampling) the exact expected
    acceptances per position with their variance given the steps, what each request added (for the
    standard error of a realisation), and the last-step positions a shown output cannot settle."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    expected_accepted_per_pos: list[float] = field(default_factory=list)
    expected_variance_per_pos: list[float] = field(default_factory=list)
    unverifiable_per_pos: list[int] = field(default_factory=list)
    per_request: list[tuple[int, list[int]]] = field(default_factory=list)  # (drafts, accepted per pos)
    # per step: (context, accepted, expected accepted): what `by_context` buckets
    steps: list[tuple[int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_per_pos = self.accepted_per_pos or [0] * k
        self.expected_accepted_per_pos = self.expected_accepted_per_pos or [0.0] * k
        self.expected_variance_per_pos = self.expected_variance_per_pos or [0.0] * k
        self.unverifiable_per_pos = self.unverifiable_per_pos or [0] * k

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_pos)

    def rate_standard_errors(self) -> list[float]:
        """Standard error of one realisation's acceptance rate per position (what vLLM's counters are),
        with requests as independent clusters: the ratio estimator's sqrt(n/(n-1) sum (a_r - rate d_r)^2)
        / sum d_r. Steps within a request share its trace, so they are not independent draws."""
        n = len(self.per_request)
        d = sum(r[0] for r in self.per_request)
        if n < 2 or d == 0:
            return [math.inf] * self.num_speculative_tokens
        out = []
        for j in range(self.num_speculative_tokens):
            rate = sum(r[1][j] for r in self.per_request) / d
            ss = sum((r[1][j] - rate * r[0]) ** 2 for r in self.per_request)
            out.append(math.sqrt(n / (n - 1) * ss) / d)
        return out

    def summary(self, sampled: bool = False) -> dict[str, Any]:
        """vLLM's counters and rates. Sampled: the rates and acceptance length are the expected ones
        (`expected_accepted_per_pos`); the realisation's counters and rates stand beside them."""
        d = max(self.num_drafts, 1)
        out = {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": self.accepted_per_pos,
            "acceptance_rate_per_pos": [a / d for a in self.accepted_per_pos],
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / d,
        }
        if sampled:
            out["sampled_acceptance_rate_per_pos"] = out["acceptance_rate_per_pos"]
            out["sampled_mean_acceptance_length"] = out["mean_acceptance_length"]
            out["expected_accepted_per_pos"] = self.expected_accepted_per_pos
            out["acceptance_rate_per_pos"] = [a / d for a in self.expected_accepted_per_pos]
            out["mean_acceptance_length"] = 1.0 + sum(self.expected_accepted_per_pos) / d
            out["rate_standard_error_per_pos"] = self.rate_standard_errors()
            out["expected_variance_per_pos"] = self.expected_variance_per_pos
            out["unverifiable_per_pos"] = self.unverifiable_per_pos
        out["acceptance_by_context"] = by_context(self.steps, sampled)
        return out


def context_bucket(context: int) -> tuple[int, int]:
    """[lo, hi) of the context bucket that holds a step verified at `context` tokens: [0,
    FIRST_CONTEXT_BUCKET_END), then powers of two, [2^m, 2^(m+1))."""
    if context < 0:
        raise ValueError(f"context {context} < 0")
    if context < FIRST_CONTEXT_BUCKET_END:
        return 0, FIRST_CONTEXT_BUCKET_END
    lo = 1 << (context.bit_length() - 1)
    return lo, 2 * lo


def bucket_label(lo: int, hi: int) -> str:
    """"0-1k", "1k-2k", ... "128k-256k" (k = 1024 tokens)."""

    def short(n: int) -> str:
        return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)

    return f"{short(lo)}-{short(hi)}"


def by_context(steps: list[tuple[int, int, float]], sampled: bool = False) -> dict[str, Any]:
    """The steps' acceptance per context bucket, ascending, empty buckets omitted: steps (drafts), accepted
    tokens, mean acceptance length 1 + mean accepted and its standard error std / sqrt(steps) (sample
    std over the bucket's steps; None below 2 steps). Sampled: the expected accepted counts, as the
    summary's mean acceptance length, the realisation's mean beside it."""
    groups: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for step in steps:
        groups.setdefault(context_bucket(step[0]), []).append(step)
    buckets = []
    for (lo, hi), members in sorted(groups.items()):
        values = [float(e) if sampled else float(a) for _, a, e in members]
        n = len(values)
        mean = sum(values) / n
        se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else None
        bucket = {
            "context": bucket_label(lo, hi),
            "context_min": lo,
            "context_max": hi,  # exclusive
            "num_drafts": n,
            "num_accepted_tokens": sum(a for _, a, _ in members),
            "mean_acceptance_length": 1.0 + mean,
            "standard_error": se,
        }
        if sampled:
            bucket["sampled_mean_acceptance_length"] = 1.0 + bucket["num_accepted_tokens"] / n
        buckets.append(bucket)
    return {"unit": BY_CONTEXT_UNIT, "buckets": buckets}


def trace_length(max_new_tokens: int, k: int) -> int:
    """Greedy tokens a trace needs for a request of `max_new_tokens` at k drafts per step: the last
    round starts with at most max_new_tokens - 1 emitted and vLLM verifies all k of its drafts."""
    return max_new_tokens + k - 1


# (sequence, [(n, drafts x_1..x_{k-1})]) -> for each, p~ after seq[:n] and after each draft: [k, V]
VerifyPass = Callable[[torch.Tensor, list[tuple[int, list[int]]]], list[torch.Tensor]]


def simulate_sequence(
    draft: ReferenceDraft,
    aux: torch.Tensor,
    seq: torch.Tensor,
    prompt_len: int,
    k: int,
    counts: AcceptanceCounts,
    max_new_tokens: int | None = None,
    trace_probs: torch.Tensor | None = None,
    verify: VerifyPass | None = None,
    probabilistic: Sampling | None = None,
    coins: torch.Generator | None = None,
) -> None:
    """Count the drafts and acceptances of one prompt. aux: [len(seq), n_aux*H]; seq = prompt + trace.

    The request ends after `max_new_tokens` tokens (default: all of seq); seq should run
    `trace_length(max_new_tokens, k)` tokens past the prompt so the last round is verified as in vLLM
    (a shorter one, e.g. vLLM's own output, leaves `unverifiable_per_pos`). Greedy: seq is the
    verifier's greedy trace. Sampling: seq was sampled from p~ (here or by vLLM) and `trace_probs[i]`
    is the p~ of token prompt_len + i; `verify` gives p~ on the draft chain where the drafts leave the
    trace, for the expected counts. `probabilistic` (the requests' sampling, with trace_probs): vLLM's
    `draft_sample_method` "probabilistic" instead of argmax drafts (`probabilistic_step`; `coins` seeds
    its accept tests).
    """
    total = seq.numel()
    end = total if max_new_tokens is None else min(total, prompt_len + max_new_tokens)
    positions = torch.arange(total - 1)
    # the rounds read first-pass slots from prompt_len - 1 on (greedy_proposals: slot n - 2, n > prompt_len)
    out0, logits0, cache = draft.first_pass(aux[: total - 1], seq[1:], positions, query_from=prompt_len - 1)
    n = prompt_len + 1  # the verifier's prefill emitted seq[prompt_len]
    drafts0, accepted0 = counts.num_drafts, list(counts.accepted_per_pos)
    steps: list[tuple[int, list[int], int]] = []
    if probabilistic is not None and trace_probs is not None:
        while n < end:
            n += probabilistic_step(draft, (out0, logits0, cache), seq, prompt_len, n, k, trace_probs,
                                    probabilistic.temperature, counts, coins) + 1  # fmt: skip
        _record_request(counts, drafts0, accepted0)
        return
    while n < end:
        proposals = greedy_proposals(draft, (out0, logits0, cache), n, k)
        accepted = 0
        for j, tok in enumerate(proposals):
            if n + j >= total:  # past the trace: a shown output cannot settle these
                for i in range(j, k):
                    counts.unverifiable_per_pos[i] += 1
                break
            if tok != int(seq[n + j]):
                break
            accepted += 1
        counts.num_drafts += 1
        counts.num_draft_tokens += k
        for j in range(accepted):
            counts.accepted_per_pos[j] += 1
        steps.append((n, proposals, accepted))
        n += accepted + 1
    if trace_probs is None:  # greedy: a draft is accepted exactly when it is the trace's token
        for _, _, accepted in steps:
            for j in range(accepted):
                counts.expected_accepted_per_pos[j] += 1.0
        expected = [float(accepted) for _, _, accepted in steps]
    else:
        expected = _add_expected(counts, seq, prompt_len, steps, trace_probs, verify)
    counts.steps += [(at, accepted, e) for (at, _, accepted), e in zip(steps, expected)]
    _record_request(counts, drafts0, accepted0)


def greedy_proposals(
    draft: ReferenceDraft, first: tuple[torch.Tensor, torch.Tensor, Any], n: int, k: int
) -> list[int]:
    """The k argmax drafts of the round starting with n known tokens (target ids): d1 from first-pass slot
    n-2, then k-1 chain steps at positions n-1.., or with parallel drafting the k-1 masked slots there."""
    out0, logits0, cache = first
    proposals = [int(draft.to_target(logits0[n - 2].argmax()[None])[0])]
    if k > 1 and getattr(draft, "parallel", False):  # (stand-in drafts in tests have no masked slots)
        masked = draft.masked_logits(cache.truncate(n - 1), n - 2, k)
        return proposals + draft.to_target(masked.argmax(-1)).tolist()
    g, c = out0[n - 2 : n - 1], cache.truncate(n - 1)
    for j in range(1, k):
        token = torch.tensor([proposals[-1]])
        g, lg, c = draft.step(g, token, torch.tensor([n - 2 + j]), c)
        proposals.append(int(draft.to_target(lg[0].argmax()[None])[0]))
    return proposals


def _record_request(counts: AcceptanceCounts, drafts0: int, accepted0: list[int]) -> None:
    """What one request added to the counters (its cluster, for the standard errors)."""
    counts.per_request.append(
        (counts.num_drafts - drafts0, [a - b for a, b in zip(counts.accepted_per_pos, accepted0)])
    )


def probabilistic_step(
    draft: ReferenceDraft,
    first: tuple[torch.Tensor, torch.Tensor, Any],
    seq: torch.Tensor,
    prompt_len: int,
    n: int,
    k: int,
    trace_probs: torch.Tensor,
    temperature: float,
    counts: AcceptanceCounts,
    coins: torch.Generator | None,
) -> int:
    """One step under vLLM's `draft_sample_method` "probabilistic": draft j is drawn from q_j =
    softmax(draft logits / temperature) and accepted with probability min(1, p~_j(x) / q_j(x)); on a
    rejection the token comes from (p~_j - q_j)+. Simulated by the maximal coupling of the draw with
    the trace's token t_j ~ p~_j: the draft equals t_j with probability a_j = min(1, q_j(t_j) / p~_j(t_j))
    (else it is drawn from (q_j - p~_j)+ and rejected), which gives the sampler's joint law of accepted
    drafts and emitted tokens, the output still distributed as p~. Accepted drafts are the trace's
    tokens, so the chain runs on the trace; the expected acceptance given the trace is prod_{i<=j} a_i.
    `first`: the first pass's (carried outputs, logits, cache). Returns the accepted count."""
    out0, logits0, cache = first
    g, c, lg = out0[n - 2 : n - 1], cache.truncate(n - 1), logits0[n - 2]
    masked = draft.masked_logits(c, n - 2, k) if k > 1 and getattr(draft, "parallel", False) else None
    chain: list[float] = []
    for j in range(k):
        if n + j >= seq.numel():  # past the trace: a shown output cannot settle these
            for i in range(j, k):
                counts.unverifiable_per_pos[i] += 1
            break
        t = int(seq[n + j])
        q_t = draft.target_prob(lg, t, temperature)
        chain.append(min(1.0, q_t / float(trace_probs[n - prompt_len + j, t])))
        if j + 1 < k and masked is not None:  # parallel drafting: draft j+2 does not depend on t
            lg = masked[j]
        elif j + 1 < k:
            g, logits, c = draft.step(g, torch.tensor([t]), torch.tensor([n - 1 + j]), c)
            lg = logits[0]
    u = torch.rand(len(chain), generator=coins).tolist()
    accepted = next((j for j, (a, x) in enumerate(zip(chain, u)) if x >= a), len(chain))
    counts.num_drafts += 1
    counts.num_draft_tokens += k
    q, expected = 1.0, 0.0
    for j, a in enumerate(chain):
        counts.accepted_per_pos[j] += int(j < accepted)
        q *= a
        expected += q
        counts.expected_accepted_per_pos[j] += q
        counts.expected_variance_per_pos[j] += q * (1.0 - q)
    counts.steps.append((n, accepted, expected))
    return accepted


def _add_expected(
    counts: AcceptanceCounts,
    seq: torch.Tensor,
    prompt_len: int,
    steps: list[tuple[int, list[int], int]],
    trace_probs: torch.Tensor,
    verify: VerifyPass | None,
) -> list[float]:
    """Add q_j = prod_{i<=j} p~_i(x_i), and q_j (1 - q_j), for each position j of each step; return each
    step's expected accepted count sum_j q_j. Drafts 1..on_trace equal the trace's tokens, so p~ up to
    draft on_trace + 1 is the trace's own; past it the drafts left the trace and p~ comes from one
    batched verify pass over the contexts and drafts, as vLLM's verify pass computes it."""
    chains: list[list[float]] = []
    pending: list[tuple[int, int, list[int]]] = []  # (step, n, drafts) needing the verify pass
    for s, (n, proposals, on_trace) in enumerate(steps):
        p_known = []
        for j, tok in enumerate(proposals):
            if j > on_trace or n - prompt_len + j >= len(trace_probs):
                break
            p_known.append(float(trace_probs[n - prompt_len + j, tok]))
        chains.append(p_known)
        if len(p_known) < len(proposals) and math.prod(p_known) > 0.0:
            pending.append((s, n, proposals[:-1]))
    if pending:
        if verify is None:
            raise ValueError("sampled simulation needs a verify pass for drafts off the trace")
        for (s, _, drafts), probs in zip(pending, verify(seq, [(n, d) for _, n, d in pending])):
            proposals = steps[s][1]
            chains[s] += [float(probs[j, proposals[j]]) for j in range(len(chains[s]), len(proposals))]
    per_step = []
    for chain in chains:
        q, expected = 1.0, 0.0
        for j, p in enumerate(chain):
            q *= p
            expected += q
            counts.expected_accepted_per_pos[j] += q
            counts.expected_variance_per_pos[j] += q * (1.0 - q)
        per_step.append(expected)
    return per_step


def verifier_trace_with_aux(
    model: Any,
    capture: Any,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
    pixels: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(prompt + continuation, aux states of every position of it, p~ of each new token or None) from
    the Hugging Face verifier: greedy, or sampled from p~ (`sampling`, `generator`); `pixels`: the
    prompt's images (pixel_values, image_grid_thw), given to every forward over the prompt.

    Exactly `max_new_tokens` tokens, an end token included where the verifier emits one, like vLLM's
    `ignore_eos=True` in the worker (an end token is emitted and decoding goes on). transformers'
    generate() cannot do that: it stops at the checkpoint's generation_config eos even when given
    eos_token_id=None (transformers 5.19), so the loop is written out with the KV cache.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    probs: list[torch.Tensor] = []

    def choose(logits: torch.Tensor) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        p = sampling.probs(logits).cpu()
        probs.append(p)
        return int(torch.multinomial(p, 1, generator=generator))

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **(pixels or {}))
        tokens = [choose(out.logits[0, -1])]
        for _ in range(max_new_tokens - 1):
            step = torch.tensor([[tokens[-1]]], device=device)
            out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
            tokens.append(choose(out.logits[0, -1]))
        capture.states.clear()
        seq = torch.cat([ids[0], torch.tensor(tokens, device=device)])
        model(input_ids=seq[None], use_cache=False, **(pixels or {}))
    aux, _ = capture.pop()
    return seq.cpu(), aux.flatten(1).float().cpu(), torch.stack(probs) if probs else None


def replay_with_aux(
    model: Any, capture: Any, prompt: list[int], output: list[int], sampling: Sampling,
    pixels: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt + output, aux states, p~ of each output token) for an output vLLM sampled: one forward
    (`pixels`: the prompt's images)."""
    device = next(model.parameters()).device
    seq = torch.tensor(prompt + output)
    with torch.no_grad():
        capture.states.clear()
        logits = model(input_ids=seq[None].to(device), use_cache=False, **(pixels or {})).logits[0]
    aux, _ = capture.pop()
    probs = sampling.probs(logits[len(prompt) - 1 : len(seq) - 1]).cpu()
    return seq, aux.flatten(1).float().cpu(), probs


VERIFY_BATCH = 16  # verify-pass contexts per verifier forward (right-padded; causal, so pads change nothing)


def verify_pass(
    model: Any, capture: Any, sampling: Sampling, pixels: dict[str, torch.Tensor] | None = None
) -> VerifyPass:
    """p~ after seq[:n] and after each of the drafts that follow it, for many (n, drafts) of one
    sequence: batched forwards of the verifier over seq[:n] + drafts (a speculative step's verify pass),
    right-padded, since a causal model's logits at a position do not depend on later tokens. `pixels`:
    the images of the sequence's prompt, which every row holds (n is past the prompt), given once per row."""
    device = next(model.parameters()).device

    def run(seq: torch.Tensor, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for b in range(0, len(items), VERIFY_BATCH):
            chunk = items[b : b + VERIFY_BATCH]
            rows = [torch.cat([seq[:n], torch.tensor(d, dtype=seq.dtype)]) for n, d in chunk]
            width = max(len(r) for r in rows)
            pad = torch.nn.functional.pad
            batch = torch.stack([pad(r, (0, width - len(r)), value=int(r[-1])) for r in rows])
            with torch.no_grad():
                images = _per_row(pixels, len(rows))
                logits = model(input_ids=batch.to(device), use_cache=False, **images).logits
            capture.states.clear()  # its hooks fire on every forward; these states are not needed
            for row, (n, d) in enumerate(chunk):
                out.append(sampling.probs(logits[row, n - 1 : n + len(d)]).cpu())
        return out

    return run


def _per_row(pixels: dict[str, torch.Tensor] | None, rows: int) -> dict[str, torch.Tensor]:
    """One prompt's images for a batch of `rows` sequences that each hold them: the patches and grids
    repeated row after row, the order in which the model fills the image positions of the batch."""
    if not pixels:
        return {}
    return {k: v.repeat(rows, *([1] * (v.dim() - 1))) for k, v in pixels.items()}
