"""Reading hidden-state shards safely: only complete ones, checksummed, and all from one verifier setup.

Every later stage opens its `--data-dir` folders through `open_shards`, which refuses (naming the file)
a shard that is unfinished, truncated, or made with another verifier, other aux layer ids, hidden size,
dtype or storage dtype than the other shards or than the stage expects. Those start checks are cheap:
COMPLETE markers, meta.json, the manifest's sha256, file sizes, safetensors headers (shapes, dtypes) and
the offsets tensor; their cost grows with the number of parts, not with their bytes
(benchmarks/stage_start.py). The bytes themselves are checked when read: `load_sample` hashes the
sample it read against the sha256 recorded at extraction (in the DataLoader workers, off the training
step), `iter_part_tokens` the token tensors. A corrupt part is refused naming the file, at the latest
when it is read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.data import parts, state_dtype
from eagle3_pipeline.core import storage
from eagle3_pipeline.core.cli import progress
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.core.output import RUN_FILE, StageOutput, changed_settings

log = logging.getLogger("eagle3.shards")

# /2: storage_dtype (fp8 with scales), sha256 per sample (checked when read) and of the token tensors
SHARD_FORMAT = "eagle3-hidden-states/2"
TOKEN_KEYS = ("input_ids", "loss_mask", "offsets")  # what stage 02 reads of a part (tokens_sha256)
MANIFEST_FILE = "manifest.json"  # the finished parts: file, sha256, bytes, tokens_sha256, samples
PART_FILE = "part-{n:05d}.safetensors"

# The facts a consumer relies on; they must agree across shards and with what the consumer expects.
CONTRACT_KEYS = ("aux_layer_ids", "hidden_size", "dtype", "storage_dtype")
VERIFIER_KEYS = ("architecture", "num_hidden_layers", "hidden_size", "vocab_size")
REQUIRED_META_KEYS = ("verifier", *CONTRACT_KEYS, "manifest_sha256", "num_samples")


@dataclass(frozen=True)
class SampleRef:
    shard: str  # shard folder
    file: str  # part file name
    index: int  # position inside the part file
    sample_id: str
    num_tokens: int
    sha256: str = ""  # of the sample's stored bytes (storage.sha256_tensors), checked by load_sample
    start: int = 0  # a window of a longer sample (length_mix.windows): its first token; num_tokens its length
    position: int = 0  # the sequence position of the sample's first stored token (stage 01's context_tokens)
    first_loss: int = 0  # its first supervised token (0 in an older shard): windows before it train nothing


@dataclass
class ShardSet:
    shards: list[Path]
    meta: dict[str, Any]  # the first shard's meta (all agree on CONTRACT_KEYS and the verifier)
    samples: list[SampleRef]

    manifests: list[str] = field(default_factory=list)  # each shard's manifest_sha256: their content

    def made_from(self, folder: Path) -> dict[str, Any]:
        """What an output in `folder` built from these shards records of them (stages 02, 03, 04): the
        folders (relative to `folder`), their content (`shard_manifests`, what check_built_from and a
        resume compare: a byte-identical copy is the same shards) and the contract the next stage checks."""
        return {
            "shards": [storage.record_path(s, folder) for s in self.shards],
            "shard_manifests": self.manifests,
            "source": self.contract(),
        }

    def contract(self) -> dict[str, Any]:
        """What the next stage records and later checks: verifier identity + layout of the states."""
        return {
            "verifier": {k: self.meta["verifier"].get(k) for k in (*VERIFIER_KEYS, "fingerprint")},
            **{k: self.meta[k] for k in CONTRACT_KEYS},
        }

    def verifier_path(self) -> Path:
        """The verifier the shards were extracted with (its recorded path, read back by _check_shard)."""
        return Path(self.meta["verifier"]["path"])


def check_built_from(folder: Path, shard_set: ShardSet, flag: str) -> None:
    """An output of stage 02 or 03 (`folder`, given by `flag`) must have been built from the shards given
    now, compared by content (manifest sha256s, in any order), not by path; refused naming both."""
    meta = storage.read_json(folder / storage.META_NAME)
    recorded = meta.get("shard_manifests")
    if recorded is None:
        log.warning("%s records no shard checksums (made by an older version): not checked against "
                    "--data-dir", folder / storage.META_NAME)  # fmt: skip
        return
    if sorted(recorded) != sorted(shard_set.manifests):
        built = [str(storage.recorded_path(s, folder)) for s in meta.get("shards", [])]
        raise UserError(
            f"{flag} {folder} was built from other shards ({', '.join(built)}: manifest sha256 "
            f"{', '.join(m[:12] for m in recorded)}) than --data-dir "
            f"({', '.join(map(str, shard_set.shards))}: {', '.join(m[:12] for m in shard_set.manifests)}); "
            f"rebuild it from these shards with --overwrite, or pass the shards it was built from"
        )


def find_shard_dirs(data_dirs: list[str]) -> list[Path]:
    """Each path is a shard (has meta.json or run.json) or a root holding rows_* shards."""
    if not data_dirs:
        raise UserError("--data-dir is required: one or more hidden-state shard folders")
    out: list[Path] = []
    for d in data_dirs:
        p = Path(d)
        if not p.is_dir():
            raise UserError(f"{p}: not a folder (--data-dir)")
        if (p / storage.META_NAME).exists() or (p / RUN_FILE).exists() or p.name.startswith("rows_"):
            out.append(p)
        else:
            found = sorted(q for q in p.iterdir() if q.is_dir() and q.name.startswith("rows_"))
            if not found:
                raise UserError(f"{p}: no rows_* shard folders inside (--data-dir)")
            out.extend(found)
    return out


def open_shards(data_dirs: list[str], expect: dict[str, Any] | None = None, verify: bool = True) -> ShardSet:
    shards = find_shard_dirs(data_dirs)
    metas = [_check_shard(s, verify) for s in shards]
    first = metas[0]
    for s, m in zip(shards[1:], metas[1:]):
        _check_same(s, m, first, f"the first shard {shards[0]}")
    if expect is not None:
        _check_expected(shards[0], first, expect)
    samples: list[SampleRef] = []
    seen: dict[str, Path] = {}
    for s in shards:
        manifest = storage.read_json(s / MANIFEST_FILE)
        for f in manifest["files"]:
            for i, smp in enumerate(f["samples"]):
                if smp["id"] in seen:
                    raise UserError(
                        f"{s}: sample id {smp['id']!r} also in {seen[smp['id']]}; shards overlap "
                        "(same rows extracted twice? A second version of the same conversations, such as "
                        "the given answers beside the regenerated ones, extracts with --variant NAME)"
                    )
                seen[smp["id"]] = s
                samples.append(SampleRef(str(s), f["file"], i, smp["id"], smp["num_tokens"], smp["sha256"],
                                         position=smp.get("position", 0),
                                         first_loss=smp.get("first_loss", 0)))  # fmt: skip
    if not samples:
        raise UserError(f"{', '.join(map(str, shards))}: no samples (every row was rejected?)")
    return ShardSet(shards, first, samples, [m["manifest_sha256"] for m in metas])


@contextlib.contextmanager
def open_for_output(data_dirs: list[str], out: StageOutput) -> Iterator[ShardSet | None]:
    """What stages 02 and 03 do first: None (a logged skip) when `out` is complete and not --overwrite;
    else, this process the one writer of `out` for the block (StageOutput.lock), the shards, opened and
    checked before an unfinished output is removed."""
    if out.skip():
        yield None
        return
    with out.lock():
        shard_set = open_shards(data_dirs)
        if not out.start_fresh():  # another writer finished it meanwhile
            yield None
            return
        yield shard_set


def _check_shard(shard: Path, verify: bool) -> dict[str, Any]:
    if not storage.is_complete(shard):
        raise UserError(
            f"{shard}: shard is not complete (extraction still running or interrupted); "
            "rerun the same 01_extract_hidden_states.py command to finish it"
        )
    meta = storage.read_json(shard / storage.META_NAME)
    if meta.get("format") != SHARD_FORMAT:
        raise UserError(
            f"{shard / storage.META_NAME}: format {meta.get('format')!r}, expected {SHARD_FORMAT}"
        )
    missing = [k for k in REQUIRED_META_KEYS if k not in meta]
    missing += [
        f"verifier.{k}" for k in ("path", *VERIFIER_KEYS, "rms_norm_eps") if k not in meta.get("verifier", {})
    ]
    if missing:
        raise UserError(
            f"{shard / storage.META_NAME}: missing {missing}; this stage needs them (re-extract "
            "the shard with this version of 01_extract_hidden_states.py)"
        )
    _check_meta_matches_run(shard, meta)
    # recorded relative to the shard (storage.record_path): read back as a path to open, here only
    meta["verifier"]["path"] = str(storage.recorded_path(meta["verifier"]["path"], shard))
    manifest_path = shard / MANIFEST_FILE
    if not manifest_path.is_file():
        raise UserError(f"{manifest_path}: missing; the shard is corrupt, re-extract it with --overwrite")
    if storage.sha256_file(manifest_path) != meta["manifest_sha256"]:
        raise UserError(
            f"{manifest_path}: checksum mismatch with meta.json; the shard is corrupt, "
            "re-extract it with --overwrite"
        )
    if verify:
        files = storage.read_json(manifest_path)["files"]
        for f in progress(files, desc=f"verify {shard.name}", unit="file"):
            path = shard / f["file"]
            if not path.is_file():
                raise UserError(f"{path}: missing; re-extract the shard with --overwrite")
            if path.stat().st_size != f["bytes"]:
                raise UserError(
                    f"{path}: {path.stat().st_size} bytes, manifest says {f['bytes']} (truncated?); "
                    "re-extract the shard with --overwrite"
                )
            _check_part_layout(path, meta, [s["num_tokens"] for s in f["samples"]])
    return meta


def _check_meta_matches_run(shard: Path, meta: dict[str, Any]) -> None:
    """meta.json against the run.json stage 01 pinned (the same settings, written apart): every fact a
    consumer reads of meta.json (verifier, layer ids, dtypes, fp8 scales, template) is among them, so a
    changed byte in either file is refused here instead of read as another verifier or layout."""
    run_file = shard / RUN_FILE
    if not run_file.is_file():  # a shard written before run.json was kept: meta.json alone
        return
    run = storage.read_json(run_file)
    differ = changed_settings(run, meta, keys=sorted(run))
    if meta["hidden_size"] != meta["verifier"]["hidden_size"]:
        differ.append("hidden_size")
    if differ:
        raise UserError(
            f"{shard / storage.META_NAME}: {', '.join(differ)} differ from {run_file} (the settings the "
            "shard was written with); one of the files is corrupt, re-extract the shard with --overwrite"
        )


@contextlib.contextmanager
def reading_part(path: Path) -> Iterator[None]:
    """A part file read through safetensors: a missing file or a header it cannot parse (a flipped byte,
    a foreign file) is a UserError naming the file, not safetensors' own error that names none."""
    from safetensors import SafetensorError

    try:
        yield
    except FileNotFoundError:
        raise UserError(f"{path}: missing; re-extract the shard with --overwrite") from None
    except SafetensorError as e:
        raise UserError(
            f"{path}: not a readable safetensors file ({e}); the shard is corrupt, re-extract it with "
            "--overwrite"
        ) from None


_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", state_dtype.FP8: "F8_E4M3"}


def _check_part_layout(path: Path, meta: dict[str, Any], num_tokens: list[int]) -> None:
    """Tensor shapes and dtypes of a part file against meta.json and the manifest's token counts."""
    from safetensors import safe_open

    n_tok, n_aux, hidden = sum(num_tokens), len(meta["aux_layer_ids"]), meta["hidden_size"]
    want = {"input_ids": [n_tok], "loss_mask": [n_tok], "offsets": [len(num_tokens) + 1]}
    states = has_states(meta)
    if states:
        want.update(aux_hidden_states=[n_tok, n_aux, hidden], last_hidden_state=[n_tok, hidden])
    if meta["storage_dtype"] == state_dtype.FP8:
        per_sample = meta.get("fp8_scales") == state_dtype.FP8_SCALES
        suffix, rows = (
            (state_dtype.SAMPLE_SCALE, len(num_tokens)) if per_sample else (state_dtype.TOKEN_SCALE, n_tok)
        )
        want["aux_hidden_states" + suffix] = [rows, n_aux]
        want["last_hidden_state" + suffix] = [rows]
    with reading_part(path), safe_open(str(path), "pt") as f:
        for name, shape in want.items():
            if name not in f.keys():
                raise UserError(f"{path}: no tensor {name!r}; re-extract the shard with --overwrite")
            got = f.get_slice(name).get_shape()
            if list(got) != shape:
                raise UserError(
                    f"{path}: {name} has shape {list(got)}, meta.json and manifest.json say "
                    f"{shape}; re-extract the shard with --overwrite"
                )
        for name in state_dtype.STATE_KEYS if states else ():
            dtype = f.get_slice(name).get_dtype()
            stored = meta["storage_dtype"]
            if dtype != _SAFETENSORS_DTYPE.get(stored, stored):
                raise UserError(f"{path}: {name} is {dtype}, meta.json says storage_dtype {stored}")
        lengths = (f.get_tensor("offsets").diff()).tolist()
        if lengths != num_tokens:
            raise UserError(f"{path}: sample lengths {lengths} differ from manifest.json's {num_tokens}")


def has_states(meta: dict[str, Any]) -> bool:
    """Whether the shard stores hidden states (a token shard, storage dtype "none", does not)."""
    return meta["storage_dtype"] != state_dtype.NO_STATES


def _check_same(shard: Path, meta: dict[str, Any], ref: dict[str, Any], ref_name: str) -> None:
    for key in CONTRACT_KEYS:
        if meta[key] != ref[key]:
            raise UserError(
                f"{shard / storage.META_NAME}: {key} {meta[key]} differs from {ref[key]} in "
                f"{ref_name}; shards of one run must share verifier, layer ids, hidden size, dtype and "
                "storage dtype"
            )
    mine, theirs = meta["verifier"].get("fingerprint"), ref["verifier"].get("fingerprint")
    if mine and theirs and mine != theirs:  # same shapes, other weights (a base model and its fine-tune)
        raise UserError(
            f"{shard / storage.META_NAME}: verifier fingerprint {mine} differs from {theirs} in {ref_name}; "
            "the shard comes from another verifier (same config, other weights)"
        )
    for key in VERIFIER_KEYS:
        if meta["verifier"][key] != ref["verifier"][key]:
            raise UserError(
                f"{shard / storage.META_NAME}: verifier {key} {meta['verifier'][key]} differs from "
                f"{ref['verifier'][key]} in {ref_name}; the shard comes from another verifier"
            )


def _check_expected(shard: Path, meta: dict[str, Any], expect: dict[str, Any]) -> None:
    for key in CONTRACT_KEYS:
        if key in expect and meta[key] != expect[key]:
            raise UserError(
                f"{shard / storage.META_NAME}: {key} {meta[key]}, but this stage expects "
                f"{expect[key]} (from {expect.get('_source', 'its inputs')})"
            )
    for key in VERIFIER_KEYS:
        want = expect.get("verifier", {}).get(key)
        if want is not None and meta["verifier"][key] != want:
            raise UserError(
                f"{shard / storage.META_NAME}: verifier {key} {meta['verifier'][key]}, but this "
                f"stage expects {want} (from {expect.get('_source', 'its inputs')}); the shard "
                "comes from another verifier"
            )


def load_sample(
    ref: SampleRef,
    keys: tuple[str, ...] = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"),
) -> dict[str, torch.Tensor]:
    """One sample's tensors, read by slicing the part file (never the whole file), checked, decoded.

    Every stored tensor of the sample is read and hashed against the sha256 that stage 01 recorded,
    so corruption anywhere in the sample's bytes is refused naming the file; fp8 states come back as
    float32 (state_dtype.decode).
    """
    from safetensors import safe_open

    path = Path(ref.shard) / ref.file
    with reading_part(path), safe_open(str(path), "pt") as f:
        offsets = f.get_tensor("offsets")
        a, b = int(offsets[ref.index]), int(offsets[ref.index + 1])
        i = ref.index
        stored = {
            k: f.get_slice(k)[i : i + 1] if state_dtype.is_per_sample(k) else f.get_slice(k)[a:b]
            for k in f.keys()
            if k != "offsets"
        }
    if ref.sha256 and storage.sha256_tensors(stored) != ref.sha256:
        raise UserError(
            f"{path}: sha256 of sample {ref.sample_id!r} (#{ref.index}) differs from manifest.json "
            "(corrupt file); re-extract the shard with --overwrite"
        )
    decoded = state_dtype.decode(stored)
    return {k: decoded[k] for k in keys}


def iter_part_tokens(shards: list[Path]) -> Any:
    """(input_ids, loss_mask) of whole part files, for token statistics; checked against tokens_sha256."""
    from safetensors import safe_open

    for s in shards:
        for f in storage.read_json(s / MANIFEST_FILE)["files"]:
            path = s / f["file"]
            with reading_part(path), safe_open(str(path), "pt") as st:
                tokens = {k: st.get_tensor(k) for k in TOKEN_KEYS}
            if storage.sha256_tensors(tokens) != f["tokens_sha256"]:
                raise UserError(
                    f"{path}: sha256 of the token tensors differs from manifest.json (corrupt file); "
                    "re-extract the shard with --overwrite"
                )
            yield tokens["input_ids"], tokens["loss_mask"]


# ---- writing (stage 01) ---------------------------------------------------------------------------


def part_info_name(n: int) -> str:
    """The record of part n while the shard is being written (a part done; gone once COMPLETE)."""
    return f"part-{n:05d}.json"


def write_part(
    shard: Path,
    n: int,
    samples: list[dict],
    rejects: list[dict],
    tensors: dict[str, list[torch.Tensor]],
    rows: tuple[int, int],
) -> None:
    """Part n of a shard: its samples' tensors joined (offsets added) and its record (samples, rejects,
    checksums); a part without samples has a record only."""
    info: dict[str, Any] = {"rows": list(rows), "samples": samples, "rejects": rejects, "file": None}
    if samples:
        lengths = [len(t) for t in tensors["input_ids"]]
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        fname = PART_FILE.format(n=n)
        joined = {k: torch.cat(v) for k, v in tensors.items()}
        joined["offsets"] = offsets
        digest = storage.save_safetensors_atomic(joined, shard / fname, metadata={"format": SHARD_FORMAT})
        info.update(
            file=fname,
            sha256=digest,
            bytes=(shard / fname).stat().st_size,
            tokens_sha256=storage.sha256_tensors({k: joined[k] for k in TOKEN_KEYS}),
        )
    storage.write_json_atomic(shard / part_info_name(n), info)


def finish_shard(
    out: StageOutput, num_parts: int, settings: dict[str, Any], provenance: dict[str, Any]
) -> None:
    """manifest.json, rejects.jsonl, meta.json and COMPLETE from the parts' records (every input row written
    or rejected, else RuntimeError); the part records go only once COMPLETE is there."""
    shard = out.out_dir
    files, rejects = [], []
    num_samples = num_tokens = num_loss_tokens = num_rows_written = num_truncated = 0
    for n in range(num_parts):
        info = storage.read_json(shard / part_info_name(n))
        rejects.extend(info["rejects"])
        if info["file"]:
            files.append({k: info[k] for k in ("file", "sha256", "bytes", "tokens_sha256", "samples")})
            num_samples += len(info["samples"])
            num_rows_written += len({s["row"] for s in info["samples"]})  # a row may give several samples
            num_truncated += sum("truncated_from" in s for s in info["samples"])
            num_tokens += sum(s["num_tokens"] for s in info["samples"])
            num_loss_tokens += sum(s["num_loss_tokens"] for s in info["samples"])
    num_rows = settings["row_range"][1] - settings["row_range"][0]
    parts.check_every_row(shard, num_rows_written, len(rejects), num_rows)
    if not num_samples:  # a shard of nothing would pass for data (and replace a good one)
        raise UserError(
            f"{shard}: every one of the {num_rows} rows was rejected, by reason "
            f"{json.dumps(reason_counts(rejects))}; "
            "no empty shard is published. Fix the data or the settings (e.g. --max-seq-len, --truncate) "
            "and rerun with --overwrite"
        )
    storage.write_json_atomic(shard / MANIFEST_FILE, {"files": files})
    parts.write_rejects(shard, rejects)
    manifest_sha = storage.sha256_file(shard / MANIFEST_FILE)
    meta = {
        **settings,
        "stage": "01_extract_hidden_states",
        "hidden_size": settings["verifier"]["hidden_size"],
        "num_aux_layers": len(settings["aux_layer_ids"]),
        "num_rows": num_rows,
        "num_rows_written": num_rows_written,
        "num_samples": num_samples,
        "num_truncated": num_truncated,
        "num_rejected": len(rejects),
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss_tokens,
        "manifest_sha256": manifest_sha,
        **provenance,
    }
    out.finish(meta)
    for n in range(num_parts):  # only now: a crash before COMPLETE must find every finished part
        (shard / part_info_name(n)).unlink()
    log.info(
        "done %s | rows %d | written %d | samples %d | truncated %d | rejected %d (see rejects.jsonl) "
        "| tokens %d | loss tokens %d",
        shard,
        num_rows,
        num_rows_written,
        num_samples,
        num_truncated,
        len(rejects),
        num_tokens,
        num_loss_tokens,
    )
    if rejects:
        log.warning("rejected rows by reason: %s", json.dumps(reason_counts(rejects)))


def reason_counts(rejects: list[dict[str, Any]]) -> dict[str, int]:
    """Rejected rows per reason, numbers and parentheses folded: "turn 3 (assistant) is empty" counts as
    "turn N is empty"."""
    reasons: dict[str, int] = {}
    for r in rejects:
        key = re.sub(r"(?<![\w-])\d+(?![\w-])", "N", re.sub(r"\s*\([^)]*\)", "", r["reason"]))
        reasons[key] = reasons.get(key, 0) + 1
    return reasons
