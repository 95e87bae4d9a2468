"""Hugging Face's own common tests, as an in-tree model runs them: transformers' ModelTesterMixin and ConfigTester
(from the transformers sdist of the installed version, fetched by tests/hf_common.py) with our own small tester, in
the default configuration (LayerNorm) and with masked BatchNorm (batch statistics, running statistics, gradient
checkpointing)."""

import importlib
import os
import subprocess
import unittest
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers.models.auto import modeling_auto as auto

from hf_common import transformers_tests
from model import NormLabConfig, NormLabForMaskedLM, NormLabForSequenceClassification, NormLabModel

pytestmark = pytest.mark.slow  # transformers' common model tests (and a package-registry fetch on first use)

try:
    _pkg = transformers_tests()
except (RuntimeError, OSError, subprocess.SubprocessError) as err:
    pytest.skip(f"transformers' common tests could not be fetched from the package registry ({err})",
                allow_module_level=True)
ModelTesterMixin = importlib.import_module(f"{_pkg}.test_modeling_common").ModelTesterMixin
ConfigTester = importlib.import_module(f"{_pkg}.test_configuration_common").ConfigTester


class NormLabModelTester:
    """A tiny NormLab and a padded batch (random attention mask, each row with at least its last token real)."""

    def __init__(self, parent, batch_size=4, seq_length=7, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=37, num_labels=3, is_training=True, **config):
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size = num_attention_heads, intermediate_size
        self.num_labels, self.is_training = num_labels, is_training
        self.config_overrides = config

    def get_config(self):
        return NormLabConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            max_position_embeddings=64, num_labels=self.num_labels, **self.config_overrides,
        )

    def prepare_config_and_inputs_for_common(self):
        g = torch.Generator().manual_seed(0)
        shape = (self.batch_size, self.seq_length)
        input_ids = torch.randint(1, self.vocab_size, shape, generator=g)
        attention_mask = (torch.rand(shape, generator=g) > 0.3).long()
        attention_mask[:, -1] = 1  # every row keeps a real token
        attention_mask[0] = 1  # and one row has no padding
        token_type_ids = torch.randint(0, 2, shape, generator=g)
        inputs = {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask,
                  "token_type_ids": token_type_ids}
        return self.get_config(), inputs


class NormLabModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (NormLabModel, NormLabForSequenceClassification, NormLabForMaskedLM)

    def setUp(self):
        self.model_tester = NormLabModelTester(self)
        self.config_tester = ConfigTester(self, config_class=NormLabConfig, hidden_size=32, num_attention_heads=4)
        # The common tests look classes up by name in transformers' tables of in-tree models (which class is a
        # base model, a classifier, a masked LM): list ours there for the duration of each test.
        for table, name in ((auto.MODEL_MAPPING_NAMES, NormLabModel),
                            (auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, NormLabForSequenceClassification),
                            (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, NormLabForMaskedLM)):
            self.enterContext(mock.patch.dict(table, {NormLabConfig.model_type: name.__name__}))

    def test_config(self):
        self.config_tester.run_common_tests()


class NormLabMaskedBatchNormModelTest(NormLabModelTest):
    """The same common tests with masked BatchNorm: statistics from the batch in training, running statistics in
    eval, gradient checkpointing included."""

    def setUp(self):
        super().setUp()
        self.model_tester = NormLabModelTester(self, norm="masked_batchnorm")
