"""configs/accelerate/*.yaml as `accelerate launch --config_file` reads them, on a CPU: accelerate's own config
loader (unknown keys fail), its launch-command validation and the environment it would give the training processes
(bad values fail); nothing is started. Then what each config is for, and how train.py treats FSDP and DeepSpeed."""

import types
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

from model import modeling_normlab
from normlab.train import run as train
from train_utils import accelerate_cmd, run_cmd, run_here

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "accelerate"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def launch_env(path) -> dict:
    """The environment `accelerate launch --config_file PATH train.py` gives each training process."""
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command does
        return prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return prepare_multi_gpu_env(args)
    return prepare_simple_launcher_cmd_env(args)[1]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_launch_config_is_accepted_by_accelerate(path):
    config = load_config_from_file(str(path))
    env = launch_env(path)
    assert env["ACCELERATE_MIXED_PRECISION"] == config.mixed_precision


def test_the_launch_configs_for_the_gpus_people_have():
    envs = {p.stem: launch_env(p) for p in CONFIGS}
    assert {"single_gpu_bf16", "single_gpu_fp16", "multi_gpu", "fsdp", "deepspeed_zero2", "cpu_2proc"} <= envs.keys()
    assert envs["single_gpu_bf16"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert envs["single_gpu_fp16"]["ACCELERATE_MIXED_PRECISION"] == "fp16"  # + GradScaler, on GPUs without bf16
    ds = envs["deepspeed_zero2"]
    assert ds["ACCELERATE_USE_DEEPSPEED"] == "true" and ds["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    fsdp = envs["fsdp"]
    assert fsdp["ACCELERATE_USE_FSDP"] == "true" and fsdp["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # the wrap unit names a real class: FSDP would silently shard the whole model as one unit otherwise
    assert isinstance(getattr(modeling_normlab, fsdp["FSDP_TRANSFORMER_CLS_TO_WRAP"]), type)


def test_bad_key_and_bad_value_are_refused(tmp_path):
    text = (CONFIG_DIR / "single_gpu_fp16.yaml").read_text()
    (tmp_path / "key.yaml").write_text(text + "mixd_precision: bf16\n")
    with pytest.raises(ValueError, match="mixd_precision"):
        load_config_from_file(str(tmp_path / "key.yaml"))
    (tmp_path / "value.yaml").write_text(text.replace("mixed_precision: fp16", "mixed_precision: fp15"))
    with pytest.raises(ValueError, match="fp15"):
        launch_env(tmp_path / "value.yaml")


def test_fsdp_mixed_precision_keeps_buffers_float32():
    """accelerate's FSDP bf16 policy casts buffers to bf16; train.py keeps them float32 (the BN family's running
    statistics) and leaves the parameter and gradient-reduction dtypes alone."""
    from torch.distributed.fsdp import MixedPrecision

    from normlab.train.accelerator import fsdp_float32_buffers

    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    plugin = types.SimpleNamespace(mixed_precision_policy=policy)
    fsdp_float32_buffers(types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)))
    got = plugin.mixed_precision_policy
    assert (got.param_dtype, got.reduce_dtype, got.buffer_dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    fsdp_float32_buffers(types.SimpleNamespace(state=types.SimpleNamespace()))  # no FSDP: nothing to do


def test_train_py_refuses_deepspeed_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert run_here(tmp_path / "run") == train.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DeepSpeed" in err[0] and "fsdp.yaml" in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow  # two launcher processes
def test_the_quickstart_launch_config_gives_no_launcher_warning_and_its_exit_codes(tmp_path):
    """configs/accelerate/cpu.yaml (the README's Quickstart): none of the launcher's lines about defaults. A bad input
    exits 2 from train.py, which the launcher turns into 1 (with its own traceback unless -q), as the README says."""
    launch = ("--config_file", str(CONFIG_DIR / "cpu.yaml"))
    result = run_cmd(accelerate_cmd(tmp_path / "x", "model.nrom=rmsnorm", launch_args=launch), timeout=180)
    assert result.returncode == 1 and "exit status 2" in result.stderr
    assert "defaults used instead" not in result.stderr and "error: unknown config key 'model.nrom'" in result.stderr
    quiet = run_cmd(accelerate_cmd(tmp_path / "x", "model.nrom=rmsnorm", launch_args=("-q", *launch)), timeout=180)
    assert quiet.returncode == 1 and quiet.stderr.startswith("error: ") and quiet.stderr.strip().count("\n") == 0
