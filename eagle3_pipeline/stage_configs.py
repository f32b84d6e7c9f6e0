"""Every stage's config class by its [section], in the pipeline's order (core/layout.py STAGES): what walks
all stages at once (the tests of the config schema, a config file checked whole) reads. Each class lives with
the package that owns its stage; core, below them all, cannot gather them."""

from __future__ import annotations

from eagle3_pipeline.data.config import ExtractConfig, RegenerateConfig, SplitConfig, VocabConfig
from eagle3_pipeline.export_eval.config import EvaluateConfig, ExportConfig
from eagle3_pipeline.training.config import TrainConfig

_CLASSES = (RegenerateConfig, ExtractConfig, VocabConfig, SplitConfig, TrainConfig, ExportConfig, EvaluateConfig)
STAGE_CONFIGS: dict[str, type] = {cls.SECTION: cls for cls in _CLASSES}
