"""The training stage's settings ([train]) and the values they accept.

The kernel, loss, dtype and state-source names are owned here, not by the modules that act on them
(kernel_policy.py, train.py, online.py, which import torch), so that parsing a config never imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from eagle3_pipeline.core.config import SEED, SERVING_K, Settings, required, setting
from eagle3_pipeline.core.rope_scaling import setting_problem as _rope_scaling_problem
from eagle3_pipeline.data.config import NO_STATES, STORAGE_DTYPES
from eagle3_pipeline.models.draft_shape import DRAFT_ARCHS, HEAD_BOUNDS, draft_shape_problem
from eagle3_pipeline.training.schedule import SCHEDULES
from eagle3_pipeline.training.trackers import KNOWN_LOGGERS

# "auto" first: kernel_policy.py takes ATTN_IMPLS[1:]
ATTN_IMPLS = ("auto", "flex", "sdpa", "eager", "blockwise")
LOSS_IMPLS = ("auto", "fused", "eager", "chunked")
COMPILE_MODES = ("auto", "off", "on")
TRAIN_DTYPES = ("auto", "bfloat16", "float32")  # train._autocast_dtype
STATE_SOURCES = ("shards", "online")  # [train] states (online.py)
TRANSFERS = ("file", "fp8", "mooncake")  # hs_connectors 0.9's backends (transfer.py's registry)
# speculators 0.9.0's loss names (losses/utils.py, _EAGER_LOSS_FN_MAP and _FUSED_LOSS_FN_MAP): importing
# them costs torch and seconds; tests/test_config_checks.py pins this tuple against that file.
LOSS_NAMES = ("ce", "kl_div", "tv", "nla", "lk_hybrid", "rkl", "jsd")
# The most TTT steps [train] unrolls: twice the deepest draft served here (a parallel draft's k = 8; chains
# serve 3-5). A chained step is accepted with the product of the steps' rates before it (0.8**16 = 3 %),
# while memory and time grow with every step's KV ((s+1) x the row's tokens: sizing/plan.py); --ttt-steps 50
# on the tiny model took 10 GB at 8 tok/s.
TTT_STEPS_MAX = 16


def _loss_problem(spec: str) -> str | None:
    """Why `spec` is no loss to train with (None: it is one): a name of LOSS_NAMES, or a JSON object of such
    names to weights >= 0, not all 0 (speculators takes any number: a negative weight ascends its loss)."""
    if spec in LOSS_NAMES:
        return None
    names = ", ".join(LOSS_NAMES)
    try:
        weights = json.loads(spec)
    except json.JSONDecodeError:
        weights = None
    if not isinstance(weights, dict) or not weights:
        example = '{"kl_div": 0.5, "ce": 0.5}'
        return f"must be one of {names}, or a JSON object of them to weights such as '{example}'"
    unknown = sorted(set(weights) - set(LOSS_NAMES))
    if unknown:
        return f"must name losses among {names}; unknown: {', '.join(unknown)}"
    if not all(_is_weight(w) for w in weights.values()) or not any(w > 0 for w in weights.values()):
        return "must weigh each loss by a finite number >= 0, at least one > 0"
    return None


def _server_problem(url: str) -> str | None:
    """Why `url` names no vLLM server (None: it does): http(s)://HOST:PORT, an optional /v1."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path not in (
        "", "/", "/v1"
    ):
        return "must be a server address such as http://10.0.0.5:8000"
    return None


def _shell_words_problem(text: str) -> str | None:
    import shlex

    try:
        shlex.split(text)
    except ValueError as e:
        return f"must split into options like a shell command line ({e})"
    return None


def _is_weight(w: Any) -> bool:
    if isinstance(w, bool) or not isinstance(w, int | float):
        return False
    try:
        return math.isfinite(float(w)) and w >= 0  # float(): speculators converts it; 10**400 overflows
    except OverflowError:
        return False



@dataclass
class TrainConfig(Settings):
    SECTION: ClassVar[str] = "train"
    verifier_path: str | None = setting(
        None,
        "Verifier checkpoint (for embed_tokens, final norm, lm_head only); "
        "default: the one recorded in the shards' meta.json.",
    )
    data_dir: list[str] = setting(
        [], "Hidden-state shard folders (rows_*/) or roots holding them; token shards with --states online."
    )
    split_dir: str | None = setting(None, "Output of 03_split_data.py; default: split here with --val-ratio.")
    vocab_mapping_dir: str | None = required("Output of 02_build_vocab_mapping.py.")
    # online states (eagle3_pipeline/training/online.py; README "Online states")
    states: str = setting(
        "shards",
        "Where the hidden states come from: shards (stage 01 wrote them) or online (running `vllm serve` "
        "processes compute them while training; --data-dir holds token shards, stage 01 with "
        "--storage-dtype none). `04_train.py --serve-line` prints the command that starts a server.",
        choices=STATE_SOURCES,
    )
    servers: list[str] = setting(
        [],
        "With --states online: the vLLM servers, http://HOST:PORT each; requests spread over them, a "
        "failed one's go to the others.",
        check=_server_problem,
    )
    transfer: str = setting(
        "file",
        "With --states online: hs_connectors' transfer of the states from vLLM to the trainer: file (a "
        "folder both see: one node, or a shared filesystem), fp8 (file, quantised), mooncake (across "
        "nodes, no shared filesystem). vLLM's CPU build runs file only.",
        choices=TRANSFERS,
    )
    transfer_args: str = setting(
        "",
        "hs_connectors' options for the transfer, as on its command line (one string): e.g. "
        "\"--hidden-states-path /dev/shm/eagle3\" (file, fp8; default /tmp/hidden_states) or "
        "\"--mooncake-master 10.0.0.1:50051 --mooncake-protocol rdma\"; on the command line "
        "--transfer-args='--hidden-states-path /dev/shm/eagle3'.",
        check=_shell_words_problem,
    )
    requests_in_flight: int = setting(
        8, "With --states online: samples requested at once (over all servers).", ge=1
    )
    prefetch_batches: int = setting(
        4, "With --states online: micro-batches whose states are fetched ahead of the one trained.", ge=0
    )
    request_timeout: float = setting(
        600.0, "With --states online: seconds one sample may take before its server counts as failed.", gt=0
    )
    cache_dir: str | None = setting(
        None, "With --states online: keep fetched states here for later epochs (up to --cache-gb)."
    )
    cache_gb: float = setting(
        0.0, "With --cache-dir: the cache's budget in GB (1e9 bytes); never exceeded.", ge=0
    )
    cache_dtype: str = setting(
        "bfloat16",
        "With --cache-dir: how cached states are stored: bfloat16, float32, float8_e4m3fn (as stage 01).",
        choices=tuple(s for s in STORAGE_DTYPES if s not in ("auto", NO_STATES)),
    )
    out_dir: str | None = required(
        "Training run folder: checkpoints/, train_log.jsonl, meta.json.", aliases=["--output-dir"]
    )
    epochs: int = setting(1, "Passes over the training split.", ge=1)
    max_steps: int | None = setting(
        None, "Stop after this many optimizer steps (overrides --epochs if smaller).", ge=1
    )
    lr: float = setting(1e-3, "Peak AdamW learning rate (measured: benchmarks/draft_quality.py).", gt=0)
    lr_schedule: str = setting(
        "cosine", "After warm-up: cosine, linear (to --min-lr-ratio) or constant.", choices=SCHEDULES
    )
    min_lr_ratio: float = setting(0.1, "Final learning rate as a fraction of --lr.", ge=0, le=1)
    warmup_ratio: float = setting(
        0.02, "Linear warm-up as a fraction of the run's optimizer steps.", ge=0, le=1
    )
    warmup_steps: int | None = setting(None, "Warm-up in optimizer steps instead of --warmup-ratio.", ge=0)
    weight_decay: float = setting(0.0, "AdamW weight decay.", ge=0)
    grad_clip: float = setting(0.5, "Clip the global gradient norm to this value.", gt=0)
    # >= 2: slot t learns token t+1 (packing.py), so a sample cut to one token trains nothing
    max_seq_len: int = setting(4096, "Longer samples train in windows of this length (length_mix.py).", ge=2)
    batch_tokens: int = setting(8192, "Tokens per micro-batch (a window alone may reach max_seq_len).", ge=1)
    batching: str = setting(
        "shuffle", "shuffle: pack in shuffled order; mix: best fit by length (data/length_mix.py).",
        choices=("shuffle", "mix"),
    )
    grad_accum: int = setting(1, "Micro-batches per optimizer step.", ge=1)
    ttt_steps: int = setting(
        SERVING_K,
        "Training-time-test steps unrolled per position (= draft tokens trained); default: [serving] "
        "num_speculative_tokens. Steps past --served-k are never served (a warning with the memory they "
        "cost).",
        ge=1,
        le=TTT_STEPS_MAX,
    )
    ttt_step_loss_decay: float = setting(1.0, "Weight of step s is decay**s.", gt=0)
    # Cross-entropy on the verifier's argmax: vLLM's draft proposes its argmax (draft_sample_method "greedy",
    # the default), so a token is accepted when it is the verifier's choice (greedy) or with the verifier's
    # probability of it (sampling): both reward the draft's top-1 only (measured: docs/results.md "Draft
    # quality"). Drafted probabilistically (what `[serving] mode` thinking and instant set, with kl_div) the
    # draft's whole distribution is tested: KL there (docs/results.md "Thinking mode").
    loss: str = setting(
        "ce",
        "Loss against the verifier over the draft vocab, speculators' names: ce (the verifier's argmax "
        "as label), kl_div (speculators' default), tv, nla (-log overlap), lk_hybrid, rkl, jsd; or JSON "
        'weights such as \'{"kl_div": 0.5, "ce": 0.5}\'.',
        check=_loss_problem,
    )
    loss_temperature: float = setting(
        1.0,
        "Temperature of the two distributions the loss compares: the verifier's and the draft's logits are "
        "divided by it, as vLLM samples a request and draws a probabilistic draft at its temperature "
        "(1: speculators' plain logits; greedy serving ignores it).",
        gt=0,
    )
    loss_top_p: float = setting(
        1.0,
        "Top-p of the verifier's distribution the loss matches: the tokens vLLM's sampler drops at this "
        "top-p get target 0, the rest renormalised, the served distribution (1: the whole distribution).",
        gt=0,
        le=1,
    )
    state_noise: float = setting(
        0.0,
        "Training-only Gaussian noise on the aux states, as a fraction of each token's RMS (0: none).",
        ge=0,
    )
    val_ratio: float = setting(0.05, "Validation fraction when no --split-dir is given.", ge=0, lt=1)
    num_workers: int = setting(0, "DataLoader worker processes (0: load in the training process).", ge=0)
    dist_timeout_s: float = setting(
        1800.0,
        "Under torchrun: seconds a rank waits for the others at a collective (longer than a checkpoint "
        "save); a dead rank is seen at once.",
        gt=0,
    )
    sequence_parallel: int = setting(
        1,
        "Under torchrun: ranks that train one packed row together, each a slice of its positions (rows "
        "longer than one GPU holds; needs blockwise and chunked; training/sequence_parallel.py).",
        ge=1,
    )
    seed: int = setting(0, "Seed for initialisation, data order and split.", **SEED)
    dtype: str = setting(
        "auto", "auto (bfloat16 autocast on CUDA, float32 on CPU), bfloat16, float32.", choices=TRAIN_DTYPES
    )
    attn_impl: str = setting(
        "auto",
        "Draft attention: auto (flex on CUDA, sdpa on CPU), flex (speculators' block-sparse "
        "simple_flex_attention; no backward on CPU), sdpa (dense mask), eager (dense mask, scores kept), "
        "blockwise (query chunks, no mask: memory linear in the row's length; models/linear_memory.py).",
        choices=ATTN_IMPLS,
    )
    loss_impl: str = setting(
        "auto",
        "Loss kernels: auto (fused where CUDA and Triton are present, else eager), fused, eager, chunked "
        "(head and loss per chunk of positions, recomputed in backward: no [tokens, draft vocab] kept).",
        choices=LOSS_IMPLS,
    )
    compile: str = setting(
        "auto",
        "torch.compile of the draft forward: auto (on on CUDA, off on CPU), on (rows padded to 4 length "
        "buckets: a few static shapes), off. See eagle3_pipeline/training/kernel_policy.py.",
        choices=COMPILE_MODES,
    )
    draft_arch: str = setting(
        "llama",
        "Draft decoder layer: llama (GQA, the head_dim / num_key_value_heads below) or mla (DeepSeek-V3 "
        "multi-head latent attention as vLLM's deepseek_eagle3.py serves it: one latent of kv_lora_rank + "
        "qk_rope_head_dim cached per token; the mla_* dims below, default the verifier's).",
        choices=DRAFT_ARCHS,
    )
    mla_q_lora_rank: int | None = setting(
        None, "MLA draft query LoRA rank (0: a plain q_proj); default: the verifier's q_lora_rank.", ge=0
    )
    mla_kv_lora_rank: int | None = setting(
        None, "MLA draft latent width (cached per token); default: the verifier's kv_lora_rank.", ge=1
    )
    mla_qk_nope_head_dim: int | None = setting(
        None, "MLA draft per-head query/key width without RoPE; default: the verifier's.", ge=1
    )
    mla_qk_rope_head_dim: int | None = setting(
        None, "MLA draft per-head RoPE width (shared key, cached); default: the verifier's.", ge=2
    )
    mla_v_head_dim: int | None = setting(
        None, "MLA draft per-head value width; default: the verifier's.", ge=1
    )
    num_attention_heads: int = setting(
        64, "Draft attention heads (llama and mla).", **HEAD_BOUNDS["num_attention_heads"]
    )
    num_key_value_heads: int = setting(64, "Draft key/value heads.", **HEAD_BOUNDS["num_key_value_heads"])
    head_dim: int = setting(
        128,
        "Draft head dim, even, written explicitly to config.json (never hidden/heads).",
        **HEAD_BOUNDS["head_dim"],
    )
    intermediate_size: int = setting(18432, "Draft MLP width.", ge=1)
    rope_theta: float = setting(1e6, "Draft RoPE theta, both archs (independent of the verifier's).", gt=0)
    sliding_window: int | None = setting(
        None,
        "Llama draft attention window in tokens, trained and served as vLLM serves it (a query reads the "
        "last sliding_window positions of its own, TTT steps included: models/draft_window.py); unset: full "
        "attention. Constant attention cost per token at long context.",
        ge=1,
    )
    rope_scaling: str = setting(
        "none",
        "Draft RoPE scaling, trained with and exported for vLLM: none (plain RoPE), verifier (the verifier's "
        "own, e.g. Kimi-K2.5's yarn factor 64 over 4096 positions) or a JSON yarn table such as "
        '\'{"rope_type": "yarn", "factor": 64, "original_max_position_embeddings": 4096}\' (optional '
        "beta_fast, beta_slow, mscale with mscale_all_dim).",
        check=_rope_scaling_problem,
    )
    max_position_embeddings: int = setting(131072, "Draft max positions written to config.json.", ge=1)
    # The EAGLE-3.1 norms, all three on as in speculators (measured: docs/results.md "Ablations from the
    # plain EAGLE-3 recipe"); vLLM >= 0.32 reads them (older: ignored).
    norm_before_residual: bool = setting(True, "EAGLE-3 residual = hidden_norm(g) instead of g.")
    norm_before_fc: bool = setting(
        True, "RMSNorm over the concatenated aux states before fc (weight input_norm)."
    )
    fc_norm: bool = setting(False, "RMSNorm over each aux state before fc (excludes --norm-before-fc).")
    norm_output: bool = setting(True, "Feed the normed output back to the next draft step.")
    loss_on_all_tokens: bool = setting(
        False, "Supervise every position against the verifier, prompts too (default: generated tokens only)."
    )
    served_k: int = setting(
        SERVING_K,
        "Draft tokens vLLM will serve with: validation acceptance_length counts these steps; in a config "
        "file, [serving] num_speculative_tokens sets it.",
        ge=1,
    )
    # Parallel drafting (P-EAGLE): vLLM 0.32 `"parallel_drafting": true` fills the k drafts of a step in one
    # forward, slots 2..k holding a mask token and the learned mask_hidden (training/parallel.py).
    parallel_drafting: bool = setting(
        False,
        "Train a parallel (P-EAGLE) draft: one forward proposes all k drafts of a step (mask token + learned "
        "mask_hidden in the k-1 extra slots), served with \"parallel_drafting\": true; --ttt-steps unused.",
    )
    parallel_k: int = setting(
        8, "With --parallel-drafting: the depths trained, the most draft tokens it serves with.", ge=1
    )
    cod_ratio: float = setting(
        0.7,
        "With --parallel-drafting: P-EAGLE's COD sub-sampling, depth d trains max(ratio**d, --cod-ratio-min) "
        "of the positions (1: all).",
        gt=0,
        le=1,
    )
    cod_ratio_min: float = setting(
        0.2, "With --parallel-drafting: floor of the COD fraction per depth.", gt=0, le=1
    )
    mask_token_id: int | None = setting(
        None,
        "With --parallel-drafting: the token id of the masked slots (vLLM's mask_token_id); its embedding is "
        "the verifier's. Default: the verifier's last id (vocab_size - 1).",
        ge=0,
    )
    train_lm_head: bool = setting(
        True, "Train the draft lm_head, initialised from the verifier's rows (--no-train-lm-head: frozen)."
    )
    log_every: int = setting(10, "Optimizer steps between log lines.", ge=1)
    loggers: list[str] = setting(
        [],
        "Experiment trackers, several allowed (`--logger tensorboard wandb`): tensorboard "
        "(<out_dir>/tensorboard), wandb (offline unless WANDB_MODE=online), mlflow (<out_dir>/mlruns "
        "unless MLFLOW_TRACKING_URI), trackio; rank 0 only, x axis the global step (trackers.py).",
        aliases=["--logger"],
        choices=tuple(KNOWN_LOGGERS),
    )
    eval_every: int | None = setting(
        None, "Optimizer steps between validations (and at the end); default: a tenth of the run.", ge=1
    )
    save_every: int | None = setting(
        None, "Optimizer steps between checkpoints (and at each validation); default: --eval-every.", ge=1
    )
    keep_last: int = setting(3, "Complete checkpoints kept besides the best one.", ge=1)
    val_max_samples: int | None = setting(None, "Cap on validation samples per evaluation.", ge=1)
    overwrite: bool = setting(False, "Start over even if --out-dir has checkpoints (default: resume).")

    def rule_problem(self) -> str | None:
        return draft_shape_problem(self)


