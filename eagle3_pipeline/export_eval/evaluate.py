"""Stage 06: acceptance of an exported draft on held-out prompts, simulated and/or measured in vLLM.

Engines: `sim` (acceptance.py: this project's PyTorch run of vLLM's greedy EAGLE-3 chain over the export
files), `vllm` (the real engine in its own environment, through vllm_engine.py), `both` (the two on the
same prompts, plus the checks CI relies on: vLLM's speculative output equals the verifier's greedy
output token for token, and the per-position acceptance rates agree within `RATE_TOLERANCE`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core import storage
from eagle3_pipeline.models.acceptance import (
    AcceptanceCounts,
    Sampling,
    replay_with_aux,
    simulate_sequence,
    trace_length,
    verifier_trace_with_aux,
    verify_pass,
)
from eagle3_pipeline.core.cli import progress
from eagle3_pipeline.export_eval.config import EvaluateConfig
from eagle3_pipeline.core.config import provenance
from eagle3_pipeline.data.conversations import RowRejected, read_rows
from eagle3_pipeline.core.output import StageOutput
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models.reference_mla import read_export
from eagle3_pipeline.data.images import ImageTokens
from eagle3_pipeline.data.samples import SampleOptions, first_prompt
from eagle3_pipeline.models.verifier import (
    AuxCapture,
    check_verifier,
    find_decoder_layers,
    load_verifier_model,
    load_verifier_tensors,
    verifier_facts,
)

log = logging.getLogger("eagle3.evaluate")

# Per-position acceptance rates of vLLM and the simulation. With the last step verified past
# max_new_tokens as vLLM does (acceptance.py), their counters are equal on the CI models in fp32 (tiny
# Llama tier: 100/93/93 accepted of 104 drafts in both; before, the simulation had 100/91/89). A fp32
# near-tie that vLLM's kernels resolve differently moves a rate by one draft in the number of drafts:
# 0.01 absolute per position allows that at ~100 drafts, and is far below the effect of any contract fault
# (a missing head_dim or d2t, or shifted aux ids, move rates by 0.2-0.9).
RATE_TOLERANCE = 0.01
# Sampled requests: the simulation replays vLLM's own outputs (acceptance.py, "Replaying vLLM"): drafts
# must be equal, accepted counts equal up to the last steps' unshown positions, and vLLM's accepted count
# per position within SAMPLED_Z standard deviations of the expected one, sqrt(sum q(1-q)) given the steps
# (0.3% two-sided false alarm per position under normality), never tighter than RATE_TOLERANCE x drafts.
SAMPLED_Z = 3.0
# Probabilistic drafting: vLLM 0.32 does not seed the draft's draws, so its outputs do not settle its
# steps. Over the same outputs (the traces) vLLM's accepted counts and the simulation's expected ones
# differ by the accept tests and the step boundaries they move: compared within SAMPLED_Z standard
# deviations of two realisations' coin flips, sqrt(2 sum q(1-q)), never tighter than RATE_TOLERANCE.
COIN_SEED = 7919  # the simulation's accept tests under probabilistic drafting: seeded apart from the traces


def build_prompts(
    tokenizer: Any,
    data_path: Path,
    start: int,
    n: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[list[int]]:
    """Each usable conversation up to (not including) its first assistant turn, with the generation
    prompt: the serving prompt stage 01 would use as that turn's context (samples.first_prompt), under
    the same template settings (a row with images skipped: see prompts_with_images)."""
    return prompts_with_images(tokenizer, data_path, start, n, chat_template_kwargs)[0]


def prompts_with_images(
    tokenizer: Any,
    data_path: Path,
    start: int,
    n: int,
    chat_template_kwargs: dict[str, Any] | None = None,
    images: ImageTokens | None = None,
) -> tuple[list[list[int]], list[list[str]]]:
    """build_prompts' prompts and the images each holds (data URLs); rows with images are taken when
    `images` (a verifier with a vision tower), placeholders expanded as stage 01 expands them."""
    opts = SampleOptions(0, chat_template_kwargs=chat_template_kwargs or {}, images=images,
                         base_dir=data_path if data_path.is_dir() else data_path.parent)  # fmt: skip
    prompts: list[list[int]] = []
    urls: list[list[str]] = []
    for raw in read_rows(data_path, start, 10**12):
        if len(prompts) >= n:
            break
        if raw.error:
            continue
        try:
            ids, found = first_prompt(raw.value, tokenizer, opts)
        except RowRejected:
            continue
        prompts.append(ids)
        urls.append(found)
    if not prompts:
        raise UserError(f"{data_path}: no usable prompts from row {start}")
    return prompts, urls


def training_template_kwargs(draft_dir: Path) -> dict[str, Any]:
    """The chat_template_kwargs the draft's training shards were extracted with, found through
    export_meta.json (train_dir) -> the training run's meta.json (shards) -> each shard's meta.json."""
    import json

    try:
        emeta = storage.read_json(draft_dir / "export_meta.json")
        train_dir = storage.recorded_path(emeta["train_dir"], draft_dir, emeta.get(storage.WRITTEN_IN))
        tmeta = storage.read_json(train_dir / storage.META_NAME)
        shards = [storage.recorded_path(s, train_dir, tmeta.get(storage.WRITTEN_IN)) for s in tmeta["shards"]]
        metas = [storage.read_json(s / storage.META_NAME) for s in shards]
    except (UserError, KeyError, TypeError) as e:
        raise UserError(
            f"{draft_dir}: cannot find the chat_template_kwargs training used ({type(e).__name__}: {e}); "
            "pass --chat-template-kwargs"
        ) from None
    # shards from before template kwargs were recorded carry none: they were rendered with none
    found = {json.dumps(m.get("chat_template_kwargs", {}), sort_keys=True) for m in metas}
    if len(found) != 1:
        raise UserError(
            f"{draft_dir}: its training shards were extracted with different chat_template_kwargs "
            f"{sorted(found)}; pass --chat-template-kwargs"
        )
    return json.loads(found.pop())


def simulate(
    verifier_path: Path,
    draft_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    trust_remote_code: bool = False,
    sampling: Sampling = Sampling(),
    replay: list[list[int]] | None = None,
    draft_sample_method: str = "greedy",
    images: tuple[ImageTokens, list[list[str]]] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """(acceptance summary, continuations) from the simulation: greedy; sampled, request i's trace drawn
    from a generator seeded sampling.seed + i (as vLLM's requests are seeded); or, `replay`, counted
    over vLLM's sampled outputs for the same requests. `images`: the verifier's image tokens and each
    request's images, whose pixels the verifier's forwards see."""
    facts = verifier_facts(verifier_path)
    embed = load_verifier_tensors(verifier_path, facts.tie_word_embeddings)["embed_tokens"]
    draft = read_export(draft_dir, embed)
    if draft.aux_layer_ids is None:
        raise UserError(f"{draft_dir}/config.json: no eagle_aux_hidden_state_layer_ids")
    model = load_verifier_model(
        verifier_path,
        torch.float32 if not torch.cuda.is_available() else torch.bfloat16,
        trust_remote_code=trust_remote_code,
    )
    capture = AuxCapture(find_decoder_layers(model, facts.num_hidden_layers), draft.aux_layer_ids)
    probabilistic = sampling if draft_sample_method == "probabilistic" else None
    coins = torch.Generator().manual_seed(sampling.seed + COIN_SEED)
    counts = AcceptanceCounts(k)
    outputs = []
    try:
        for i, prompt in enumerate(progress(prompts, desc="simulate", unit="prompt")):
            pixels = images[0].model_inputs(images[1][i], model) if images and images[1][i] else {}
            verify = None if sampling.greedy else verify_pass(model, capture, sampling, pixels)
            if replay is not None:
                seq, aux, probs = replay_with_aux(model, capture, prompt, replay[i], sampling, pixels)
            else:
                gen = torch.Generator().manual_seed(sampling.seed + i)
                seq, aux, probs = verifier_trace_with_aux(
                    model, capture, prompt, trace_length(max_new_tokens, k), sampling, gen, pixels
                )
            simulate_sequence(draft, aux, seq, len(prompt), k, counts, max_new_tokens, probs, verify,
                              probabilistic, coins)  # fmt: skip
            outputs.append(seq[len(prompt) : len(prompt) + max_new_tokens].tolist())
    finally:
        capture.remove()
    return counts.summary(sampled=not sampling.greedy), outputs


def compare(
    sim: dict[str, Any], vllm: dict[str, Any], reference: list[list[int]] | None, probabilistic: bool = False
) -> dict[str, Any]:
    """The checks that make vLLM's numbers trustworthy. Greedy: lossless output (token for token the
    verifier's greedy output `reference`) and rates within RATE_TOLERANCE. Sampled (`sim` replayed
    vLLM's outputs): the same drafts, accepted counts as the outputs settle them, and vLLM's rates
    within SAMPLED_Z standard deviations of the simulation's expected ones. Probabilistic drafting: the
    rates only, within the noise of two estimates (COIN_SEED's comment)."""
    rate_diffs = [abs(a - b) for a, b in zip(sim["acceptance_rate_per_pos"], vllm["acceptance_rate_per_pos"])]
    if "expected_variance_per_pos" not in sim:
        lossless = vllm["outputs"] == reference
        diffs = rate_diffs
        return {
            "lossless": lossless,
            "rate_diff_per_pos": diffs,
            "rate_tolerance_per_pos": [RATE_TOLERANCE] * len(diffs),
            "rates_agree": all(d <= RATE_TOLERANCE for d in diffs),
            "first_mismatch": None
            if lossless
            else next((i for i, (a, b) in enumerate(zip(vllm["outputs"], reference)) if a != b), None),
        }
    drafts = max(vllm["num_drafts"], 1)
    if probabilistic:
        # vLLM's counters include the last step's drafts past each output's end (verified, not shown);
        # over the output the simulation cannot judge them (unverifiable_per_pos), so vLLM's rate may
        # exceed its expectation by up to that many acceptances: on the tier's llama run (48 requests)
        # vLLM sat 0.010-0.028 above the simulation at the third position in 5 of 5 engine runs.
        diffs = rate_diffs
        tolerances = [
            max(SAMPLED_Z * (2 * var) ** 0.5, RATE_TOLERANCE * drafts) / drafts
            for var in sim["expected_variance_per_pos"]
        ]
        past_end = [u / max(sim["num_drafts"], 1) for u in sim["unverifiable_per_pos"]]
        signed = [v - s for s, v in zip(sim["acceptance_rate_per_pos"], vllm["acceptance_rate_per_pos"])]
        return {
            "lossless": None,
            "rate_diff_per_pos": diffs,
            "rate_tolerance_per_pos": tolerances,
            "past_end_rate_per_pos": past_end,
            "rates_agree": all(-t <= d <= t + e for d, t, e in zip(signed, tolerances, past_end)),
        }
    settled = [
        lo <= v <= lo + u
        for lo, v, u in zip(sim["accepted_per_pos"], vllm["accepted_per_pos"], sim["unverifiable_per_pos"])
    ]
    tolerances = [
        max(SAMPLED_Z * var**0.5, RATE_TOLERANCE * drafts) / drafts
        for var in sim["expected_variance_per_pos"]
    ]
    diffs = [abs(e - v) / drafts for e, v in zip(sim["expected_accepted_per_pos"], vllm["accepted_per_pos"])]
    return {
        "lossless": None,  # sampled outputs are compared in law (the rates), not token for token
        "drafts_equal": sim["num_drafts"] == vllm["num_drafts"],
        "accepted_settled_per_pos": settled,
        "rate_diff_per_pos": diffs,
        "rate_tolerance_per_pos": tolerances,
        "rates_agree": sim["num_drafts"] == vllm["num_drafts"]
        and all(settled)
        and all(d <= t for d, t in zip(diffs, tolerances)),
    }


def sampling_of(cfg: EvaluateConfig) -> Sampling:
    return Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)


# What an unset sampling setting is when the export records none: greedy requests, argmax drafting.
UNRECORDED_SERVING = {"temperature": 0.0, "top_p": 1.0, "draft_sample_method": "greedy"}


def served_as_exported(cfg: EvaluateConfig, served: dict[str, Any], export_meta: Path) -> EvaluateConfig:
    """The settings left unset (None) as the export records it will be served (export_meta.json "served",
    stage 05), else UNRECORDED_SERVING; what the command line or config gives wins."""
    unset = {k: served.get(k) for k, v in UNRECORDED_SERVING.items() if getattr(cfg, k) is None}
    from_export = {k: v for k, v in unset.items() if v is not None}
    if from_export:
        log.info("serving as %s records it: %s (give the flag to evaluate otherwise)", export_meta,
                 " | ".join(f"{k} {v}" for k, v in from_export.items()))  # fmt: skip
    filled = {k: UNRECORDED_SERVING[k] if v is None else v for k, v in unset.items()}
    return dataclasses.replace(cfg, **filled)


def _verifier_of(cfg: EvaluateConfig, draft_dir: Path, recorded: dict[str, Any]) -> Path:
    """--verifier-path, else the one export_meta.json (`recorded`) names; refused when it is not the verifier
    the draft was trained for (by fingerprint): with another one its acceptance measures nothing."""
    if cfg.verifier_path and not recorded:  # an export folder without export_meta.json: nothing to compare
        return Path(cfg.verifier_path)
    export_meta = draft_dir / "export_meta.json"
    emeta = storage.read_json(export_meta)
    exported_for = storage.recorded_path(emeta["verifier_path"], draft_dir, emeta.get(storage.WRITTEN_IN))
    verifier_path = Path(cfg.verifier_path) if cfg.verifier_path else exported_for
    check_verifier(verifier_path, recorded.get("verifier_fingerprint"), export_meta, exported_for)
    return verifier_path


def run(cfg: EvaluateConfig) -> int:
    draft_dir = Path(cfg.draft_dir)
    if not (draft_dir / "config.json").is_file():
        raise UserError(f"{draft_dir}: no config.json; --draft-dir must be an export from 05_export.py")
    # the one writer of the folder its result goes into (the export folder, or --out-dir), before any work
    with StageOutput(cfg.out_dir or draft_dir).lock():
        return _evaluate(cfg, draft_dir)


def _evaluate(cfg: EvaluateConfig, draft_dir: Path) -> int:
    from transformers import AutoTokenizer

    from eagle3_pipeline.vllm_side import vllm_engine

    export_meta = draft_dir / "export_meta.json"
    recorded = storage.read_json(export_meta) if export_meta.exists() else {}
    cfg = served_as_exported(cfg, recorded.get("served") or {}, export_meta)
    verifier_path = _verifier_of(cfg, draft_dir, recorded)
    tokenizer = AutoTokenizer.from_pretrained(str(verifier_path), trust_remote_code=cfg.trust_remote_code)
    template_kwargs = cfg.chat_template_kwargs
    if template_kwargs is None:
        template_kwargs = training_template_kwargs(draft_dir)
        log.info("chat_template_kwargs %s (as the training shards were extracted)", template_kwargs)
    image_tokens = ImageTokens.of_verifier(verifier_path, tokenizer)
    prompts, urls = prompts_with_images(tokenizer, Path(cfg.data_path), cfg.start_row, cfg.num_prompts,
                                        template_kwargs, image_tokens)  # fmt: skip
    sampling = sampling_of(cfg)
    requests = [p for p in prompts for _ in range(cfg.samples_per_prompt)]  # request i: seed + i
    request_urls = [u for u in urls for _ in range(cfg.samples_per_prompt)]
    images = (image_tokens, request_urls) if image_tokens is not None and any(urls) else None
    k = cfg.num_speculative_tokens
    result: dict[str, Any] = {
        "draft_dir": str(draft_dir.resolve()),
        "verifier_path": str(verifier_path),
        "num_prompts": len(prompts),
        "num_requests": len(requests),
        "num_prompts_with_images": sum(map(bool, urls)),  # their pixels seen by the simulated verifier
        "chat_template_kwargs": template_kwargs,
        "max_new_tokens": cfg.max_new_tokens,
        "num_speculative_tokens": k,
        "sampling": dataclasses.asdict(sampling),
        **provenance(cfg),
    }
    if cfg.engine in ("vllm", "both"):
        result["vllm"] = vllm_engine.generate(
            verifier_path,
            draft_dir,
            requests,
            cfg.max_new_tokens,
            k,
            cfg.vllm_python,
            trust_remote_code=cfg.trust_remote_code,
            sampling=sampling,
            draft_sample_method=cfg.draft_sample_method,
            images=(images[0].pad_id, images[1]) if images else None,
        )
        _log("vllm", result["vllm"])
    reference = None
    if cfg.engine in ("sim", "both"):
        # sampled `both`: the simulation counts over vLLM's own outputs (compare); greedy: its own trace
        replay = result["vllm"]["outputs"] if cfg.engine == "both" and not sampling.greedy else None
        result["sim"], reference = simulate(
            verifier_path,
            draft_dir,
            requests,
            cfg.max_new_tokens,
            k,
            cfg.trust_remote_code,
            sampling,
            replay,
            cfg.draft_sample_method,
            images,
        )
        _log("sim" if replay is None else "sim (replaying vLLM's outputs)", result["sim"])
    if cfg.engine == "both":
        probabilistic = cfg.draft_sample_method == "probabilistic" and not sampling.greedy
        result["comparison"] = c = compare(result["sim"], result["vllm"], reference, probabilistic)
        log.info(
            "vllm vs sim | lossless %s | rate diff per pos %s (tolerance %s)",
            "not compared (sampled)" if c["lossless"] is None else c["lossless"],
            " ".join(f"{d:.3f}" for d in c["rate_diff_per_pos"]),
            " ".join(f"{t:.3f}" for t in c["rate_tolerance_per_pos"]),
        )
    path = _write_result(cfg, Path(cfg.out_dir) if cfg.out_dir else draft_dir, result, sampling)
    if cfg.engine == "both" and not (c["lossless"] in (None, True) and c["rates_agree"]):
        log.error("vLLM and the simulation disagree (see %s)", path)
        return 1
    return 0


def _write_result(cfg: EvaluateConfig, out_dir: Path, result: dict[str, Any], sampling: Sampling) -> Path:
    """The result JSON and its plot in out_dir; the JSON's path."""
    from eagle3_pipeline.training.plots import (  # matplotlib only once there is a result
        by_context_plot_path,
        write_acceptance_by_context_plot,
        write_acceptance_plot,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / result_name(cfg.engine, sampling, cfg.draft_sample_method)
    storage.write_json_atomic(path, result)
    engines = {e: result[e] for e in ("sim", "vllm") if e in result}
    title = (
        f"acceptance per position, {result['num_requests']} requests, k={result['num_speculative_tokens']}"
    )
    if not sampling.greedy:
        title += f", temperature {sampling.temperature:g} / top_p {sampling.top_p:g}"
    plot = write_acceptance_plot(path.with_suffix(".png"), engines, title)
    by_context = write_acceptance_by_context_plot(
        by_context_plot_path(plot), engines, title.replace("per position", "by context length")
    )
    log.info("wrote %s, %s and %s", path, plot, by_context)
    return path


def result_name(engine: str, sampling: Sampling, draft_sample_method: str = "greedy") -> str:
    """acceptance_<engine>.json (greedy), acceptance_<engine>_t<T>_p<top_p>[_k<top_k>][_probabilistic].json
    (sampled; the last for probabilistic drafting)."""
    if sampling.greedy:
        return f"acceptance_{engine}.json"
    top_k = f"_k{sampling.top_k}" if sampling.top_k > 0 else ""
    drafting = "_probabilistic" if draft_sample_method == "probabilistic" else ""
    return f"acceptance_{engine}_t{sampling.temperature:g}_p{sampling.top_p:g}{top_k}{drafting}.json"


def _log(engine: str, s: dict[str, Any]) -> None:
    log.info(
        "%s | mean acceptance length %.3f | per position %s | drafts %d",
        engine,
        s["mean_acceptance_length"],
        " ".join(f"{r:.3f}" for r in s["acceptance_rate_per_pos"]),
        s["num_drafts"],
    )
    for b in s.get("acceptance_by_context", {}).get("buckets", []):
        se = "" if b["standard_error"] is None else f" +- {b['standard_error']:.3f}"
        log.info("%s | context %s | mean acceptance length %.3f%s | drafts %d",
                 engine, b["context"], b["mean_acceptance_length"], se, b["num_drafts"])  # fmt: skip
