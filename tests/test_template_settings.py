"""chat_template_kwargs (issue 8): a dict setting on the command line and in TOML, recorded by stage 01,
and 06_evaluate.py's prompts built with the same settings as training."""

from __future__ import annotations

import json

import pytest
from kimi_fixture import IDS, build_kimi_tokenizer

from eagle3_pipeline.export_eval import evaluate
from eagle3_pipeline.core.cli import build_parser
from eagle3_pipeline.export_eval.config import EvaluateConfig, ExportConfig
from eagle3_pipeline.data.config import ExtractConfig, RegenerateConfig
from eagle3_pipeline.training.config import TrainConfig
from eagle3_pipeline.core.config import resolve_config
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.samples import SampleOptions, row_samples

ROWS = [
    {
        "id": "a",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        ],
    },
    {
        "id": "b",
        "messages": [
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
        ],
    },
]
INSTANT = {"thinking": False}


def resolve(section, cls, argv, tmp_path=None, toml=None):
    if toml is not None:
        (tmp_path / "c.toml").write_text(toml)
        argv = ["--config", str(tmp_path / "c.toml"), *argv]
    return resolve_config(cls, build_parser(None, cls).parse_args(argv), section)


def test_dict_setting_from_command_line_and_toml_table(tmp_path):
    base = ["--verifier-path", "v", "--data-path", "d", "--out-dir", "o"]
    assert resolve("extract", ExtractConfig, base).chat_template_kwargs == {}
    cfg = resolve("extract", ExtractConfig, [*base, "--chat-template-kwargs", '{"thinking": false}'])
    assert cfg.chat_template_kwargs == INSTANT
    toml = (
        '[extract]\nverifier_path = "v"\ndata_path = "d"\nout_dir = "o"\n'
        "[extract.chat_template_kwargs]\nthinking = false\n"
    )
    assert resolve("extract", ExtractConfig, [], tmp_path, toml).chat_template_kwargs == INSTANT
    # the command line wins over the file
    cfg = resolve("extract", ExtractConfig, ["--chat-template-kwargs", '{"thinking": true}'], tmp_path, toml)
    assert cfg.chat_template_kwargs == {"thinking": True}
    with pytest.raises(UserError, match="chat_template_kwargs = 'yes': expected dict"):
        resolve(
            "extract",
            ExtractConfig,
            [],
            tmp_path,
            toml.split("[extract.chat")[0] + 'chat_template_kwargs = "yes"\n',
        )
    ev = ["--draft-dir", "x", "--data-path", "d"]
    assert resolve("evaluate", EvaluateConfig, ev).chat_template_kwargs is None  # None: read from the shards


SERVING_TOML = (
    '[serving]\nmode = "{mode}"\n[regenerate]\nverifier_path = "v"\ndata_path = "d"\nout_dir = "o"\n{regen}'
    '[extract]\nverifier_path = "v"\ndata_path = "d"\nout_dir = "o"\n'
    '[evaluate]\ndraft_dir = "x"\ndata_path = "d"\n'
    '[train]\ndata_dir = ["h"]\nvocab_mapping_dir = "m"\nout_dir = "o"\n'
    '[export]\ntrain_dir = "t"\nout_dir = "o"\n'
)


@pytest.mark.parametrize(
    "mode, temperature, top_p, kwargs, loss, drafting",
    [("thinking", 1.0, 0.95, {}, "kl_div", "probabilistic"),
     ("instant", 0.6, 0.95, INSTANT, "kl_div", "probabilistic"),
     ("greedy", 0.0, 1.0, {}, "ce", "greedy")],
)  # fmt: skip
def test_serving_mode_sets_regeneration_prompts_training_serving_and_evaluation_for_the_mode_served(
    tmp_path, mode, temperature, top_p, kwargs, loss, drafting
):
    toml = SERVING_TOML.format(mode=mode, regen="")
    regen = resolve("regenerate", RegenerateConfig, [], tmp_path, toml)
    assert (regen.temperature, regen.top_p, regen.chat_template_kwargs) == (temperature, top_p, kwargs)
    assert resolve("extract", ExtractConfig, [], tmp_path, toml).chat_template_kwargs == kwargs
    assert resolve("train", TrainConfig, [], tmp_path, toml).loss == loss
    assert resolve("export", ExportConfig, [], tmp_path, toml).draft_sample_method == drafting
    ev = resolve("evaluate", EvaluateConfig, [], tmp_path, toml)
    assert (ev.temperature, ev.top_p, ev.draft_sample_method) == (temperature, top_p, drafting)
    assert ev.chat_template_kwargs is None  # evaluation still renders prompts as its shards were extracted


def test_stage_keys_and_flags_win_over_the_serving_mode(tmp_path):
    toml = SERVING_TOML.format(mode="thinking", regen="temperature = 0.0\n")
    regen = resolve("regenerate", RegenerateConfig, [], tmp_path, toml)
    assert (regen.temperature, regen.top_p) == (0.0, 0.95)  # the section's key wins, the mode fills the rest
    ev = resolve("evaluate", EvaluateConfig, ["--temperature", "0.6"], tmp_path, toml)
    assert (ev.temperature, ev.top_p) == (0.6, 0.95)


@pytest.mark.parametrize(
    "serving, message",
    [('mode = "fast"', r"\[serving\] mode = 'fast': choose one of \['greedy', 'instant', 'thinking'\]"),
     ('mode = "thinking"\ntemperature = 1.0', r"unknown key\(s\) \['temperature'\] in \[serving\]")],
)  # fmt: skip
def test_unknown_serving_mode_or_key_is_an_error_naming_the_choices(tmp_path, serving, message):
    toml = SERVING_TOML.format(mode="thinking", regen="").replace('mode = "thinking"', serving)
    with pytest.raises(UserError, match=message):
        resolve("extract", ExtractConfig, [], tmp_path, toml)


@pytest.mark.parametrize("bad", ["{thinking: false}", "[1, 2]", '"thinking"'])
def test_dict_flag_that_is_not_a_json_object_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(None, ExtractConfig).parse_args(["--chat-template-kwargs", bad])
    assert e.value.code == 2 and "--chat-template-kwargs" in capsys.readouterr().err


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_tokenizer")
    build_kimi_tokenizer(d)
    return d


def fake_export(root, kwargs_per_shard):
    """The files 06_evaluate.py follows: export_meta.json -> training meta.json -> shard meta.json."""
    shards = []
    for n, kw in enumerate(kwargs_per_shard):
        shard = root / "hs" / f"rows_{n}"
        shard.mkdir(parents=True)
        meta = {"stage": "01_extract_hidden_states"}
        if kw is not None:
            meta["chat_template_kwargs"] = kw
        (shard / "meta.json").write_text(json.dumps(meta))
        shards.append(str(shard))
    (root / "train").mkdir()
    (root / "train" / "meta.json").write_text(json.dumps({"shards": shards}))
    (root / "draft").mkdir()
    (root / "draft" / "config.json").write_text("{}")
    return root / "draft"


def run_evaluate(monkeypatch, kimi_dir, draft, data, kwargs=None):
    (draft / "export_meta.json").write_text(
        json.dumps({"verifier_path": str(kimi_dir), "train_dir": str(draft.parent / "train")})
    )
    seen = {}

    def fake_simulate(verifier_path, draft_dir, prompts, max_new_tokens, k, *args, **kwargs):
        seen["prompts"] = prompts
        return {"mean_acceptance_length": 1.0, "acceptance_rate_per_pos": [0.0] * k, "num_drafts": 0}, []

    monkeypatch.setattr(evaluate, "simulate", fake_simulate)
    cfg = EvaluateConfig(
        draft_dir=str(draft), data_path=str(data), num_prompts=2, chat_template_kwargs=kwargs
    )
    assert evaluate.run(cfg) == 0
    result = json.loads((draft / "acceptance_sim.json").read_text())
    return seen["prompts"], result


def training_contexts(kimi, kwargs):
    """Stage 01's context for each row's first sample: what the draft was trained to continue."""
    out = []
    for i, row in enumerate(ROWS):
        s = row_samples(row, i, kimi, SampleOptions(4096, chat_template_kwargs=kwargs))[0]
        out.append(s.input_ids[: s.loss_mask.index(1)])
    return out


def test_evaluate_prompts_use_the_template_settings_the_shards_were_extracted_with(
    monkeypatch, kimi_dir, tmp_path
):
    from transformers import AutoTokenizer

    kimi = AutoTokenizer.from_pretrained(str(kimi_dir))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    draft = fake_export(tmp_path / "instant", [INSTANT, INSTANT])
    prompts, result = run_evaluate(monkeypatch, kimi_dir, draft, data)
    assert prompts == training_contexts(kimi, INSTANT) != training_contexts(kimi, {})
    assert all(p[-2:] == [IDS["<think>"], IDS["</think>"]] for p in prompts)  # instant generation prompt
    assert result["chat_template_kwargs"] == INSTANT
    # shards from thinking mode (or from before the setting existed): the thinking prompt
    draft = fake_export(tmp_path / "thinking", [None])
    prompts, result = run_evaluate(monkeypatch, kimi_dir, draft, data)
    assert prompts == training_contexts(kimi, {}) and all(p[-1] == IDS["<think>"] for p in prompts)
    # given on the command line, it wins
    prompts, _ = run_evaluate(monkeypatch, kimi_dir, draft, data, kwargs=INSTANT)
    assert prompts == training_contexts(kimi, INSTANT)


def test_evaluate_refuses_shards_with_mixed_template_settings(monkeypatch, kimi_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    draft = fake_export(tmp_path / "mixed", [INSTANT, {}])
    with pytest.raises(UserError, match="different chat_template_kwargs"):
        run_evaluate(monkeypatch, kimi_dir, draft, data)


def test_kimi_config_regenerates_trains_serves_and_evaluates_for_thinking_mode():
    """configs/kimi_k25.toml serves thinking mode: stage 00 samples at 1.0 / 0.95, stage 04 trains on the
    verifier's distribution, stage 05 prints a serve line drafting probabilistically and stage 06
    evaluates there, from its one [serving] setting."""
    from pathlib import Path

    kimi = str(Path(__file__).resolve().parent.parent / "configs" / "kimi_k25.toml")
    regen = resolve("regenerate", RegenerateConfig, ["--config", kimi])
    ev = resolve("evaluate", EvaluateConfig, ["--config", kimi])
    assert (regen.temperature, regen.top_p, ev.temperature, ev.top_p) == (1.0, 0.95, 1.0, 0.95)
    assert resolve("extract", ExtractConfig, ["--config", kimi]).chat_template_kwargs == {}
    assert resolve("train", TrainConfig, ["--config", kimi]).loss == "kl_div"
    assert ev.draft_sample_method == "probabilistic"
    assert resolve("export", ExportConfig, ["--config", kimi]).draft_sample_method == "probabilistic"
