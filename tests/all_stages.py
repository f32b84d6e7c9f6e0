"""Every stage's config class by its [section], in the stages' order: what the schema tests walk. Each class
lives with the package that owns its stage (data, training, export_eval config.py); the package itself never
needs them all at once, so they are gathered here."""

from __future__ import annotations

from eagle3_pipeline.data.config import ExtractConfig, RegenerateConfig, SplitConfig, VocabConfig
from eagle3_pipeline.export_eval.config import EvaluateConfig, ExportConfig
from eagle3_pipeline.training.config import TrainConfig

_CLASSES = (RegenerateConfig, ExtractConfig, VocabConfig, SplitConfig, TrainConfig, ExportConfig, EvaluateConfig)
STAGE_CONFIGS: dict[str, type] = {cls.SECTION: cls for cls in _CLASSES}
