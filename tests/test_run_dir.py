"""The run directory object (normlab/run_dir.py): its layout, the validated config it reads back, summary.json."""

import json

import pytest
import yaml

from normlab.config.loader import ConfigError, load_config, replace_keys
from normlab.run_dir import RunDir


def test_the_layout_and_a_saved_config_read_back_validated(tmp_path):
    cfg = load_config("post_ln", [f"output_dir={tmp_path / 'run'}", "train.lr=1e-3", "wandb.tags=[a]"])
    run = RunDir.of(cfg)
    assert run.path == tmp_path / "run" and run.read_config() is None and run.read_summary() is None
    run.save_config(cfg)
    assert [p.name for p in (run.config_file, run.metrics_file, run.summary_file, run.checkpoints, run.final,
                             run.wandb_dir, run.run_record_file)] == [
        "config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "final", "wandb", "run.json"]
    back = run.read_config()
    assert back == cfg and back.train.lr == 1e-3 and back.model.norm_placement == "post"
    assert yaml.safe_load(run.config_file.read_text()) == cfg  # the mapping view is what the file holds
    run.write_summary({"status": "completed", "step": 3})
    assert run.status() == "completed" and json.loads(run.summary_file.read_text())["step"] == 3


def test_a_damaged_or_invalid_saved_config_is_one_config_error(tmp_path):
    run = RunDir(tmp_path)
    run.config_file.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"config.yaml line \d+ is not valid YAML"):
        run.read_config()
    run.config_file.write_text("train: {lrr: 1}\n")
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'.*did you mean 'train.lr'"):
        run.read_config()


def test_a_saved_config_that_names_a_checkpoint_rotated_away_still_reads(tmp_path):
    """A run resumed from checkpoints/step_N saves that path; once the rotation deleted it, the run's config (and
    its final/'s copy, which evaluate.py reads) must still load: only a command's own train.resume is checked."""
    step = tmp_path / "run" / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    cfg = load_config(overrides=[f"output_dir={tmp_path / 'run'}", f"train.resume={step}"])
    RunDir.of(cfg).save_config(cfg)
    step.rmdir()
    assert RunDir.of(cfg).read_config().train.resume == str(step)
    with pytest.raises(ConfigError, match="train.resume"):  # as a command's setting, it is refused
        load_config(overrides=[f"train.resume={step}"])


def test_the_model_section_holds_only_the_keys_given():
    cfg = load_config()
    assert "qk_norm" not in cfg.model.given() and cfg.model.norm == "custom_layernorm"
    with pytest.raises(AttributeError, match="model.qk_norm is not set in this config"):
        cfg.model.qk_norm
    changed = replace_keys(cfg, {"model.qk_norm": True, "train.lr": 2e-3})
    assert changed.model.qk_norm is True and changed.train.lr == 2e-3 and cfg.train.lr == 5e-4
