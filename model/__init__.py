"""NormLab model package: `from model import NormLabConfig, NormLabModel, ...`.

Importing it registers NormLab with the Auto classes and for `register_for_auto_class`, so `save_pretrained`
copies this package's files next to the weights and a checkpoint loads with `trust_remote_code=True` anywhere.
The files import each other only relatively: that is how they run once copied into a checkpoint.
"""

from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

from .configuration_normlab import NORM_PLACEMENTS, NORM_TYPES, NormLabConfig
from .modeling_normlab import (
    NormLabForMaskedLM,
    NormLabForSequenceClassification,
    NormLabModel,
    NormLabPreTrainedModel,
)

# exist_ok: the package may be imported twice under different names (e.g. in tests or notebooks that reload it).
AutoConfig.register(NormLabConfig.model_type, NormLabConfig, exist_ok=True)
AutoModel.register(NormLabConfig, NormLabModel, exist_ok=True)
AutoModelForSequenceClassification.register(NormLabConfig, NormLabForSequenceClassification, exist_ok=True)
AutoModelForMaskedLM.register(NormLabConfig, NormLabForMaskedLM, exist_ok=True)

NormLabConfig.register_for_auto_class()
NormLabModel.register_for_auto_class("AutoModel")
NormLabForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
NormLabForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")

__all__ = [
    "NormLabConfig", "NormLabPreTrainedModel", "NormLabModel", "NormLabForSequenceClassification",
    "NormLabForMaskedLM", "NORM_TYPES", "NORM_PLACEMENTS",
]
