"""Parallel drafting (P-EAGLE, vLLM's `"parallel_drafting": true`): the training forward, the export read
back as vLLM reads it, the simulation's proposals and the gate agree on one draft (CPU, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import draft_spec

H, VOCAB, DRAFT_VOCAB, K = 64, 300, 120, 4


def _parallel_draft(tmp_path: Path, **train: object):
    """A parallel draft with random weights rounded to bf16 (what the export holds), exported to tmp_path:
    (model bound to the training forward, spec, export dir, verifier embedding, d2t)."""
    from eagle3_pipeline.export_eval.export import WEIGHTS_FILE, export_config, flat_weights
    from eagle3_pipeline.models.draft import build_draft
    from eagle3_pipeline.training import parallel
    from safetensors.torch import save_file

    settings = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
                    parallel_drafting=True, parallel_k=K, **train)  # fmt: skip
    spec = draft_spec(H, VOCAB, DRAFT_VOCAB, (1, 3, 5), **settings)
    torch.manual_seed(0)
    model = build_draft(spec)
    g = torch.Generator().manual_seed(1)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values] = True
    d2t = t2d.nonzero().flatten() - torch.arange(DRAFT_VOCAB)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.2
            p.copy_((torch.randn(p.shape, generator=g) * scale + (1.0 if scale == 1.0 else 0.0))
                    .to(torch.bfloat16).float())  # fmt: skip
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    parallel.bind(model)
    model.eval()
    out = tmp_path / "draft"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(export_config(spec, {})))
    save_file(flat_weights(dict(model.named_parameters()), d2t, t2d, spec), str(out / WEIGHTS_FILE))
    return model, spec, out, model.embed_tokens.weight.detach().clone(), d2t


def _row(n: int, docs: list[int] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    docs = docs or [n]
    return {
        "hidden_states": torch.randn(1, n, 3 * H, generator=g),
        "input_ids": torch.randint(0, VOCAB, (1, n), generator=g),
        "document_ids": torch.cat([torch.full((m,), i) for i, m in enumerate(docs)])[None],
        "position_ids": torch.cat([torch.arange(m) for m in docs])[None],
        "loss_mask": torch.ones(1, n),
        "verifier_last": torch.randn(1, n, H, generator=g),
    }


def test_training_forward_is_what_vllm_runs_on_the_export(tmp_path):
    """Every rollout of the training forward (a two-document packed row, so positions restart) equals
    the export read under vLLM's rules: first draft from the first pass, drafts 2..k from the masked
    slots after the last verified slot, on the cache of that document only."""
    from eagle3_pipeline.models.reference_draft import ReferenceDraft
    from eagle3_pipeline.training import parallel

    model, spec, out, embed, _ = _parallel_draft(tmp_path)
    ref = ReferenceDraft(out, embed)
    assert ref.parallel and ref.mask_token_id == VOCAB - 1 == spec.mask_token_id
    b = _row(30, docs=[18, 12])
    anchor, depth = parallel.all_rollouts(b["loss_mask"], b["document_ids"], K)
    with torch.no_grad():
        trained = parallel.draft_logits(model, b, anchor, depth)[0]
    checked = 0
    for start, n in ((0, 18), (18, 12)):
        sl = slice(start, start + n)
        _, logits0, cache = ref.first_pass(b["hidden_states"][0, sl], b["input_ids"][0, sl], torch.arange(n))
        for a in range(n - K + 1):
            want = [trained[((anchor == start + a) & (depth == d)).nonzero().item()] for d in range(K)]
            have = torch.cat([logits0[a : a + 1], ref.masked_logits(cache.truncate(a + 1), a, K)])
            torch.testing.assert_close(torch.stack(want), have, atol=2e-4, rtol=2e-4)
            checked += 1
    assert checked == 15 + 9


def test_the_simulation_proposes_the_training_forwards_argmax(tmp_path):
    """acceptance.greedy_proposals on a parallel export: the k drafts of a round are the training
    forward's argmax at anchor n-2, depths 0..k-1, in target ids (a sequential chain would differ)."""
    from eagle3_pipeline.data.vocab import draft_to_target
    from eagle3_pipeline.models.acceptance import greedy_proposals
    from eagle3_pipeline.models.reference_draft import ReferenceDraft
    from eagle3_pipeline.training import parallel

    model, _, out, embed, d2t = _parallel_draft(tmp_path)
    ref = ReferenceDraft(out, embed)
    b = _row(24)
    first = ref.first_pass(b["hidden_states"][0], b["input_ids"][0], torch.arange(24))
    for n in (2, 9, 20):
        anchor = torch.cat([torch.arange(24), torch.full((K - 1,), n - 2)])  # every verified slot + masks
        depth = torch.cat([torch.zeros(24, dtype=torch.long), torch.arange(1, K)])
        with torch.no_grad():
            out = parallel.draft_logits(model, b, anchor, depth)[0]
        logits = torch.cat([out[n - 2 : n - 1], out[24:]])
        assert greedy_proposals(ref, first, n, K) == draft_to_target(logits.argmax(-1), d2t).tolist()


def test_validation_metrics_count_accepted_prefixes():
    """full_acc_d: depths 0..d all right (what acceptance needs); cond_acc_d: d right given 0..d-1."""
    from eagle3_pipeline.training.parallel import prefix_metrics

    anchor = torch.tensor([0, 1, 2, 0, 1, 0])
    depth = torch.tensor([0, 0, 0, 1, 1, 2])
    correct = torch.tensor([True, False, True, True, True, True])
    scored = torch.ones(6, dtype=torch.bool)
    m = {k: int(v) for k, v in prefix_metrics(correct, scored, anchor, depth, 3, 3).items()}
    assert (m["full_acc_0_sum"], m["full_acc_0_total"]) == (2, 3)
    assert (m["full_acc_1_sum"], m["full_acc_1_total"]) == (1, 2)  # anchor 1: depth 1 right, depth 0 wrong
    assert (m["cond_acc_1_sum"], m["cond_acc_1_total"]) == (1, 1)
    assert (m["full_acc_2_sum"], m["full_acc_2_total"]) == (1, 1)


def test_cod_training_rollouts_stay_in_their_document_and_are_nested():
    """Training samples rollouts with speculators' COD; a rollout's earlier depths are always present
    and every anchor is a real slot."""
    from eagle3_pipeline.training.parallel import sampled_rollouts

    torch.manual_seed(0)
    lm = torch.ones(1, 200)  # loss at position 0 too: speculators would start a rollout at anchor -1
    anchor, depth = sampled_rollouts(lm, 5, 0.7, 0.2)
    have = set(zip(anchor.tolist(), depth.tolist()))
    assert all((a, d - 1) in have for a, d in have if d > 0) and int(anchor.min()) == 0
    counts = [int((depth == d).sum()) for d in range(5)]
    assert counts[0] == 200 and 100 < counts[1] < 200 and counts[4] >= 1


def test_training_learns_the_masked_slots(tmp_path):
    """A few optimizer steps on one row raise the masked depths' accuracy: mask_hidden and the layer
    learn, through the same forward the trainer calls (loss decreases)."""
    from speculators.losses.utils import resolve_loss_config

    model, *_ = _parallel_draft(tmp_path)
    model.train()
    b = _row(40)
    with torch.no_grad():  # a learnable teacher: the verifier's head on its own states
        b["verifier_last"] = b["hidden_states"][..., :H] * 3
    frozen = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
    params = [p for n, p in model.named_parameters() if n not in frozen]
    opt = torch.optim.AdamW(params, lr=3e-3)
    lc = resolve_loss_config("kl_div", "eager")
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss, _ = model(b, K, (1.0, 1.0), lc)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert model.mask_hidden.grad is not None and model.mask_hidden.grad.abs().sum() > 0
    assert losses[-1] < 0.7 * losses[0]


def test_the_compiled_forward_trains_as_the_plain_one_at_every_row_length(tmp_path):
    """bind(compiled=True), what CUDA's default kernels take (uncompiled, flex would run the reference path
    that materialises [heads, E, E] scores): the losses and gradients of the plain forward (sdpa here), and
    no new graph for rows whose rollout counts E differ from the first row's (dynamic shapes)."""
    from speculators.losses.utils import resolve_loss_config
    from torch._dynamo.utils import counters

    from eagle3_pipeline.training import parallel

    model, *_ = _parallel_draft(tmp_path)
    model.train()
    lc = resolve_loss_config("kl_div", "eager")
    runs: dict[bool, list] = {}
    graphs = []
    for compiled in (False, True):
        parallel.bind(model, compiled=compiled)
        counters.clear()
        runs[compiled] = []
        for n, docs in ((40, [40]), (29, [13, 16]), (52, [52])):
            model.zero_grad()
            loss, _ = model(_row(n, docs), K, None, lc)  # every rollout: the same elements both times
            loss.backward()
            runs[compiled].append(
                (loss.detach(), model.mask_hidden.grad.clone(), model.fc.weight.grad.clone())
            )
            graphs.append(counters["stats"]["unique_graphs"])
    for plain, comp in zip(runs[False], runs[True], strict=True):
        for a, b in zip(plain, comp, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert graphs[:3] == [0, 0, 0] and graphs[3] > 0 and graphs[3:] == [graphs[3]] * 3, graphs


@pytest.mark.parametrize("broken", ["mask_token_id", "mask_hidden"])
def test_gate_refuses_a_parallel_export_missing_its_key(tmp_path, broken):
    from eagle3_pipeline.export_eval.export import static_problems
    from safetensors.torch import load_file

    _, spec, out, _, d2t = _parallel_draft(tmp_path)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    expect = {"draft": spec.to_json(), "d2t": d2t}
    assert static_problems(config, tensors, expect) == []
    assert tuple(tensors["mask_hidden"].shape) == (1, 3 * H)
    if broken == "mask_token_id":
        del config["mask_token_id"]
    else:
        del tensors["mask_hidden"]
    problems = static_problems(config, tensors, expect)
    assert len(problems) == 1 and problems[0].startswith(f"{broken} missing"), problems


def test_serve_line_turns_parallel_drafting_on(tmp_path):
    from eagle3_pipeline.export_eval.export import serve_line
    from eagle3_pipeline.vllm_side.vllm_engine import generate_fields, parallel_export

    _, _, out, _, _ = _parallel_draft(tmp_path)
    line = serve_line(str(tmp_path), out, 4, tensor_parallel_size=8, parallel_drafting=True)
    spec = json.loads(line.split("--speculative-config '")[1].rstrip("'"))
    assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 4
    assert parallel_export(out)
    assert generate_fields(tmp_path, out, [[1]], 4, 4, False)["parallel_drafting"] is True
    assert "parallel_drafting" not in serve_line(str(tmp_path), out, 4, tensor_parallel_size=8)


def test_mask_token_outside_the_vocabulary_is_one_clear_error():
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.models.draft import check_spec

    spec = draft_spec(H, VOCAB, DRAFT_VOCAB, (1, 3, 5), num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=128, parallel_drafting=True,
                      mask_token_id=VOCAB)  # fmt: skip
    with pytest.raises(UserError, match="--mask-token-id 300 is outside"):
        check_spec(spec)
