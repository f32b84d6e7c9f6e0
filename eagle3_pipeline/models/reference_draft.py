"""An exported draft, read and run the way vLLM reads and runs it, in plain PyTorch.

This deliberately does not use the training classes. It follows vLLM's `LlamaForCausalLMEagle3`
(`vllm/model_executor/models/llama_eagle3.py`, summarised in docs/vllm_contract.md):
- head_dim = config["head_dim"], else hidden_size // num_attention_heads; q/k/v/o weights are narrowed
  to that size (first rows / columns) as vLLM's loader does, so a missing head_dim misbehaves here
  exactly as it does there, silently;
- aux layer ids from the top-level `eagle_aux_hidden_state_layer_ids`, else `eagle_config`'s;
- d2t offsets from the file, else zeros (identity) when the draft vocab is smaller;
- the norm flags as vLLM reads them, each default false: norm_before_residual; norm_before_fc
  (eagle_config first, then top level; weight input_norm) and fc_norm (fc_norm.<i>) before fc;
  norm_output (the next step gets norm(out) instead of out); RoPE (neox style) from rope_theta and,
  when config.json has one, its yarn scaling (frequencies and cos/sin factor: core/rope_scaling.py,
  read from `rope_scaling` or `rope_parameters` as vLLM reads them);
- a sliding window when `layer_types` makes the layer sliding (`sliding_window`, llama.py): each slot
  attends to the cached slots within the window of its own index (models/draft_window.py);
- embed_tokens is the verifier's (the export ships none);
- parallel drafting (served with `"parallel_drafting": true`, `llm_base_proposer.py`): `mask_token_id`
  (the first of vLLM's keys, `_init_parallel_drafting_params`) and the `mask_hidden` tensor [1, n_aux*H];
  drafts 2..k come from k-1 extra slots after the last verified one, each the mask token's embedding
  beside combine_hidden_states(mask_hidden), at the next positions, attending causally (`masked_logits`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core import rope_scaling
from eagle3_pipeline.models.draft_window import cache_mask, served_window


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w.float()


def aux_layer_ids_of(config: dict[str, Any]) -> list[int] | None:
    """What vLLM's model runner captures: top-level ids first, then eagle_config.layer-style ids."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else list(ids)


def parallel_config(config: dict[str, Any]) -> bool:
    """A parallel-drafting export: config.json names the masked slots' token (vLLM's `mask_token_id`)."""
    return config.get("mask_token_id") is not None


def _eagle_config_first(c: dict[str, Any], key: str) -> Any:
    """A flag vLLM reads from eagle_config first, then from the top level."""
    return (c.get("eagle_config") or {}).get(key, c.get(key))


def _vocab_maps(c: dict[str, Any], d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t offsets (the file's, else zeros: identity) and target id -> draft id (-1: outside the draft)."""
    draft_vocab = c.get("draft_vocab_size", c["vocab_size"])
    d2t = d2t.long() if d2t is not None else torch.zeros(draft_vocab, dtype=torch.long)
    index = torch.full((c["vocab_size"],), -1, dtype=torch.long)
    index[torch.arange(draft_vocab) + d2t] = torch.arange(draft_vocab)
    return d2t, index


@dataclass
class KVCache:
    k: torch.Tensor  # [heads_kv, T, head_dim], RoPE applied
    v: torch.Tensor

    def truncate(self, n: int) -> KVCache:
        return KVCache(self.k[:, :n], self.v[:, :n])

    def then(self, new: KVCache) -> KVCache:
        """This cache followed by the entries of new slots."""
        return KVCache(torch.cat([self.k, new.k], dim=1), torch.cat([self.v, new.v], dim=1))


def cos_sin(
    positions: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, dim // 2] of each position's angles as vLLM's get_rope computes them, times the
    scaling's cos/sin factor (yarn's mscale; 1 without a scaling)."""
    inv_freq = torch.tensor(rope_scaling.inv_freq(dim, theta, scaling), dtype=torch.float64)
    ang = positions.double()[:, None] * inv_freq[None]
    factor = rope_scaling.cos_sin_factor(scaling)
    return (ang.cos() * factor).float(), (ang.sin() * factor).float()


class ReferenceDraft:
    """fc -> one EAGLE-3 decoder layer -> norm -> lm_head, on float32 copies of the exported weights."""

    def __init__(self, export_dir: Path, embed_tokens: torch.Tensor):
        from safetensors.torch import load_file

        self.config = json.loads((export_dir / "config.json").read_text())
        c = self.config
        self.hidden = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads", self.heads)
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.rope_theta, self.rope_scaling, _ = rope_scaling.served(c)
        self.sliding_window = served_window(c)
        self.norm_before_residual = bool(c.get("norm_before_residual", False))
        self.norm_before_fc = bool(_eagle_config_first(c, "norm_before_fc"))
        self.fc_norm = bool(c.get("fc_norm", False))
        self.norm_output = bool(c.get("norm_output", False))
        self.aux_layer_ids = aux_layer_ids_of(c)
        w = {k: v.float() for k, v in load_file(str(export_dir / "model.safetensors")).items()}
        layer = "midlayer." if any(k.startswith("midlayer.") for k in w) else "layers.0."
        self._load_attention(w, layer)
        self.fc = w["fc.weight"]
        n_aux = self.fc.shape[1] // self.hidden
        ones = torch.ones(self.hidden)  # vLLM's RMSNorm init, kept when a flag's weight is missing
        self.n_input = w.get("input_norm.weight", torch.ones(n_aux * self.hidden))
        self.n_fc = [w.get(f"fc_norm.{i}.weight", ones) for i in range(n_aux)]
        self.w_gate, self.w_up = w[layer + "mlp.gate_proj.weight"], w[layer + "mlp.up_proj.weight"]
        self.w_down = w[layer + "mlp.down_proj.weight"]
        self.n_in, self.n_hidden = w[layer + "input_layernorm.weight"], w[layer + "hidden_norm.weight"]
        self.n_post = w[layer + "post_attention_layernorm.weight"]
        self.n_final, self.lm_head = w["norm.weight"], w["lm_head.weight"]
        self.d2t, self.draft_index = _vocab_maps(c, w.get("d2t"))
        self.embed = embed_tokens.float()
        self.mask_token_id = c.get("mask_token_id") if parallel_config(c) else None
        self.mask_hidden = None if w.get("mask_hidden") is None else w["mask_hidden"].reshape(1, -1)

    @property
    def parallel(self) -> bool:
        """Whether vLLM serves this export with parallel drafting (it has a mask token and mask_hidden)."""
        return self.mask_hidden is not None and self.mask_token_id is not None

    def _load_attention(self, w: dict[str, torch.Tensor], layer: str) -> None:
        """q/k/v/o, narrowed to head_dim as vLLM's loader narrows them."""
        q_rows, kv_rows = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.wq = w[layer + "self_attn.q_proj.weight"][:q_rows]
        self.wk = w[layer + "self_attn.k_proj.weight"][:kv_rows]
        self.wv = w[layer + "self_attn.v_proj.weight"][:kv_rows]
        self.wo = w[layer + "self_attn.o_proj.weight"][:, :q_rows]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary embedding on [heads, T, head_dim]."""
        half = self.head_dim // 2
        cos, sin = cos_sin(positions, self.head_dim, self.rope_theta, self.rope_scaling)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _layer(
        self, g: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> tuple[torch.Tensor, KVCache]:
        """One decoder-layer pass for new slots [T]; they attend to `cache` then causally to themselves."""
        x, hn = attention_input(self, g, tokens)
        residual = hn if self.norm_before_residual else g
        a, new_cache = self._attention(x, positions, cache)
        h1 = a + residual
        m = _rms_norm(h1, self.n_post, self.eps)
        out = (torch.nn.functional.silu(m @ self.w_gate.T) * (m @ self.w_up.T)) @ self.w_down.T + h1
        return out, new_cache

    def _attention(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> tuple[torch.Tensor, KVCache]:
        """Grouped-query attention of new slots x [T, 2H] over `cache` then causally over themselves."""
        T = x.shape[0]
        q = self._rope((x @ self.wq.T).view(T, self.heads, self.head_dim).transpose(0, 1), positions)
        past = 0 if cache is None else cache.k.shape[1]
        new = self._keys_values(x, positions)
        new = new if cache is None else cache.then(new)
        rep = self.heads // self.kv_heads
        kk, vv = new.k.repeat_interleave(rep, 0), new.v.repeat_interleave(rep, 0)
        scores = (q @ kk.transpose(1, 2)) / self.head_dim**0.5
        scores = scores.masked_fill(~cache_mask(past, T, self.sliding_window), float("-inf"))
        a = (scores.softmax(-1) @ vv).transpose(0, 1).reshape(T, self.heads * self.head_dim) @ self.wo.T
        return a, new

    def _keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> KVCache:
        """The cache entries of new slots x [T, 2H]: rotated keys and values [kv_heads, T, head_dim]."""
        k = (x @ self.wk.T).view(-1, self.kv_heads, self.head_dim).transpose(0, 1)
        v = (x @ self.wv.T).view(-1, self.kv_heads, self.head_dim).transpose(0, 1)
        return KVCache(self._rope(k, positions), v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return _rms_norm(out, self.n_final, self.eps) @ self.lm_head.T

    def _carry(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft step receives as g: out, or norm(out) with norm_output."""
        return _rms_norm(out, self.n_final, self.eps) if self.norm_output else out

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """vLLM's combine_hidden_states: optional input_norm / per-layer fc_norm, then fc."""
        x = aux.float()
        if self.norm_before_fc:
            x = _rms_norm(x, self.n_input, self.eps)
        if self.fc_norm:
            chunks = x.chunk(len(self.n_fc), dim=-1)
            x = torch.cat([_rms_norm(ch, w, self.eps) for ch, w in zip(chunks, self.n_fc)], dim=-1)
        return x @ self.fc.T

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_prob(self, logits: torch.Tensor, target_id: int, temperature: float) -> float:
        """q(target_id): vLLM's probabilistic draft distribution, softmax(logits / temperature) over the
        draft vocab placed at its target ids (`compute_logits` fills the rest with -inf; the draft
        ignores top-p and top-k, `compute_probs_and_sample_next_token`). 0 for a token outside it."""
        i = int(self.draft_index[target_id])
        return 0.0 if i < 0 else float((logits.float() / temperature).softmax(-1)[i])

    @torch.no_grad()
    def first_pass(
        self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, query_from: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """Slots t: verifier features at t ([T, n_aux*H], ascending ids), embedding of token t+1, RoPE t;
        outputs and logits from slot `query_from` on only (tail_first_pass)."""
        if min(query_from, aux.shape[0] - 1) > 0:
            return tail_first_pass(self, aux, next_tokens, positions, query_from)
        out, cache = self._layer(self.combine(aux), next_tokens, positions, None)
        return self._carry(out), self.logits(out), cache

    @torch.no_grad()
    def step(
        self, g: torch.Tensor, token: torch.Tensor, position: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """A further draft step: g is what the previous step carried (not passed through fc)."""
        out, cache = self._layer(g, token, position, cache)
        return self._carry(out), self.logits(out), cache

    @torch.no_grad()
    def masked_logits(self, cache: KVCache, last_position: int, k: int) -> torch.Tensor:
        """Parallel drafting's k-1 extra slots after the last verified slot (`cache` holds it and every
        slot before it), at positions last_position + 1 .. + k-1: logits [k-1, draft vocab] of drafts
        2..k. Their tokens and hidden inputs are fixed, so nothing here depends on the drafts before."""
        g = self.combine(self.mask_hidden).expand(k - 1, -1)
        tokens = torch.full((k - 1,), int(self.mask_token_id), dtype=torch.long)
        positions = torch.arange(last_position + 1, last_position + k)
        out, _ = self._layer(g, tokens, positions, cache)
        return self.logits(out)


def attention_input(
    draft: ReferenceDraft, g: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's attention input of new slots, x = cat(input_layernorm(embeds), hidden_norm(g)) [T, 2H],
    and hidden_norm(g) (the residual under norm_before_residual)."""
    hn = _rms_norm(g, draft.n_hidden, draft.eps)
    return torch.cat([_rms_norm(draft.embed[tokens], draft.n_in, draft.eps), hn], dim=-1), hn


def tail_first_pass(
    draft: ReferenceDraft, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, s: int
) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """The first pass with outputs and logits from slot s on (0 < s < T): the slots before get their cache
    entries (the draft's `_keys_values`, what its attention caches), and zero outputs and logits. A causal
    slot's output does not depend on later slots, so those from s on are exact, while the cost is linear
    in the slots before s: a request's rounds read first-pass slots from its prompt's last one on, which
    makes a long prompt's simulation affordable."""
    d = draft
    x, _ = attention_input(d, d.combine(aux[:s]), next_tokens[:s])
    head = d._keys_values(x, positions[:s])
    out, cache = d._layer(d.combine(aux[s:]), next_tokens[s:], positions[s:], head)
    carry, logits = d._carry(out), d.logits(out)
    full_carry = carry.new_zeros(aux.shape[0], carry.shape[1])
    full_logits = logits.new_zeros(aux.shape[0], logits.shape[1])
    full_carry[s:], full_logits[s:] = carry, logits
    return full_carry, full_logits, cache
