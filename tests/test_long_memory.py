"""Training memory linear in the row's length: blockwise TTT attention and the chunked head and loss
(models/linear_memory.py) compute what speculators' forward computes, without [L, L] or [L, vocab]."""

from __future__ import annotations

import pytest
import torch
from conftest import draft_spec
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models import linear_memory
from eagle3_pipeline.models.draft import build_draft
from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.training.train_metrics import Recipe, forward

PLAIN_NORMS = dict(norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False)
DRAFT_VOCAB = 50  # no other dimension of these drafts is 50: a tensor with this dim is a logits tensor
SPECS = {
    "llama": draft_spec(64, 200, DRAFT_VOCAB, (1, 2, 3), num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, intermediate_size=128, rope_theta=1e4, max_position_embeddings=2048,
                        **PLAIN_NORMS),
    "mla": draft_spec(64, 200, DRAFT_VOCAB, (1, 2, 3), num_attention_heads=4, intermediate_size=128,
                      rope_theta=1e4, max_position_embeddings=2048, draft_arch="mla", mla_q_lora_rank=0,
                      mla_kv_lora_rank=32, mla_qk_nope_head_dim=16, mla_qk_rope_head_dim=8,
                      mla_v_head_dim=24, **{**PLAIN_NORMS, "norm_output": True}),
}  # fmt: skip
DOCS = (100, 120, 17, 63)  # four documents, then 20 tokens of padding (document id -1)
PAD = 20
L = sum(DOCS) + PAD
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks far shorter than the row and than its documents: every chunk boundary case is met."""
    monkeypatch.setattr(linear_memory, "ATTN_CHUNK", 64)
    monkeypatch.setattr(linear_memory, "LOSS_CHUNK", 48)


def _row(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(DOCS)
    return {
        "hidden_states": torch.randn(1, L, 3 * 64, generator=g),
        "input_ids": torch.randint(0, 200, (1, L), generator=g),
        "verifier_last": torch.randn(1, L, 64, generator=g),
        "loss_mask": torch.cat([torch.rand(sum(DOCS), generator=g) < 0.8, torch.zeros(PAD) > 0])[None],
        "document_ids": torch.cat([torch.arange(4).repeat_interleave(lengths), torch.full((PAD,), -1)])[None],
        "position_ids": torch.cat([torch.arange(n) for n in (*DOCS, PAD)])[None],
    }  # fmt: skip


def _step(arch: str, attn: str, loss_impl: str, recipe: Recipe):
    """(loss, metrics, gradients) of one forward + backward through train_metrics.forward, with the same
    random weights whatever the kernels (heads at std 0.3: logits far from uniform, losses far from 0)."""
    torch.manual_seed(0)
    model = build_draft(SPECS[arch], attn_impl=kernels.HF_ATTN_NAMES[attn])
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:  # norms keep weight 1
                torch.nn.init.normal_(p, std=0.3 if p.shape[0] == DRAFT_VOCAB else 0.05)
    kern = kernels.Kernels(attn, loss_impl, False)
    value, metrics = forward(model, _row(), recipe, CPU, None, kern)
    value.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return value.detach(), metrics, grads


def _assert_same_step(new, ref, rtol: float) -> None:
    assert ref[0] > 0.1
    torch.testing.assert_close(new[0], ref[0], rtol=rtol, atol=0)
    assert set(new[1]) == set(ref[1])
    for key in ref[1]:
        torch.testing.assert_close(new[1][key].float(), ref[1][key].float(), rtol=rtol, atol=0, msg=key)
    assert set(new[2]) == set(ref[2]) and len(ref[2]) > 5
    for name, g in ref[2].items():  # relative to the tensor's largest gradient
        assert (new[2][name] - g).abs().max() <= rtol * g.abs().max(), name


def test_the_linear_memory_loop_with_speculators_mask_and_loss_is_its_forward_bit_for_bit():
    """ttt_forward with the dense mask and compute_metrics equals Eagle3DraftModel.forward exactly: the
    loop outside speculators is its loop (norms, cache, teacher forcing, positions, metrics)."""
    recipe = Recipe(3, 0.8, "kl_div")
    ref = _step("llama", "sdpa", "eager", recipe)
    torch.manual_seed(0)
    model = build_draft(SPECS["llama"], attn_impl="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:  # norms keep weight 1
                torch.nn.init.normal_(p, std=0.3 if p.shape[0] == DRAFT_VOCAB else 0.05)
    config = recipe.loss_config(kernels.Kernels("sdpa", "eager", False))
    value, metrics = linear_memory.ttt_forward(model, _row(), 3, 0.8, config, False, False)
    value.backward()
    assert torch.equal(value.detach(), ref[0])
    assert {k: v.tolist() for k, v in metrics.items()} == {k: v.tolist() for k, v in ref[1].items()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, ref[2][name]), name


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_blockwise_attention_gives_the_dense_masks_loss_and_gradients(arch):
    """Packed documents, padding, chunks that straddle documents, three TTT steps; GQA (llama) and
    MLA's different key and value widths: fp32 within 1e-5 relative of sdpa under speculators' mask."""
    recipe = Recipe(3, 0.8, "kl_div")
    _assert_same_step(_step(arch, "blockwise", "eager", recipe), _step(arch, "sdpa", "eager", recipe), 1e-5)


@pytest.mark.parametrize(
    "recipe",
    [Recipe(3, 0.8, "kl_div"), Recipe(3, 1.0, "ce"), Recipe(2, 0.9, '{"kl_div": 0.5, "ce": 0.5}'),
     Recipe(3, 1.0, "kl_div", loss_temperature=0.7, loss_top_p=0.9)],
    ids=["kl_div", "ce", "json", "served"],
)  # fmt: skip
def test_the_chunked_loss_gives_the_eager_loss_metrics_and_gradients(recipe):
    """kl_div against the verifier, ce on its argmax, a weighted mix (per-term metrics), and a served
    distribution (temperature, top-p): the same loss, accuracy counts and gradients as the eager loss."""
    _assert_same_step(
        _step("llama", "blockwise", "chunked", recipe), _step("llama", "blockwise", "eager", recipe), 1e-5
    )


class _Shapes(TorchDispatchMode):
    """The shape of every tensor any op makes, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def _dense(shapes: set[tuple[int, ...]]) -> dict[str, list]:
    """Shapes with two dims of at least the row's length ([L, L], [L, k L]) or one such dim beside the
    draft vocabulary ([L, draft vocab])."""
    return {
        "row_by_row": sorted(s for s in shapes if sum(d >= L for d in s) >= 2),
        "row_by_vocab": sorted(s for s in shapes if any(d >= L - 3 for d in s) and DRAFT_VOCAB in s),
    }


def test_a_linear_memory_step_makes_no_row_by_row_or_row_by_vocab_tensor():
    """Every tensor of a training step (forward and backward), watched at the dispatcher: with blockwise
    and chunked none is [L, L], [L, k L] or [L, draft vocab]; today's sdpa + eager makes both kinds."""
    recipe = Recipe(3, 0.8, "kl_div")
    found = {}
    for attn, loss in (("sdpa", "eager"), ("blockwise", "chunked")):
        with _Shapes() as mode:
            _step("llama", attn, loss, recipe)
        found[attn] = _dense(mode.shapes)
    assert found["sdpa"]["row_by_row"] and found["sdpa"]["row_by_vocab"]
    assert found["blockwise"] == {"row_by_row": [], "row_by_vocab": []}


def test_the_kernel_policy_runs_blockwise_and_chunked_uncompiled_and_keeps_auto():
    for device in (CPU, torch.device("cuda")):
        k = kernels.resolve("blockwise", "chunked", "auto", device, 4096)
        assert (k.attn_impl, k.loss_impl, k.compile, k.pad_multiple, k.linear_memory) == (
            "blockwise", "chunked", False, 1, True)  # fmt: skip
        assert k.hf_attn_impl == linear_memory.BLOCKWISE_ATTN
    assert not kernels.resolve("auto", "auto", "auto", CPU, 4096).linear_memory
    with pytest.raises(UserError, match="compile on"):
        kernels.resolve("sdpa", "chunked", "on", CPU, 4096)
    assert kernels.attention_extra_terms("blockwise", 65536, 3, 64, 2)["saved_for_backward"] == 0


def test_the_document_mask_sees_what_speculators_mask_sees():
    """DocumentMask's chunk masks, laid out at their keys, are speculators' dense [L, 3 L] mask."""
    from speculators.models.eagle3.attention import create_combined_mask_mod
    from speculators.models.eagle3.attention import extend_dense_mask_for_draft_tokens as extend
    from torch.nn.attention.flex_attention import create_mask

    doc = _row()["document_ids"][0]
    dense = create_mask(create_combined_mask_mod(doc, L), None, None, L, L, device="cpu")
    for _ in range(2):
        dense = extend(dense, L)
    mask, rebuilt = linear_memory.DocumentMask.of(doc), torch.zeros(L, 3 * L, dtype=torch.bool)
    for a, b, lo in mask.chunks(64):
        cols = torch.cat([torch.arange(lo, b), *[torch.arange(s * L + a, s * L + b) for s in (1, 2)]])
        rebuilt[a:b, cols] = mask.chunk_mask(a, b, lo, 3)
    assert torch.equal(rebuilt, dense[0, 0])
