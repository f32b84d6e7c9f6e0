"""Stage 05: write the vLLM flat EAGLE-3 format and refuse any export vLLM would load but run wrong.

Every silent failure mode of docs/vllm_contract.md section 3 is either made
impossible by construction or caught by `gate` (which also runs on any folder: `05_export.py --check`):
head_dim explicit and equal to training's; aux ids at top level and in eagle_config, equal to the
extraction's; d2t int64 offsets equal to the vocab mapping; norm flags explicit; no `model.` prefix,
no biases, no embed_tokens; every tensor's shape derived from the config; model_type llama; rope theta
and scaling as trained (export_rope.py). Finally the export is read back under vLLM's rules
(reference_draft.py, export_readback.py) and must reproduce the trained draft's logits on stored samples
(its tolerance there), a scaled draft's also at positions past its original length.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.training import checkpoint, kernel_policy
from eagle3_pipeline.core import storage
from eagle3_pipeline.export_eval.config import ExportConfig
from eagle3_pipeline.core.config import provenance
from eagle3_pipeline.models.draft import DraftSpec, attach_verifier_tensors, build_draft, rope_parameters_of
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.core.output import StageOutput
from eagle3_pipeline.models.reference_draft import aux_layer_ids_of, parallel_config
from eagle3_pipeline.data.shards import load_sample, open_shards
from eagle3_pipeline.models.verifier import check_verifier, draft_tensors_of
from eagle3_pipeline.data.vocab import load_mapping
from eagle3_pipeline.export_eval.export_rope import (
    check_checkpoint_rope, rope_config_problems,
)
from eagle3_pipeline.export_eval.export_readback import readback_problems
from eagle3_pipeline.export_eval import export_window as window
from eagle3_pipeline.export_eval.export_mla import (
    mla_attention_shapes,
    mla_config_fields,
    mla_config_problems,
)

log = logging.getLogger("eagle3.export")

WEIGHTS_FILE = "model.safetensors"
EXPORT_META = "export_meta.json"
# Norm flags vLLM reads from the draft config, each defaulting to false when absent (vLLM 0.32
# llama_eagle3.py; norm_before_residual since EAGLE-3 support, the other three are read by 0.32, the
# oldest version this project serves with): every one is written explicitly and checked.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from config.json alone (contract section 2)."""
    H = config["hidden_size"]
    inter = config["intermediate_size"]
    n_aux = len(config["eagle_aux_hidden_state_layer_ids"])
    dv, v = config["draft_vocab_size"], config["vocab_size"]
    if "kv_lora_rank" in config:  # an MLA draft (export_mla.py)
        attention = mla_attention_shapes(config)
    else:
        hd = config["head_dim"]
        q = config["num_attention_heads"] * hd
        kv = config["num_key_value_heads"] * hd
        attention = {
            "midlayer.self_attn.q_proj.weight": (q, 2 * H),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
            "midlayer.self_attn.o_proj.weight": (H, q),
        }
    shapes = {
        "fc.weight": (H, n_aux * H),
        **attention,
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (dv, H),
    }
    if config.get("norm_before_fc"):
        shapes["input_norm.weight"] = (n_aux * H,)
    if config.get("fc_norm"):
        shapes.update({f"fc_norm.{i}.weight": (H,) for i in range(n_aux)})
    if parallel_config(config):  # parallel drafting: vLLM's mask_hidden buffer
        shapes["mask_hidden"] = (1, n_aux * H)
    if dv != v:
        shapes["d2t"] = (dv,)
        shapes["t2d"] = (v,)
    return shapes


def export_config(spec: DraftSpec, verifier_cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json for vLLM: every field that vLLM would otherwise default or guess, stated."""
    ids = list(spec.aux_layer_ids)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "dtype": "bfloat16",
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": 1,
        "hidden_act": spec.hidden_act,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,  # null: plain RoPE (export_rope.py)
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": verifier_cfg.get("bos_token_id"),
        "eos_token_id": verifier_cfg.get("eos_token_id"),
        "eagle_aux_hidden_state_layer_ids": ids,
        # vLLM reads norm_before_fc from eagle_config first, then the top level: both, equal
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
            "norm_before_fc": spec.norm_before_fc,
        },
        **{k: getattr(spec, k) for k in NORM_FLAGS},
        # parallel drafting: the first key vLLM reads for the masked slots' token (llm_base_proposer.py)
        **({"mask_token_id": spec.mask_token_id} if spec.parallel else {}),
        **window.window_config_fields(spec.sliding_window),  # export_window.py
    }
    if spec.draft_arch == "mla":  # no head_dim: vLLM's MLA reads the qk/v dims (export_mla.py)
        config.pop("head_dim")
        config.update(mla_config_fields(spec))
    return config


def flat_weights(
    weights: dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor, spec: DraftSpec
) -> dict[str, torch.Tensor]:
    """speculators names (`layers.0.*`) -> vLLM flat names (`midlayer.*`), bf16, + d2t/t2d."""
    out = {}
    for name, t in weights.items():
        if name in ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"):
            continue
        flat = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
        if name == "mask_hidden":  # speculators' [1, 1, n_aux*H] parameter; vLLM's buffer is [1, n_aux*H]
            t = t.reshape(1, -1)
        out[flat] = t.detach().to(torch.bfloat16).contiguous()
    if spec.draft_vocab_size != spec.vocab_size:
        out["d2t"] = d2t.to(torch.int64)
        out["t2d"] = t2d.to(torch.bool)
    return out


def static_problems(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], expect: dict[str, Any]
) -> list[str]:
    """Contract checks on config.json + tensors against what training did (`expect`)."""
    p = _config_problems(config, expect["draft"])
    if p:  # shapes need a sane config
        return p
    return _tensor_problems(config, tensors, expect)


def _config_problems(config: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """config.json against the trained draft's spec: what vLLM reads and would get wrong silently."""
    p: list[str] = []
    if spec.get("draft_arch", "llama") == "mla":
        p += mla_config_problems(config, spec)
    elif config.get("architectures") != ["LlamaForCausalLMEagle3"] or config.get("model_type") != "llama":
        p.append(
            "architectures must be [LlamaForCausalLMEagle3] with model_type llama (deepseek_v3 would be "
            "rewritten into an MTP draft)"
        )
    if spec.get("draft_arch", "llama") == "mla":
        pass  # MLA: the head widths are the qk/v dims checked above
    elif "head_dim" not in config:
        p.append(
            f"head_dim missing: vLLM would use hidden_size // num_attention_heads = "
            f"{config.get('hidden_size', 0) // max(config.get('num_attention_heads', 1), 1)} and narrow the "
            f"trained {spec['head_dim']}-wide heads silently"
        )
    elif config["head_dim"] != spec["head_dim"]:
        p.append(f"head_dim {config['head_dim']} != trained {spec['head_dim']}")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is None or nested is None:
        p.append("eagle_aux_hidden_state_layer_ids must be written at top level and in eagle_config")
    elif top != nested:
        p.append(f"aux layer ids differ: top level {top} vs eagle_config {nested}")
    if aux_layer_ids_of(config) != list(spec["aux_layer_ids"]):
        p.append(
            f"aux layer ids {aux_layer_ids_of(config)} != {list(spec['aux_layer_ids'])} used at extraction "
            "(vLLM convention: id i = HF hidden_states[i])"
        )
    for key in (
        "hidden_size",
        "num_attention_heads",
        *(() if spec.get("draft_arch", "llama") == "mla" else ("num_key_value_heads",)),
        "intermediate_size",
        "vocab_size",
        "draft_vocab_size",
        "rope_theta",
        "rms_norm_eps",
    ):
        if config.get(key) != spec[key]:
            p.append(f"{key} {config.get(key)!r} != trained {spec[key]!r}")
    for key in NORM_FLAGS:
        if key not in config:
            p.append(
                f"{key} missing: vLLM would take false; the draft was trained with {spec.get(key, False)}"
            )
        elif config[key] != spec.get(key, False):
            p.append(f"{key} {config[key]!r} != trained {spec.get(key, False)!r}")
    nested_fc = (config.get("eagle_config") or {}).get("norm_before_fc")
    if nested_fc is not None and nested_fc != config.get("norm_before_fc"):
        p.append(f"eagle_config.norm_before_fc {nested_fc!r} != top-level {config.get('norm_before_fc')!r}")
    p += rope_config_problems(config, spec) + window.window_config_problems(config, spec)
    trained_mask = spec.get("mask_token_id")
    if trained_mask is not None and config.get("mask_token_id") is None:
        p.append(
            f"mask_token_id missing: a parallel draft (trained with mask token {trained_mask}) that vLLM "
            "cannot serve with parallel_drafting (no mask_token_id / pard_token in config.json)"
        )
    elif config.get("mask_token_id") != trained_mask:
        p.append(f"mask_token_id {config.get('mask_token_id')!r} != trained {trained_mask!r}")
    return p


def _tensor_problems(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], expect: dict[str, Any]
) -> list[str]:
    """The tensors against the shapes a sane config.json gives and the vocab mapping trained with."""
    p: list[str] = []
    shapes = expected_shapes(config)
    for name in tensors:
        if name.startswith("model."):
            p.append(f"{name}: `model.` prefix (vLLM expects flat names)")
        elif name.endswith(".bias"):
            p.append(f"{name}: bias tensors are dropped silently by vLLM")
        elif name == "embed_tokens.weight":
            p.append("embed_tokens shipped: vLLM shares the verifier's; omit it")
        elif name not in shapes:
            p.append(f"{name}: unexpected tensor")
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            why = {
                "d2t": " (vLLM keeps d2t at zeros: every draft token maps to the wrong target token)",
                "mask_hidden": " (vLLM refuses to load a parallel draft without it: llama_eagle3.py)",
            }
            p.append(f"{name} missing{why.get(name, '')}")
        elif tuple(t.shape) != shape:
            p.append(f"{name}: shape {tuple(t.shape)} != {shape} from config.json")
        elif name == "d2t" and t.dtype != torch.int64:
            p.append(f"d2t dtype {t.dtype}, must be int64 offsets")
        elif name not in ("d2t", "t2d") and t.dtype != torch.bfloat16:
            p.append(f"{name}: dtype {t.dtype}, export is bfloat16")
    for name, t in tensors.items():  # vLLM serves NaN weights without a word: every draft token wrong
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            p.append(f"{name}: {bad} of {t.numel()} values are NaN or Inf (export a checkpoint before the "
                     "training went non-finite)")  # fmt: skip
    if "d2t" in tensors and "d2t" in shapes and tensors["d2t"].shape == shapes["d2t"]:
        if not torch.equal(tensors["d2t"].long(), expect["d2t"]):
            p.append("d2t differs from the vocab mapping the draft was trained with")
    if config["draft_vocab_size"] == config["vocab_size"] and "d2t" in tensors:
        p.append("d2t present while draft_vocab_size == vocab_size (vLLM fails to load it)")
    return p


def load_trained(
    train_dir: Path, which: str
) -> tuple[Path | None, dict[str, Any], Any, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(checkpoint, train meta, model with weights, verifier tensors, d2t, t2d).

    `which` = "init" gives the draft as training initialised it (same seed): the untrained baseline.
    """
    meta = read_train_meta(train_dir)
    ckpt = None if which == "init" else checkpoint.resolve(checkpoint.root_of(train_dir), which)
    spec = DraftSpec.from_json(meta["draft"])
    torch.manual_seed(meta["config"]["seed"])
    vocab_meta, d2t, t2d = load_mapping(Path(meta["vocab_mapping_dir"]))
    if vocab_meta["mapping_sha256"] != meta["vocab_mapping_sha256"]:
        raise UserError(f"{meta['vocab_mapping_dir']}: vocab mapping changed since training (sha256 differs)")
    model = build_draft(spec)
    vt = draft_tensors_of(Path(meta["verifier_path"]))  # (the shards' contract does not record the tie)
    attach_verifier_tensors(model, vt, t2d, d2t)
    if ckpt is not None:
        weights, _, info = checkpoint.load(ckpt, with_state=False)
        check_checkpoint_rope(info.get("rope_parameters"), rope_parameters_of(model), str(ckpt))
        unknown = set(weights) - set(dict(model.named_parameters()))
        if unknown:
            raise UserError(f"{ckpt}: unknown tensors {sorted(unknown)}")
        model.load_state_dict(weights, strict=False)
    model.eval()
    kernel_policy.set_eager(model)
    return ckpt, meta, model, vt, d2t, t2d


def read_train_meta(train_dir: Path) -> dict[str, Any]:
    """A training run's meta.json with its recorded paths read back (relative to the run folder, so a
    copied run reads its own copy's), and its verifier's fingerprint checked against the one its shards
    recorded (meta["verifier_fingerprint"]: what the export records for 06_evaluate.py)."""
    meta_path = train_dir / storage.META_NAME
    meta = storage.read_json(meta_path)
    written_in = meta.get(storage.WRITTEN_IN)
    for key in ("verifier_path", "vocab_mapping_dir"):
        meta[key] = str(storage.recorded_path(meta[key], train_dir, written_in))
    meta["shards"] = [str(storage.recorded_path(s, train_dir, written_in)) for s in meta["shards"]]
    recorded = meta.get("source", {}).get("verifier", {}).get("fingerprint")  # of the shards it trained on
    verifier = Path(meta["verifier_path"])
    meta["verifier_fingerprint"] = check_verifier(verifier, recorded, meta_path, verifier)
    return meta


def gate(
    export_dir: Path,
    model: Any,
    meta: dict[str, Any],
    embed: torch.Tensor,
    d2t: torch.Tensor,
    samples: list[dict[str, torch.Tensor]],
) -> dict[str, Any]:
    """Every check; raises UserError listing all problems. Returns the read-back statistics."""
    import json

    from safetensors.torch import load_file

    config = json.loads((export_dir / "config.json").read_text())
    tensors = load_file(str(export_dir / WEIGHTS_FILE))
    problems = static_problems(config, tensors, {"draft": meta["draft"], "d2t": d2t})
    stats: dict[str, Any] = {}
    if not problems:
        problems, stats = readback_problems(export_dir, model, embed, samples, meta["ttt_steps"])
    if problems:
        raise UserError(f"{export_dir}: export refused:\n  - " + "\n  - ".join(problems))
    return stats


# The read-back runs each gate sample's first GATE_TOKENS tokens (a windowed draft's: twice its window, so
# the window is crossed): its dense attention is quadratic in the length, and a stored sample runs to
# Kimi-K2.5's 20,000 tokens or a joined session's 131,072 (a 19k-token session took the tiny Kimi-shaped
# draft's gate to 8 GB), while positions past the trained length are export_rope.long_positions' check.
GATE_TOKENS = 2048


def gate_tokens(spec: dict[str, Any]) -> int:
    return max(GATE_TOKENS, 2 * (spec.get("sliding_window") or 0))


def gate_samples(meta: dict[str, Any], n: int) -> list[dict[str, torch.Tensor]]:
    """The first n stored samples of the run's shards, each cut to its first gate_tokens."""
    shard_set = open_shards(meta["shards"], verify=False)
    if meta.get("shard_manifests") not in (None, shard_set.manifests):
        raise UserError(
            f"{', '.join(meta['shards'])}: not the shards the run trained on (their manifest sha256s differ "
            "from the training run's meta.json); the gate needs those, restore them or retrain"
        )
    cap = gate_tokens(meta["draft"])
    return [{k: v[:cap] for k, v in load_sample(r).items()} for r in shard_set.samples[:n]]


def needs_remote_code(verifier_path: Path) -> bool:
    """Whether the verifier ships its own code (an `auto_map` in config.json or tokenizer_config.json,
    as Kimi-K2.5's config and tokenizer do): vLLM then needs --trust-remote-code to load it."""
    for name in ("config.json", "tokenizer_config.json"):
        f = verifier_path / name
        try:
            if f.is_file() and json.loads(f.read_text()).get("auto_map"):
                return True
        except (OSError, ValueError):
            continue
    return False


def serve_line(
    verifier_path: str,
    export_dir: Path,
    k: int,
    tensor_parallel_size: int = 0,
    draft_sample_method: str = "greedy",
    parallel_drafting: bool = False,
) -> str:
    """The `vllm serve` command for this export: tensor parallel over the GPUs visible here (or the
    size given), --trust-remote-code only for a verifier that ships code, draft_sample_method only when it
    is not vLLM's default."""
    if tensor_parallel_size <= 0:
        tensor_parallel_size = max(1, torch.cuda.device_count())
    spec = {"method": "eagle3", "model": str(export_dir.resolve()), "num_speculative_tokens": k}
    if draft_sample_method != "greedy":
        spec["draft_sample_method"] = draft_sample_method
    if parallel_drafting:  # all k drafts in one forward (a draft trained with --parallel-drafting)
        spec["parallel_drafting"] = True
    remote = " --trust-remote-code" if needs_remote_code(Path(verifier_path)) else ""
    return (
        f"vllm serve {verifier_path} --tensor-parallel-size {tensor_parallel_size}{remote} \\\n"
        f"  --speculative-config '{json.dumps(spec)}'"
    )


def run(cfg: ExportConfig) -> int:
    out = StageOutput(cfg.out_dir, cfg.overwrite)
    if out.skip(why="is a complete export", redo="replace it"):
        return 0
    with out.lock():  # the one writer of the export folder, before any work
        return _export(cfg, out)


def _export(cfg: ExportConfig, out: StageOutput) -> int:
    import json

    out_dir = out.out_dir
    ckpt, meta, model, vt, d2t, t2d = load_trained(Path(cfg.train_dir), cfg.checkpoint)
    spec = DraftSpec.from_json(meta["draft"])
    vcfg = json.loads((Path(meta["verifier_path"]) / "config.json").read_text())
    with out.building() as tmp:  # a full disk frees it; a refused export stays to read
        stats, info, ckpt_name = _build(cfg, tmp, ckpt, meta, model, vt, d2t, t2d, spec, vcfg)
    out.publish(tmp)  # the old export is replaced only now, after the gate passed
    log.info(
        "done %s | %s (step %d) | read-back top-1 agreement %.4f, normalised error %.4f over %d positions",
        out_dir,
        ckpt_name,
        info["step"],
        stats["top1_agreement"],
        stats["normalised_error"],
        stats["positions"],
    )
    print(
        serve_line(
            meta["verifier_path"],
            out_dir,
            cfg.num_speculative_tokens,
            cfg.serve_tensor_parallel_size,
            cfg.draft_sample_method,
            spec.parallel,
        )  # fmt: skip
    )
    if spec.parallel and cfg.num_speculative_tokens > spec.parallel_k:
        log.warning("num_speculative_tokens %d > the %d depths this parallel draft was trained for",
                    cfg.num_speculative_tokens, spec.parallel_k)  # fmt: skip
    return 0


def _build(
    cfg: ExportConfig,
    tmp: Path,
    ckpt: Path | None,
    meta: dict[str, Any],
    model: Any,
    vt: dict[str, torch.Tensor],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    spec: DraftSpec,
    vcfg: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """config.json, weights and export_meta.json in `tmp`, behind the gate; (stats, checkpoint info, name)."""
    import json

    config = export_config(spec, vcfg.get("text_config") or vcfg)
    storage.write_bytes_atomic(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    tensors = flat_weights(dict(model.named_parameters()), d2t, t2d, spec)
    storage.save_safetensors_atomic(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    stats = gate(tmp, model, meta, vt["embed_tokens"], d2t, gate_samples(meta, cfg.gate_samples))
    info = {"step": 0} if ckpt is None else json.loads((ckpt / "checkpoint.json").read_text())
    ckpt_name = "init" if ckpt is None else ckpt.name
    storage.write_json_atomic(
        tmp / EXPORT_META,
        {
            "stage": "05_export",
            "train_dir": storage.record_path(cfg.train_dir, Path(cfg.out_dir)),
            "checkpoint": ckpt_name,
            "step": info["step"],
            "val": info.get("val"),
            "draft": meta["draft"],
            "verifier_path": storage.record_path(meta["verifier_path"], Path(cfg.out_dir)),
            "verifier_fingerprint": meta["verifier_fingerprint"],
            storage.WRITTEN_IN: os.path.abspath(cfg.out_dir),
            "vocab_mapping_sha256": meta["vocab_mapping_sha256"],
            "readback": stats,
            "weights_sha256": storage.sha256_file(tmp / WEIGHTS_FILE),
            # how it will be served: 06_evaluate.py evaluates it so unless its command line says otherwise
            "served": {
                **{k: getattr(cfg, k) for k in ("draft_sample_method", "temperature", "top_p")},
                "parallel_drafting": spec.parallel,  # vLLM's speculative config key; mask_token_id in config
            },
            **provenance(cfg),
        },
    )
    return stats, info, ckpt_name


def check(export_dir: Path, samples_n: int = 4) -> dict[str, Any]:
    """The gate on an existing export folder (expectations from its export_meta.json)."""
    emeta = storage.read_json(export_dir / EXPORT_META)
    train_dir = storage.recorded_path(emeta["train_dir"], export_dir, emeta.get(storage.WRITTEN_IN))
    _, meta, model, vt, d2t, _ = load_trained(train_dir, emeta["checkpoint"])
    return gate(export_dir, model, meta, vt["embed_tokens"], d2t, gate_samples(meta, samples_n))
