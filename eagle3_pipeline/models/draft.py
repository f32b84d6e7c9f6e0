"""The EAGLE-3 draft: speculators' Eagle3DraftModel with a decoder config built field by field.

Two decoder layers ([train] draft_arch, core/config.py DRAFT_ARCHS): llama (a LlamaConfig, vLLM's
llama_eagle3.py) and mla (a DeepseekV3Config, vLLM's deepseek_eagle3.py; models/mla_draft.py). The MLA
dims come from the verifier's config.json unless [train] sets them (`mla_dims`).

Nothing is inherited from the verifier's config except hidden size, vocabulary size and norm epsilon:
speculators 0.9.0 would take head_dim 64 from a native `kimi_k25` config (qk_rope_head_dim) and 112
from the remote-code one, while the draft trains and serves with head_dim 128 (contract item 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from eagle3_pipeline.core import rope_scaling
from eagle3_pipeline.models.draft_shape import check_draft_shape
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models import draft_window, linear_memory, mla_draft


@dataclass(frozen=True)
class DraftSpec:
    """Every number that fixes the draft's tensors and maths; recorded in checkpoints and the export."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool
    hidden_act: str = "silu"
    # The other norm flags vLLM >= 0.32 honours (llama_eagle3.py); all false is the plain EAGLE-3 layout.
    norm_before_fc: bool = False  # RMSNorm over concat(aux) before fc (weight input_norm.weight)
    fc_norm: bool = False  # RMSNorm per aux state before fc (fc_norm.<i>.weight); excludes norm_before_fc
    norm_output: bool = False  # the next draft step gets norm(out) instead of out
    # draft_arch "mla" (mla_draft.py): the latent attention's dims; unused (0) by the llama layer, whose
    # num_key_value_heads / head_dim the MLA layer ignores. q_lora_rank 0: a plain q_proj.
    draft_arch: str = "llama"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Parallel drafting (P-EAGLE): the masked slots' token id (exported as vLLM's `mask_token_id`) and the
    # depths trained; None: a sequential EAGLE-3 draft. The draft then holds `mask_hidden` [1, 1, n_aux*H].
    mask_token_id: int | None = None
    parallel_k: int | None = None
    # The RoPE scaling trained with (core/rope_scaling.py's canonical yarn table); None: plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    # The attention window trained with (draft_window.py: vLLM's rule); None: full attention.
    sliding_window: int | None = None

    @property
    def parallel(self) -> bool:
        return self.mask_token_id is not None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        if not self.parallel:  # a sequential draft records what it always did
            del d["mask_token_id"], d["parallel_k"]
        if self.rope_scaling is None:  # plain RoPE: recorded as runs before the setting were
            del d["rope_scaling"]
        if self.sliding_window is None:  # full attention: recorded as runs before the setting were
            del d["sliding_window"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DraftSpec:
        return cls(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})


def spec_for_training(
    train: Any, verifier: dict[str, Any], draft_vocab_size: int, aux_layer_ids: Any
) -> DraftSpec:
    """The draft a training run builds (stage 04) and its plan sizes: the shapes and norm flags of the
    `[train]` settings `train`, and only hidden size, vocabulary size and norm epsilon of the verifier
    (for an MLA draft also the verifier's MLA dims that [train] leaves unset, and for rope_scaling
    "verifier" the verifier's rope scaling: `verifier` is then its text config.json)."""
    arch = getattr(train, "draft_arch", "llama")
    return DraftSpec(
        **(mla_dims(train, verifier) if arch == "mla" else {}),
        draft_arch=arch,
        hidden_size=int(verifier["hidden_size"]),
        num_attention_heads=train.num_attention_heads,
        num_key_value_heads=train.num_key_value_heads,
        head_dim=train.head_dim,
        intermediate_size=train.intermediate_size,
        rms_norm_eps=float(verifier["rms_norm_eps"]),
        rope_theta=train.rope_theta,
        max_position_embeddings=train.max_position_embeddings,
        vocab_size=int(verifier["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=tuple(aux_layer_ids),
        norm_before_residual=train.norm_before_residual,
        norm_before_fc=train.norm_before_fc,
        fc_norm=train.fc_norm,
        norm_output=train.norm_output,
        **parallel_settings(train, int(verifier["vocab_size"])),
        rope_scaling=rope_scaling.resolve(getattr(train, "rope_scaling", rope_scaling.NONE), verifier),
        sliding_window=getattr(train, "sliding_window", None),
    )


def parallel_settings(train: Any, vocab_size: int) -> dict[str, Any]:
    """DraftSpec's mask_token_id and parallel_k from `[train]` (none for a sequential draft); the mask
    token defaults to the verifier's last id (Kimi-K2.5's are reserved special tokens)."""
    if not getattr(train, "parallel_drafting", False):
        return {}
    mask = train.mask_token_id if train.mask_token_id is not None else vocab_size - 1
    return {"mask_token_id": int(mask), "parallel_k": int(train.parallel_k)}


MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_dims(train: Any, verifier: dict[str, Any]) -> dict[str, int]:
    """Each MLA dim: [train] mla_<dim> when set, else the verifier's config.json value (q_lora_rank null
    there: 0, a plain q_proj); a dim neither gives is refused, naming the flag."""
    out = {}
    for dim in MLA_DIMS:
        value = getattr(train, f"mla_{dim}", None)
        if value is None:
            if dim not in verifier or (verifier[dim] is None and dim != "q_lora_rank"):
                raise UserError(
                    f"--draft-arch mla: the verifier's config.json has no `{dim}` (not an MLA verifier); "
                    f"set --mla-{dim.replace('_', '-')}"
                )
            value = verifier[dim] or 0
        out[dim] = int(value)
    return out


def check_spec(spec: DraftSpec) -> None:
    """The [train] rules of the draft's shape (config.check_draft_shape), for a spec read back from a
    checkpoint or built in code; a TrainConfig refuses the same when it is built. Checked here only: the
    mask token (only the verifier's vocabulary says which ids exist) and the MLA rope dim (from the
    verifier unless set)."""
    check_draft_shape(spec)
    if spec.rope_scaling is not None:
        rope_scaling.canonical(spec.rope_scaling, "the draft's rope_scaling")
    if spec.draft_arch == "mla" and spec.qk_rope_head_dim % 2:
        raise UserError(f"--mla-qk-rope-head-dim {spec.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if spec.parallel and not 0 <= spec.mask_token_id < spec.vocab_size:
        raise UserError(
            f"--mask-token-id {spec.mask_token_id} is outside the verifier's vocabulary "
            f"(0..{spec.vocab_size - 1})"
        )


def layer_fields(spec: DraftSpec) -> dict[str, Any]:
    """The decoder-layer config fields both draft kinds share (one layer, no biases); the RoPE as
    transformers 5 reads it (`rope_parameters`: plain, or yarn with its mscale, which the MLA layer
    also applies to its softmax scale)."""
    return {
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": 1,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": spec.hidden_act,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {**(spec.rope_scaling or {"rope_type": "default"}), "rope_theta": spec.rope_theta},
    }


def decoder_config(spec: DraftSpec, attn_impl: str) -> Any:
    from transformers import LlamaConfig

    window = spec.sliding_window  # the layer's window, as speculators' layer config and vLLM read it
    windowed = {} if window is None else {"layer_types": draft_window.layer_types_of(window),
                                          "sliding_window": window}  # fmt: skip
    cfg = LlamaConfig(
        **layer_fields(spec),
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        mlp_bias=False,
        **windowed,
    )
    cfg._attn_implementation = attn_impl
    if cfg.head_dim != spec.head_dim:  # guard against any library default creeping back in
        raise RuntimeError(f"decoder config head_dim {cfg.head_dim} != {spec.head_dim}")
    return cfg


def rope_parameters_of(model: Any) -> dict[str, Any]:
    """The RoPE the built draft rotates with, as transformers holds it (theta, and the scaling when
    any): recorded in each checkpoint.json; stage 05 refuses a checkpoint whose record differs."""
    return dict(model.config.transformer_layer_config.rope_parameters)


def build_draft(spec: DraftSpec, attn_impl: str = "sdpa") -> Any:
    """An Eagle3DraftModel on the current default device (use `torch.device('meta')` for shapes only)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    check_spec(spec)
    if attn_impl == linear_memory.BLOCKWISE_ATTN:
        linear_memory.register()
    # A parallel draft is speculators' PEagleDraftModel (Eagle3DraftModel + the mask_hidden parameter);
    # its forward is training/parallel.py's, which samples as speculators does and runs vLLM's layout.
    cls, config_cls = (PEagleDraftModel, PEagleSpeculatorConfig) if spec.parallel else (
        Eagle3DraftModel, Eagle3SpeculatorConfig)  # fmt: skip
    extra = {"mask_token_id": spec.mask_token_id, "embed_requires_grad": False} if spec.parallel else {}
    if spec.draft_arch == "mla":
        mla_draft.register()
        layer_config = mla_draft.mla_decoder_config(spec, attn_impl, layer_fields(spec))
    else:
        layer_config = decoder_config(spec, attn_impl)
    config = config_cls(
        **extra,
        transformer_layer_config=layer_config,
        draft_vocab_size=spec.draft_vocab_size,
        norm_before_residual=spec.norm_before_residual,
        norm_before_fc=spec.norm_before_fc,
        fc_norm=spec.fc_norm,
        norm_output=spec.norm_output,
        eagle_aux_hidden_state_layer_ids=list(spec.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="peagle" if spec.parallel else "eagle3",
            default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    return cls(config)


def attach_verifier_tensors(
    model: Any, tensors: dict[str, torch.Tensor], t2d: torch.Tensor, d2t: torch.Tensor
) -> None:
    """Shared embedding, teacher head/norm and the draft lm_head (the verifier's rows for the draft vocab)."""
    spec_vocab, hidden = model.embed_tokens.weight.shape
    if tuple(tensors["embed_tokens"].shape) != (spec_vocab, hidden):
        raise UserError(
            f"verifier embed_tokens has shape {tuple(tensors['embed_tokens'].shape)}, the draft "
            f"expects {(spec_vocab, hidden)}"
        )
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["embed_tokens"].float())
        rows = tensors["lm_head"].float()[t2d]
        model.lm_head.weight.copy_(rows)
        model.verifier_lm_head.weight.copy_(rows)
        model.verifier_norm.weight.copy_(tensors["norm"].float())
        if model.d2t is not None:  # speculators keeps no mapping when the draft has the full vocab
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)


def trainable_names(model: Any, train_lm_head: bool) -> list[str]:
    """fc, the decoder layer and the final norm; lm_head too when asked. Never the verifier's tensors."""
    frozen = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    if not train_lm_head:
        frozen.add("lm_head.weight")
    return [n for n, _ in model.named_parameters() if n not in frozen]
