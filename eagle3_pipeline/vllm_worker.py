"""Run greedy decoding in vLLM, optionally with an EAGLE-3 draft, and report acceptance counters.

Standalone: run with the vLLM virtualenv's interpreter, never imported by the pipeline.
It imports only the standard library and vllm, because the pipeline's own dependencies
are not installed in that environment.

    <vllm venv>/bin/python eagle3_pipeline/vllm_worker.py --request REQ.json --out OUT.json

REQ.json:
    {"verifier": dir, "draft": dir or null, "prompts": [[token ids], ...],
     "max_new_tokens": int, "num_speculative_tokens": int, "dtype": "float32"}
Optional keys: "max_model_len" (default max(512, longest prompt + max_new_tokens + k + 1)),
"seed" (default 0), "trust_remote_code" (default false), "tensor_parallel_size" (default 1),
"enforce_eager" (default true: no torch.compile, the fastest start-up on CPU); sampling:
"ignore_eos" (default true: acceptance runs generate exactly max_new_tokens), "stop_token_ids"
(default []), "temperature" (default 0: greedy), "top_p" (default 1), "top_k" (default -1), "seeds"
(one sampling seed per prompt; default: "seed" for every prompt).

    <vllm venv>/bin/python eagle3_pipeline/vllm_worker.py --session

Session mode keeps one engine for many requests (the verifier loads once): each stdin line is
{"request": REQ.json, "out": OUT.json}; the answer is one stdout line `@@eagle3 {"out": ...}` or
`@@eagle3 {"error": ...}`. The engine is rebuilt only when the engine settings change. A line
{"start": REQ.json} starts the request's engine without running it (answer {"started": seconds}).

    <vllm venv>/bin/python eagle3_pipeline/vllm_worker.py --serve 127.0.0.1:0 --request REQ.json

Server mode: the engine of REQ.json (its prompts may be absent), then clients on that address (one at
a time) send session lines; a request with other engine settings is refused. Stops at SIGTERM.

Extraction: "task": "extract" with "layer_ids", "storage_path" and "max_model_len" runs vLLM's
extract_hidden_states method; OUT.json holds "paths", one safetensors file per prompt
(hidden_states [tokens, layers, hidden], ascending layer order; token_ids), complete when answered.

OUT.json (written atomically):
    {"outputs": [[generated token ids], ...], "num_drafts", "num_draft_tokens",
     "num_accepted_tokens", "accepted_per_pos", "acceptance_rate_per_pos",
     "mean_acceptance_length", "vllm_version", "startup_s", "generate_s"}
Counters are the increase of vLLM's spec-decode metrics over the generate call (summed over
engines); accepted_per_pos has num_speculative_tokens entries. Without a draft (or when no draft
was proposed) the counters are 0, the per-position lists hold zeros and mean_acceptance_length
is null.

vLLM's logs go to stderr (VLLM_LOGGING_STREAM defaults to stderr here), stdout stays empty.
On error: exit status 1 and a single line "vllm_worker: error: ..." as the last line on stderr; it
names the root cause even when that was raised in one of vLLM's engine processes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import threading
import time

# Run as a script, sys.path[0] is this file's folder, and the package's module names (config, plan,
# samples, ...) would shadow packages that vLLM and transformers probe for (transformers imports any
# importable `kernels`); vLLM is imported only below, after this.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

# vLLM reads these at import time; set them before importing it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout clean

DEFAULT_MAX_MODEL_LEN = 512

METRIC_DRAFTS = "vllm:spec_decode_num_drafts"
METRIC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
METRIC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
METRIC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class RequestError(ValueError):
    """The request file is malformed."""


class StderrRelay:
    """Pass everything written to fd 2 (by us and by vLLM's engine processes, which inherit it)
    through to the real stderr, keeping the last lines so that a root cause raised in a child
    process can be named in our one-line error message."""

    def __init__(self, keep_lines: int = 2000):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._muted = False
        sys.stderr.flush()
        self._real = os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 2)
        os.close(w)
        self._r = r
        self._thread = threading.Thread(target=self._pump, name="stderr-relay", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._r, 65536)
            except OSError:
                return
            if not chunk:
                return
            if not self._muted:
                view = memoryview(chunk)
                try:
                    while view:
                        view = view[os.write(self._real, view) :]
                except OSError:
                    pass
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self.lines.extend(x.decode("utf-8", "replace") for x in complete)
            pending = pending[-65536:]

    def stop(self) -> None:
        """Point fd 2 back at the real stderr; later output of lingering children is dropped."""
        sys.stderr.flush()
        os.dup2(self._real, 2)
        self._thread.join(0.5)  # drain; the pipe stays open while any child holds it
        self._muted = True


_EXC_RE = re.compile(r"\b((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.+)$")
_NOT_ERROR_LOG_RE = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d ")
_WRAPPERS = (
    "EngineDeadError",
    "Engine core initialization failed",
    "EngineCore encountered",
    "Worker failed with error",
    "See root cause above",
    "check the stack trace above",
)


def root_cause(lines) -> str | None:
    """First exception line in vLLM's output that is not a generic wrapper or a warning."""
    for line in lines:
        if _NOT_ERROR_LOG_RE.search(line):
            continue
        m = _EXC_RE.search(line)
        if m is None:
            continue
        text = f"{m.group(1)}: {m.group(2).strip()}"
        if not any(w in text for w in _WRAPPERS):
            return text
    return None


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
    for key in ("trust_remote_code", "enforce_eager", "ignore_eos"):
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
    return req


def snapshot_counters(llm) -> dict:
    """Sum the spec-decode counters over all label sets (one per engine)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {METRIC_DRAFTS: 0, METRIC_DRAFT_TOKENS: 0, METRIC_ACCEPTED: 0, METRIC_ACCEPTED_PER_POS: []}
    for m in llm.get_metrics():
        if m.name in (METRIC_DRAFTS, METRIC_DRAFT_TOKENS, METRIC_ACCEPTED) and isinstance(m, Counter):
            out[m.name] += int(m.value)
        elif m.name == METRIC_ACCEPTED_PER_POS and isinstance(m, Vector):
            acc = out[m.name]
            for i, v in enumerate(m.values):
                if i < len(acc):
                    acc[i] += int(v)
                else:
                    acc.append(int(v))
    return out


def counter_delta(before: dict, after: dict, k: int) -> dict:
    """Counters accumulated between two snapshots, plus the derived rates."""
    n = max(k, len(before[METRIC_ACCEPTED_PER_POS]), len(after[METRIC_ACCEPTED_PER_POS]))

    def padded(v):
        return list(v) + [0] * (n - len(v))

    per_pos = [
        x - y for x, y in zip(padded(after[METRIC_ACCEPTED_PER_POS]), padded(before[METRIC_ACCEPTED_PER_POS]))
    ]
    num_drafts = after[METRIC_DRAFTS] - before[METRIC_DRAFTS]
    num_accepted = after[METRIC_ACCEPTED] - before[METRIC_ACCEPTED]
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": after[METRIC_DRAFT_TOKENS] - before[METRIC_DRAFT_TOKENS],
        "num_accepted_tokens": num_accepted,
        "accepted_per_pos": per_pos,
        "acceptance_rate_per_pos": [c / num_drafts for c in per_pos] if num_drafts else [0.0] * n,
        "mean_acceptance_length": (1.0 + num_accepted / num_drafts) if num_drafts else None,
    }


def write_json_atomic(path: str, obj: dict) -> None:
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".vllm_worker.", suffix=".tmp", dir=d)
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


# Settings only vLLM's CPU build needs, never used on GPUs (DEVELOPERS.md, measured on vllm-cpu 0.32):
# its CPU rotary custom op is silently wrong for MLA's 3-D q/k, so the native rotary path is used.
# (The other CPU-only fix, a block size EAGLE-3's attention shares with CPU MLA, is the plugin in
# scripts/vllm_cpu_plugin, installed by scripts/setup_vllm_cpu.sh.)
CPU_ONLY_ENGINE_SETTINGS = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
ENGINE_KEYS = ("task", "verifier", "draft", "num_speculative_tokens", "dtype", "max_model_len", "seed",
               "tensor_parallel_size", "trust_remote_code", "enforce_eager", "layer_ids", "storage_path",
               "engine_overrides", "draft_sample_method")  # fmt: skip
# The CPU build's replacement for vLLM's hidden-states connector (scripts/vllm_cpu_plugin/connector.py)
CPU_CONNECTOR = {"kv_connector": "CpuHiddenStatesConnector",
                 "kv_connector_module_path": "eagle3_vllm_cpu.connector"}  # fmt: skip


def _text_config(verifier: str) -> dict:
    try:
        with open(os.path.join(verifier, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return cfg.get("text_config") or cfg


def _has_routed_experts(verifier: str) -> bool:
    text = _text_config(verifier)
    if text.get("n_routed_experts") and text.get("first_k_dense_replace", 0) >= text.get(
        "num_hidden_layers", 1
    ):
        return False  # DeepSeek-V3 with every layer dense (the tier's tiny MLA verifier): no MoE kernel runs
    return bool(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts"))


def cpu_dtype(req: dict) -> str:
    """CPU build only: its fused-MoE kernel prepacks bfloat16/float16/int8 weights and has no float32 path
    (vllm-cpu 0.32 `prepack_moe_weight`: "expect weight to be bfloat16, float16, int8, ..."), so an MoE
    verifier asked for in float32 runs in bfloat16 there."""
    if req["dtype"] == "float32" and _has_routed_experts(req["verifier"]):
        print(
            "vllm_worker: MoE verifier on vLLM's CPU build: bfloat16 (no float32 MoE kernel)", file=sys.stderr
        )
        return "bfloat16"
    return req["dtype"]


def engine_kwargs(req: dict) -> dict:
    from vllm.platforms import current_platform

    k = req["num_speculative_tokens"]
    draft = req.get("draft")
    max_model_len = req.get("max_model_len")
    if not max_model_len:
        needed = max(len(p) for p in req["prompts"]) + req["max_new_tokens"] + k + 1
        max_model_len = max(DEFAULT_MAX_MODEL_LEN, needed)
    seed = req.get("seed")
    kwargs = dict(
        model=req["verifier"],
        dtype=req["dtype"],
        seed=0 if seed is None else seed,
        max_model_len=max_model_len,
        enforce_eager=req.get("enforce_eager", True),  # True: no torch.compile, fastest CPU start
        skip_tokenizer_init=True,  # token ids in, token ids out
        disable_log_stats=False,  # required for llm.get_metrics()
        tensor_parallel_size=req.get("tensor_parallel_size") or 1,
        trust_remote_code=req.get("trust_remote_code", False),
    )
    if draft is not None:
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": k,
            "draft_sample_method": req.get("draft_sample_method", "greedy"),
        }
    if req["task"] == "extract":
        # vLLM's extract_hidden_states method: the states at layer_ids (ascending; id = number of layers
        # is the last layer's pre-norm output) go through its KV cache to one safetensors file per
        # request, written by the hidden-states connector into storage_path
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": req["layer_ids"]}},
        }
        connector = {"kv_connector": "ExampleHiddenStatesConnector"}
        if current_platform.is_cpu():
            connector = dict(CPU_CONNECTOR)
        kwargs["kv_transfer_config"] = {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": req["storage_path"]},
        }
        kwargs["enable_prefix_caching"] = False  # a part's states must not depend on the parts before it
    if current_platform.is_cpu():
        kwargs.update(CPU_ONLY_ENGINE_SETTINGS, dtype=cpu_dtype(req))
        if kwargs["dtype"] == "float32" and _text_config(req["verifier"]).get("kv_lora_rank"):
            # MLA on a CPU with AMX tiles picks AMX_MLA, which packs bfloat16 weights only ("expect weight
            # to be bfloat16, ..."): the reference CPU_MLA backend runs float32
            kwargs["attention_config"] = {"backend": "CPU_MLA"}
    kwargs.update(req.get("engine_overrides") or {})  # tests: e.g. the negative control's settings
    return kwargs


def run(req: dict) -> dict:
    import logging

    from vllm import LLM

    # Without a tokenizer vLLM logs a traceback for its chat-template warm-up and an "EOS token
    # id is None" warning; neither matters for token-id prompts with ignore_eos.
    logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)

    kwargs = engine_kwargs(req)
    seed = kwargs["seed"]
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    try:
        return {**_generate(llm, req, startup_s, seed), "engine_dtype": kwargs["dtype"]}
    finally:
        _shutdown(llm)


def _shutdown(llm) -> None:
    """Stop vLLM's engine processes now, so that their logs end before our last line."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _generate(llm, req: dict, startup_s: float, seed: int) -> dict:
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = req["prompts"]
    n_new = req["max_new_tokens"]
    k = req["num_speculative_tokens"]

    def params_of(request_seed: int):
        return SamplingParams(
            temperature=float(req.get("temperature", 0.0)),
            top_p=float(req.get("top_p", 1.0)),
            top_k=int(req.get("top_k", -1)),
            max_tokens=n_new,
            ignore_eos=req.get("ignore_eos", True),
            stop_token_ids=list(req.get("stop_token_ids", [])),
            detokenize=False,
            seed=request_seed,
        )

    params = params_of(seed)
    if req["task"] == "extract":
        return _extract(llm, req, params, startup_s)
    if req.get("seeds") is not None:  # one generator per request (sampled acceptance, independent draws)
        params = [params_of(s) for s in req["seeds"]]
    before = snapshot_counters(llm)
    t0 = time.perf_counter()
    results = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    after = snapshot_counters(llm)

    outputs = [list(r.outputs[0].token_ids) for r in results]
    out = {"outputs": outputs, "finish_reasons": [r.outputs[0].finish_reason for r in results]}
    out.update(counter_delta(before, after, k))
    out.update(
        {
            "vllm_version": vllm.__version__,
            "startup_s": round(startup_s, 3),
            "generate_s": round(generate_s, 3),
        }
    )
    return out


def _extract(llm, req: dict, params, startup_s: float) -> dict:
    """{"paths": one safetensors file per prompt (hidden_states [tokens, layers, hidden] in ascending
    layer order, token_ids), complete when returned; the caller deletes them}."""
    import fcntl

    import vllm
    from vllm.inputs import TokensPrompt

    if not req["prompts"]:
        raise RequestError("an extract request needs prompts")
    storage = req["storage_path"]
    os.makedirs(storage, exist_ok=True)
    for name in os.listdir(storage):  # left by a client that died before deleting them
        os.unlink(os.path.join(storage, name))
    t0 = time.perf_counter()
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]], params, use_tqdm=False
    )
    paths = []
    for r in results:
        path = (r.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"request {r.request_id}: vLLM returned no hidden_states_path")
        with open(path + ".lock") as lock:  # the connector's writer holds it until the file is complete
            fcntl.flock(lock, fcntl.LOCK_SH)
        os.unlink(path + ".lock")
        paths.append(path)
    return {
        "paths": paths,
        "vllm_version": vllm.__version__,
        "startup_s": round(startup_s, 3),
        "generate_s": round(time.perf_counter() - t0, 3),
    }


SESSION_MARK = "@@eagle3 "


class Engines:
    """The engine of a session or a server: rebuilt when a request's engine settings change, or, when
    `fixed` (a server), kept and requests with other settings refused."""

    def __init__(self, fixed: dict | None = None):
        self.llm, self.key, self.kwargs = None, None, None
        self.fixed = fixed is not None
        if fixed is not None:
            self.start(fixed)

    def start(self, req: dict) -> float:
        from vllm import LLM

        if self.llm is not None:
            _shutdown(self.llm)
        t0 = time.perf_counter()
        self.kwargs = engine_kwargs(req)
        self.llm, self.key = LLM(**self.kwargs), engine_key(req)
        startup_s = time.perf_counter() - t0
        kw = self.kwargs
        line = f"{req['task']} | {req['verifier']} | {kw['dtype']} | tp {kw['tensor_parallel_size']}"
        print(f"vllm_worker: engine started | {line} | {startup_s:.1f}s", file=sys.stderr, flush=True)
        return startup_s

    def answer(self, line: str, relay: StderrRelay) -> dict:
        """One request line -> its answer (the result is written to the line's "out" file)."""
        try:
            msg = json.loads(line)
            if "start" in msg:  # start the engine of this request now; its prompts are not run
                req = load_request(msg["start"])
                if self.llm is None or engine_key(req) != self.key:
                    return {"started": 0.0 if self.fixed else self.start(req)}
                return {"started": 0.0}
            req = load_request(msg["request"])
            startup_s = 0.0
            if self.llm is None or engine_key(req) != self.key:
                if self.fixed:
                    raise RequestError(
                        "this server's engine has other settings (verifier, layers, dtype, ...): start a "
                        "server for them, or use this one's"
                    )
                startup_s = self.start(req)
            seed = req.get("seed")
            result = _generate(self.llm, req, startup_s, 0 if seed is None else seed)
            write_json_atomic(msg["out"], {**result, "engine_dtype": self.kwargs["dtype"]})
            return {"out": msg["out"]}
        except Exception as e:  # one clear line per failed request; the session goes on
            cause = root_cause(relay.lines)
            return {"error": " ".join(f"{type(e).__name__}: {e}".split())[:2000], "root_cause": cause}

    def close(self) -> None:
        if self.llm is not None:
            _shutdown(self.llm)
            storage = (self.kwargs.get("kv_transfer_config") or {}).get("kv_connector_extra_config", {})
            if storage.get("shared_storage_path"):  # the connector's folder: its files are read by now
                import shutil

                shutil.rmtree(storage["shared_storage_path"], ignore_errors=True)


def engine_key(req: dict) -> str:
    return json.dumps([req.get(k) for k in ENGINE_KEYS])


def session() -> int:
    """Many requests, one engine while the engine settings stay the same (see the module docstring)."""
    import logging

    logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)  # as in run()
    relay = StderrRelay()
    import vllm  # noqa: F401 - now, while the client prepares its first request

    engines = Engines()
    try:
        for line in sys.stdin:
            if line.strip():
                print(SESSION_MARK + json.dumps(engines.answer(line, relay)), flush=True)
    finally:
        engines.close()
        relay.stop()
    sys.stdout.flush()
    os._exit(0)  # the engine has stopped: skip the seconds of tearing down vLLM's modules (the client waits)


def serve(request: str, listen: str) -> int:
    """A server on `listen` (host:port, port 0: any free one) for clients on this machine: the engine of
    `request` starts first (its prompts are not run), then one stdout line `@@eagle3 {"listening":
    "host:port"}`; each client connection sends session lines and reads their answers, one client at a
    time (a part's states never depend on another client's requests). Stops at SIGTERM or SIGINT."""
    import logging
    import signal
    import socket

    logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    host, _, port = listen.rpartition(":")
    relay = StderrRelay()
    engines = None
    try:
        engines = Engines(fixed=load_request(request))
        with socket.create_server((host or "127.0.0.1", int(port))) as server:
            address = "{}:{}".format(*server.getsockname()[:2])
            print(SESSION_MARK + json.dumps({"listening": address, "pid": os.getpid()}), flush=True)
            while True:
                conn, _ = server.accept()
                with (
                    conn,
                    conn.makefile("r", encoding="utf-8") as rf,
                    conn.makefile("w", encoding="utf-8") as wf,
                ):
                    try:
                        for line in rf:
                            if line.strip():
                                wf.write(SESSION_MARK + json.dumps(engines.answer(line, relay)) + "\n")
                                wf.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client went away; the next one is served
    except KeyboardInterrupt:
        pass
    except Exception as e:
        print(f"vllm_worker: error: {' '.join(f'{type(e).__name__}: {e}'.split())[:2000]}"
              f" (root cause: {root_cause(relay.lines)})", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    finally:
        if engines is not None:
            engines.close()
        relay.stop()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--request", help="request JSON file")
    ap.add_argument("--out", help="output JSON file (written atomically)")
    ap.add_argument("--session", action="store_true", help="serve requests named on stdin (one engine)")
    ap.add_argument(
        "--serve", metavar="HOST:PORT", help="serve clients on this address (the --request's engine)"
    )
    args = ap.parse_args(argv)
    if args.session:
        return session()
    if args.serve:
        if not args.request:
            ap.error("--serve needs --request (the engine's settings)")
        return serve(args.request, args.serve)
    if not (args.request and args.out):
        ap.error("--request and --out are required (or --session)")
    try:
        req = load_request(args.request)
    except RequestError as e:
        print(f"vllm_worker: error: {e}", file=sys.stderr, flush=True)
        return 1
    relay = StderrRelay()
    error = None
    failure = None
    try:
        write_json_atomic(args.out, run(req))
    except KeyboardInterrupt:
        error = "interrupted"
    except Exception as e:  # one clear line, whatever vLLM raised
        failure = e
    finally:
        relay.stop()
    if failure is not None:
        error = f"{type(failure).__name__}: {failure}"
        cause = root_cause(relay.lines)
        if cause and cause not in error:
            error += f" (root cause: {cause})"
    if error is not None:
        error = " ".join(error.split())
        if len(error) > 2000:
            error = error[:2000] + "..."
        print(f"vllm_worker: error: {error}", file=sys.stderr, flush=True)
        return 130 if error == "interrupted" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
