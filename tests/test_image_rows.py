"""Image rows through the stages: stage 00 and 01 on the tiny Kimi-K2.5 with its vision tower, a text-only
verifier's rejects, the states at image positions, and configs/tiny_vl.toml end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.data.conversations import NO_VISION_TOWER, RawRow, RowRejected
from eagle3_pipeline.data.images import ImageTokens, image_runs

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


def test_image_runs_count_each_image_apart():
    assert image_runs([1, 9, 9, 2, 3, 9, 4, 9, 9, 9], 9) == [2, 1, 3]
    assert image_runs([], 9) == []
