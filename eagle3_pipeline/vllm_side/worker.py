"""The vLLM worker: generation with an EAGLE-3 draft (acceptance counters) and hidden-state extraction.

Token ids in, token ids out, optionally with an EAGLE-3 draft, vLLM's acceptance counters, and vLLM's
extract_hidden_states; run inside vLLM's environment, standard library and vLLM only.

    <vllm env python> -m eagle3_pipeline.vllm_side --session
    <vllm env python> -m eagle3_pipeline.vllm_side --serve 127.0.0.1:0 --request REQ.json

Session: one engine for many requests (the verifier loads once), rebuilt only when a request's engine
settings change; each stdin line is {"request": REQ.json, "out": OUT.json} (or {"start": REQ.json}, or
{"release": true}: stop the engine, freeing its memory, until the next request), each answer one stdout
line (protocol.py). Server: the engine of REQ.json (its prompts may be absent), then
clients on that address (one at a time) send session lines; a request with other engine settings is
refused. Stops at SIGTERM.

REQ.json (protocol.load_request checks it):
    {"verifier": dir, "draft": dir or null, "prompts": [[token ids], ...],
     "max_new_tokens": int, "num_speculative_tokens": int, "dtype": "float32"}
Optional keys: "max_model_len" (default protocol.default_max_model_len: 2 (k + 1) past the longest request),
"seed" (default 0), "trust_remote_code" (default false), "tensor_parallel_size" (default 1),
"enforce_eager" (default true: no torch.compile, the fastest start-up on CPU); sampling:
"ignore_eos" (default true: acceptance runs generate exactly max_new_tokens), "stop_token_ids"
(default []), "temperature" (default 0: greedy), "top_p" (default 1), "top_k" (default -1), "seeds"
(one sampling seed per prompt; default: "seed" for every prompt); "parallel_drafting" (default false:
vLLM's speculative-config key, all k drafts in one forward, for a draft exported with mask_token_id);
images (Kimi-K2.5): "images" (one list of data URLs per prompt, each image a run of "image_token_id" in
the prompt, sent to vLLM as vllm_side/images.py says; the answer is refused unless vLLM's expansion gives
the same ids), "vision" (default: some prompt has an image; the engine then loads the tokenizer, which
vLLM's image processor needs).

Extraction: "task": "extract" with "layer_ids", "storage_path" and "max_model_len" runs vLLM's
extract_hidden_states method; OUT.json holds "paths", one safetensors file per prompt
(hidden_states [tokens, layers, hidden], ascending layer order; token_ids), complete when answered;
with images, from the verifier's forward given their pixels.

OUT.json (written atomically):
    {"outputs": [[generated token ids], ...], "num_drafts", "num_draft_tokens",
     "num_accepted_tokens", "accepted_per_pos", "acceptance_rate_per_pos",
     "mean_acceptance_length", "vllm_version", "startup_s", "generate_s"}
Counters are the increase of vLLM's spec-decode metrics over the generate call (summed over
engines); accepted_per_pos has num_speculative_tokens entries. Without a draft (or when no draft
was proposed) the counters are 0, the per-position lists hold zeros and mean_acceptance_length
is null.

vLLM's logs go to stderr (VLLM_LOGGING_STREAM defaults to stderr here), stdout holds only answers. A
failed request is an {"error", "root_cause"} answer naming the root cause even when it was raised in one
of vLLM's engine processes; a server that cannot start prints "eagle3_vllm: error: ..." last on stderr.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import threading
import time

from eagle3_pipeline.vllm_side import cpu, images
from eagle3_pipeline.vllm_side.protocol import (
    CLOSE, MARK, RequestError, engine_key, load_request, write_json_atomic,
)

# vLLM reads these at import time; set them before importing it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", cpu.KV_CACHE_GIB)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout clean


METRIC_DRAFTS = "vllm:spec_decode_num_drafts"
METRIC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
METRIC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
METRIC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


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


def engine_kwargs(req: dict) -> dict:
    from vllm.platforms import current_platform

    k = req["num_speculative_tokens"]
    draft = req.get("draft")
    max_model_len = req["max_model_len"]  # protocol.load_request fills its default
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
    if req["vision"]:  # vLLM builds Kimi-K2.5's image processor from the tokenizer (none: text-only)
        kwargs["skip_tokenizer_init"] = False
    if draft is not None:
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": k,
            "draft_sample_method": req.get("draft_sample_method", "greedy"),
        }
        if req.get("parallel_drafting"):
            kwargs["speculative_config"]["parallel_drafting"] = True
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
            connector = dict(cpu.CONNECTOR)
        kwargs["kv_transfer_config"] = {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": req["storage_path"]},
        }
        kwargs["enable_prefix_caching"] = False  # a part's states must not depend on the parts before it
    if current_platform.is_cpu():
        kwargs.update(cpu.ENGINE_SETTINGS, dtype=cpu.cpu_dtype(req))
        kwargs.update(cpu.in_process(req, kwargs["tensor_parallel_size"]))
        attention = cpu.attention_config(kwargs["dtype"], req["verifier"])
        if attention is not None:
            kwargs["attention_config"] = attention
        draft_backend = cpu.draft_attention_backend(kwargs["dtype"], draft)
        if draft_backend is not None and "speculative_config" in kwargs and req["task"] != "extract":
            kwargs["speculative_config"]["attention_backend"] = draft_backend
    kwargs.update(req.get("engine_overrides") or {})  # tests: e.g. the negative control's settings
    return kwargs


def _shutdown(llm) -> None:
    """Stop vLLM's engine processes now, so that their logs end before our last line."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _generate(llm, req: dict, startup_s: float, seed: int) -> dict:
    import vllm
    from vllm import SamplingParams

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
    results = llm.generate(images.request_prompts(req), params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    after = snapshot_counters(llm)
    images.check_served_prompts(req, [r.prompt_token_ids for r in results])

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

    if not req["prompts"]:
        raise RequestError("an extract request needs prompts")
    storage = req["storage_path"]
    os.makedirs(storage, exist_ok=True)
    for name in os.listdir(storage):  # left by a client that died before deleting them
        os.unlink(os.path.join(storage, name))
    t0 = time.perf_counter()
    results = llm.generate(images.request_prompts(req), params, use_tqdm=False)  # the pixels too
    images.check_served_prompts(req, [r.prompt_token_ids for r in results])
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
        print(f"eagle3_vllm: engine started | {line} | {startup_s:.1f}s", file=sys.stderr, flush=True)
        return startup_s

    def answer(self, line: str, relay: StderrRelay) -> dict:
        """One request line -> its answer (the result is written to the line's "out" file)."""
        try:
            msg = json.loads(line)
            if "release" in msg:  # the engine stops; the next request starts one
                if self.fixed:
                    raise RequestError("a server keeps its engine: stop the server instead")
                self.close()
                self.llm = self.key = self.kwargs = None
                return {"released": True}
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


def session() -> int:
    """Many requests, one engine while the engine settings stay the same (see the module docstring)."""
    import logging

    # Without a tokenizer vLLM logs a traceback for its chat-template warm-up and an "EOS token
    # id is None" warning; neither matters for token-id prompts with ignore_eos.
    logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)
    relay = StderrRelay()
    import vllm  # noqa: F401 - now, while the client prepares its first request

    engines = Engines()
    try:
        for line in sys.stdin:
            if line.strip() == CLOSE:
                break
            if line.strip():
                print(MARK + json.dumps(engines.answer(line, relay)), flush=True)
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
            print(MARK + json.dumps({"listening": address, "pid": os.getpid()}), flush=True)
            while True:
                conn, _ = server.accept()
                with (
                    conn,
                    conn.makefile("r", encoding="utf-8") as rf,
                    conn.makefile("w", encoding="utf-8") as wf,
                ):
                    try:
                        for line in rf:
                            if line.strip() == CLOSE:
                                break
                            if line.strip():
                                wf.write(MARK + json.dumps(engines.answer(line, relay)) + "\n")
                                wf.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client went away; the next one is served
    except KeyboardInterrupt:
        pass
    except Exception as e:
        print(f"eagle3_vllm: error: {' '.join(f'{type(e).__name__}: {e}'.split())[:2000]}"
              f" (root cause: {root_cause(relay.lines)})", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    finally:
        if engines is not None:
            engines.close()
        relay.stop()
    return 0


def main(argv=None) -> int:
    prog = "python -m eagle3_pipeline.vllm_side"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--session", action="store_true", help="serve request lines on stdin (one engine)")
    ap.add_argument("--serve", metavar="HOST:PORT", help="serve clients on this address (--request's engine)")
    ap.add_argument("--request", help="with --serve: the request JSON whose engine the server runs")
    args = ap.parse_args(argv)
    if args.serve:
        if not args.request:
            ap.error("--serve needs --request (the engine's settings)")
        return serve(args.request, args.serve)
    if args.session:
        return session()
    ap.error("--session or --serve")
    return 2
