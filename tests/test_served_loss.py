"""The loss against the served distribution (`loss_temperature`, `loss_top_p`): its target is the p~ the
acceptance simulation and vLLM's rejection sampler use, its draft side is what vLLM's probabilistic drafting
draws from, and descending it raises the acceptance rate where speculators' plain KL is already at rest."""

from __future__ import annotations

import pytest
import torch
from test_kernels import _drafts, _packed_row  # the kernel tests' draft and packed row

from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.training import train_metrics
from eagle3_pipeline.models.acceptance import Sampling
from eagle3_pipeline.training.train_metrics import Recipe, forward, served_targets

EAGER = kernels.Kernels("sdpa", "eager", False)
INSTANT = Sampling(0.6, 0.95)  # Kimi-K2.5's instant mode: both knobs move the target


def _logits(positions: int = 40, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, positions, vocab, generator=g) * 2.5


def test_served_targets_are_the_simulations_distribution_chunk_by_chunk(monkeypatch):
    logits = _logits()
    p = INSTANT.probs(logits)  # what acceptance.py simulates and vLLM samples from
    whole = served_targets(logits, INSTANT)
    assert torch.allclose(whole.softmax(-1), p, atol=1e-6)
    dropped = p == 0
    assert dropped.any() and not dropped.all(-1).any()  # the cut dropped tokens, never a whole row
    assert (whole.softmax(-1)[dropped] == 0).all()
    monkeypatch.setattr(train_metrics, "TARGET_CHUNK", 7)  # positions in several chunks, one partial
    assert torch.equal(served_targets(logits, INSTANT), whole)
    assert served_targets(logits.bfloat16(), INSTANT).dtype == torch.bfloat16


def test_the_served_kl_is_kl_from_the_served_target_to_the_drawn_draft():
    draft, verifier = _logits(seed=1), _logits(seed=2)
    (fn, weight), = Recipe(3, 1.0, "kl_div", None, 0.6, 0.95).loss_config(EAGER).values()  # fmt: skip
    p = INSTANT.probs(verifier)
    log_q = (draft / 0.6).log_softmax(-1)  # vLLM draws a probabilistic draft from softmax(z / T)
    expected = (p * (p.clamp_min(1e-30).log() - log_q)).sum(-1)
    assert weight == 1.0
    assert torch.allclose(fn(draft, verifier), expected, rtol=1e-5, atol=1e-6)
    # the plain recipe is speculators' own loss, untouched
    plain = Recipe(3, 1.0, "kl_div").loss_config(EAGER)
    assert plain == kernels.loss_config(EAGER, "kl_div")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_descending_the_served_loss_raises_acceptance_where_plain_kl_rests(temperature):
    """A draft whose logits are the verifier's (plain KL's optimum: its loss and gradient are 0) draws at
    top-p 0.95 tokens vLLM's sampler never accepts. Descending the served loss moves it there; the
    acceptance rate of probabilistic drafting, sum min(p~, q), rises to nearly 1."""
    sampling = Sampling(temperature, 0.95)
    verifier = _logits(positions=64, vocab=200, seed=3)
    p = sampling.probs(verifier)

    def acceptance(z: torch.Tensor) -> float:  # vLLM's rule: x ~ q = softmax(z / T), kept w.p. min(1, p~/q)
        return float(torch.minimum(p, (z / temperature).softmax(-1)).sum(-1).mean())

    def descend(recipe: Recipe) -> torch.Tensor:
        fn, _ = recipe.loss_config(EAGER)["kl_div"]
        z = verifier.clone().requires_grad_(True)
        opt = torch.optim.Adam([z], lr=0.3)
        for _ in range(100):
            opt.zero_grad()
            fn(z, verifier).sum().backward()
            opt.step()
        return z.detach()

    before = acceptance(verifier)
    plain = acceptance(descend(Recipe(3, 1.0, "kl_div")))
    served = acceptance(descend(Recipe(3, 1.0, "kl_div", None, temperature, 0.95)))
    print(f"\nT {temperature}: acceptance per position {before:.3f}, plain KL {plain:.3f}, served {served:.3f}")
    assert abs(plain - before) < 1e-4  # at rest
    assert before < 0.96 and served > 0.99


def test_a_served_recipe_changes_the_training_loss_and_the_plain_one_does_not():
    """Through train_metrics.forward (speculators' Eagle3 forward, TTT unrolled): the served recipe's loss
    differs from the plain one's on the same batch; T 1 / top-p 1 are the plain recipe exactly."""
    (model,) = _drafts("sdpa")
    batch = _packed_row()

    def loss(recipe: Recipe) -> float:
        with torch.no_grad():
            value, _ = forward(model, batch, recipe, torch.device("cpu"), None, EAGER)
        return float(value)

    plain = loss(Recipe(3, 1.0, "kl_div"))
    assert loss(Recipe(3, 1.0, "kl_div", None, 1.0, 1.0)) == plain
    assert abs(loss(Recipe(3, 1.0, "kl_div", None, 1.0, 0.95)) - plain) > 1e-3 * plain
