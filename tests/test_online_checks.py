"""Online states without a server: token shards, the serve line, the transfers, the cache's budget, and the
errors a user meets (no server left, token shards trained as if they held states). The runs against real
`vllm serve` processes are in test_vllm_online.py."""

from __future__ import annotations

import json
import shlex
import socket

import pytest
import torch
from conftest import CONVERSATIONS, extract_args, run_script, script


@pytest.fixture(scope="module")
def token_inputs(tiny_verifier, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    made = run_script(*extract_args(tiny_verifier, CONVERSATIONS, root / "hs"), "--storage-dtype", "none",
                      "--max-seq-len", "1024", "--context-tokens", "16")  # fmt: skip
    (root / "extract.log").write_text(made.stderr)
    run_script(script("02_build_vocab_mapping.py"), "--data-dir", str(root / "hs"), "--out-dir",
               str(root / "vocab"), "--draft-vocab-size", "96")  # fmt: skip
    return root


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed


def _train(root, *extra: str):
    return run_script(
        script("04_train.py"), "--data-dir", str(root / "hs"), "--vocab-mapping-dir", str(root / "vocab"),
        "--out-dir", str(root / "run"), "--overwrite", "--max-steps", "2", "--num-attention-heads", "4",
        "--num-key-value-heads", "4", "--head-dim", "64", "--intermediate-size", "512", *extra, check=False,
    )  # fmt: skip


def test_token_shards_keep_every_token_and_say_that_context_tokens_is_not_applied(token_inputs):
    """A config's context_tokens (the Kimi config's) given to token shards: whole samples, said in the log."""
    from eagle3_pipeline.data.shards import open_shards

    assert "context_tokens 16: not applied to token shards" in (token_inputs / "extract.log").read_text()
    samples = open_shards([str(token_inputs / "hs")], verify=False).samples
    assert samples and all(s.position == 0 for s in samples)  # none stored from a cut
    assert max(s.first_loss for s in samples) > 16 + 1  # where a cut at 16 would have applied


def test_with_no_server_left_the_run_stops_naming_each_server_and_why(token_inputs):
    urls = [f"http://127.0.0.1:{_closed_port()}" for _ in range(2)]
    proc = _train(token_inputs, "--states", "online", "--servers", *urls, "--request-timeout", "5")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no vLLM server left" in proc.stderr and "Traceback" not in proc.stderr
    for url in urls:
        assert f"{url} (APIConnectionError" in proc.stderr, proc.stderr[-3000:]
        assert f"server {url} failed" in proc.stderr


def test_token_shards_trained_as_states_shards_are_refused_with_the_fix(token_inputs):
    proc = _train(token_inputs)
    assert proc.returncode == 2
    assert "a token shard" in proc.stderr and "--states online" in proc.stderr, proc.stderr[-2000:]


def test_serve_line_asks_vllm_for_the_runs_layers_through_the_transfers_connector(token_inputs):
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.training.online import serve_line
    from eagle3_pipeline.data.shards import open_shards

    meta = open_shards([str(token_inputs / "hs")]).meta
    proc = run_script(script("04_train.py"), "--data-dir", str(token_inputs / "hs"), "--vocab-mapping-dir",
                      str(token_inputs / "vocab"), "--out-dir", "unused", "--states", "online",
                      "--serve-line", "--transfer-args=--hidden-states-path /dev/shm/x")  # fmt: skip
    argv = shlex.split(proc.stdout.strip().splitlines()[-1])

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    layers = sorted({*meta["aux_layer_ids"], meta["verifier"]["num_hidden_layers"]})
    spec = json.loads(value("--speculative-config"))
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == layers
    assert value("--max-model-len") == str(meta["max_seq_len"] + 1)
    assert "--no-enable-prefix-caching" in argv
    kv = json.loads(value("--kv-transfer-config"))
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"] == {
        "shared_storage_path": "/dev/shm/x"
    }
    assert kv["kv_connector"] == (
        "CpuHiddenStatesConnector" if not torch.cuda.is_available() else "ExampleHiddenStatesConnector"
    )

    def gpu_kv(transfer: str, args: str = "") -> dict:
        line = shlex.split(serve_line(TrainConfig(vocab_mapping_dir="v", out_dir="o", transfer=transfer,
                                                  transfer_args=args), meta))  # fmt: skip
        assert line[:3] == ["vllm", "serve", meta["verifier"]["path"]]
        return json.loads(line[line.index("--kv-transfer-config") + 1])

    assert "--trust-remote-code" not in argv
    kimi = {**meta, "config": {**meta["config"], "trust_remote_code": True}}  # as stage 01 ran for Kimi-K2.5
    assert "--trust-remote-code" in shlex.split(serve_line(TrainConfig(vocab_mapping_dir="v", out_dir="o"), kimi))
    assert gpu_kv("file")["kv_connector"] == "ExampleHiddenStatesConnector"
    assert gpu_kv("fp8")["kv_connector"] == "FP8HiddenStatesConnector"
    moon = gpu_kv("mooncake", "--mooncake-master 10.0.0.1:50051")
    assert moon["kv_connector"] == "MooncakeHiddenStatesConnector"
    assert moon["kv_connector_extra_config"]["mooncake"]["master_server_address"] == "10.0.0.1:50051"
    from eagle3_pipeline.core.errors import UserError

    with pytest.raises(UserError, match="not options of hs_connectors' file backend"):
        serve_line(TrainConfig(vocab_mapping_dir="v", out_dir="o", transfer_args="--mooncake-master x"), meta)


def test_transfers_are_hs_connectors_backends():
    from hs_connectors.transfer import HiddenStatesBackend

    from eagle3_pipeline.training.config import TRANSFERS

    assert set(TRANSFERS) == set(HiddenStatesBackend.registry)


def test_ranks_sharing_a_cache_folder_stay_inside_one_budget_together(tmp_path):
    """torchrun: every rank opens the same cache_dir with the whole budget and puts other samples; the
    folder holds at most the budget (each rank takes its share of the room it found), filled to within a
    sample per rank; a rank that opens the folder late (a restarted run) still keeps it inside."""
    from eagle3_pipeline.training.online import StateCache

    g = torch.Generator().manual_seed(0)
    blob = 50 * (3 * 64 + 64) * 4  # one sample's float32 states, each put below
    budget, root = 12 * blob, tmp_path / "c"

    def put(cache: StateCache, i: int) -> None:
        aux, last = torch.randn(50, 3, 64, generator=g), torch.randn(50, 64, generator=g)
        cache.put(f"s{i}", list(range(50)), aux, last)

    ranks = [StateCache(root, budget, "float32", {"verifier": "x"}, world=3) for _ in range(3)]
    for i in range(30):  # the ranks take turns, as their micro-batches do
        put(ranks[i % 3], i)
    used = sum(p.stat().st_size for p in root.iterdir())
    assert budget - 3 * blob < used <= budget, (used, budget)  # each with the whole budget: 2.5x over
    assert [c.stored for c in ranks] == [ranks[0].stored] * 3 and ranks[0].stored >= 3
    late = StateCache(root, budget, "float32", {"verifier": "x"}, world=3)
    for i in range(30, 40):
        put(late, i)
    assert sum(p.stat().st_size for p in root.iterdir()) <= budget


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_the_cache_never_exceeds_its_budget_and_returns_what_it_kept(tmp_path, dtype):
    from eagle3_pipeline.training.online import StateCache

    g = torch.Generator().manual_seed(0)
    samples = {
        f"s{i}": (torch.randn(50 + i, 3, 64, generator=g), torch.randn(50 + i, 64, generator=g))
        for i in range(20)
    }
    one = 50 * 4 * 64 * (4 if dtype == "float32" else 1)  # about one sample's states
    budget = 7 * one
    cache = StateCache(tmp_path / "c", budget, dtype, {"verifier": "x"})
    for sid, (aux, last) in samples.items():
        cache.put(sid, list(range(len(aux))), aux, last)
    used = sum(p.stat().st_size for p in (tmp_path / "c").iterdir())
    assert used <= budget and used == cache.used
    assert 3 <= cache.stored < len(samples)  # filled to the budget, the rest not kept
    kept = [sid for sid in samples if cache.get(sid, list(range(len(samples[sid][0])))) is not None]
    assert len(kept) == cache.stored
    aux, last = cache.get(kept[0], list(range(len(samples[kept[0]][0]))))
    tol = 0 if dtype == "float32" else 0.07  # e4m3: 3 mantissa bits, relative step 1/16 of the value
    assert torch.allclose(
        aux, samples[kept[0]][0], rtol=tol, atol=tol * float(samples[kept[0]][0].abs().max())
    )
    reopened = StateCache(tmp_path / "c", budget, dtype, {"verifier": "x"})
    assert reopened.used == used  # a resumed run counts what is there
    from eagle3_pipeline.core.errors import UserError

    with pytest.raises(UserError, match="another verifier"):
        StateCache(tmp_path / "c", budget, dtype, {"verifier": "y"})
