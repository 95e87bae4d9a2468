"""Config loading: merge order, override parsing and coercion, and that every error names the key and the fix."""

import pytest
import yaml

from model.configuration_normlab import NORM_PLACEMENTS, NORM_TYPES, NormLabConfig
from normlab.config.loader import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    ConfigError,
    flatten_config,
    load_config,
    model_config_from,
    parse_cli,
    save_config,
)

VARIANTS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_defaults_load_and_match_the_yaml():
    cfg = load_config()
    raw = yaml.safe_load((CONFIG_DIR / "default.yaml").read_text())
    assert cfg == raw
    assert cfg["model"]["norm"] == "custom_layernorm" and cfg["data"]["name"] == "stanfordnlp/sst2"


def test_variant_deep_merges_over_defaults(tmp_path):
    f = tmp_path / "v.yaml"
    f.write_text("model:\n  norm: rmsnorm\ntrain: {lr: 3.0e-4}\n")
    cfg = load_config(str(f))
    assert cfg["model"]["norm"] == "rmsnorm"
    assert cfg["model"]["hidden_size"] == 128  # siblings kept: a deep merge, not a replace
    assert cfg["train"]["lr"] == 3e-4 and cfg["train"]["batch_size"] == 32


def test_overrides_win_over_variant_and_parse_yaml_values():
    cfg = load_config("post_ln", ["model.norm=rmsnorm", "train.lr=1e-3", "wandb.tags=[a,b]", "train.max_steps=20",
                                  "data.path=/tmp/x.csv", "model.qk_norm=true", "model.embedding_norm=null"])
    assert cfg["model"]["norm"] == "rmsnorm" and cfg["model"]["norm_placement"] == "post"
    assert cfg["train"]["lr"] == pytest.approx(1e-3) and isinstance(cfg["train"]["lr"], float)
    assert cfg["wandb"]["tags"] == ["a", "b"]
    assert cfg["train"]["max_steps"] == 20 and cfg["data"]["path"] == "/tmp/x.csv"
    assert cfg["model"]["qk_norm"] is True and cfg["model"]["embedding_norm"] is None


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("train.lr=1", "lr", 1.0),  # int where a float is expected
        ("train.max_steps=1e3", "max_steps", 1000),  # YAML reads 1e3 as a string
        ("train.max_steps=null", "max_steps", None),
        ("train.mixed_precision=no", "mixed_precision", "no"),  # not YAML's boolean False
        ("wandb.group=1.10", "group", "1.10"),  # a string key keeps what was typed
        ("wandb.tags=solo", "tags", ["solo"]),
    ],
)
def test_type_coercion(override, key, value):
    cfg = load_config(overrides=[override])
    section = cfg["wandb"] if override.startswith("wandb") else cfg["train"]
    assert section[key] == value and type(section[key]) is type(value)


@pytest.mark.parametrize(
    "overrides, must_contain",
    [
        (["train.lrr=1"], ["'train.lrr'", "did you mean 'train.lr'", "valid keys under train", "batch_size"]),
        (["mdoel.norm=rmsnorm"], ["'mdoel'", "did you mean 'model'", "valid keys at the top level"]),
        (["model.normm=rmsnorm"], ["'model.normm'", "did you mean 'model.norm'", "norm_placement"]),
        (["model.num_labels=3"], ["'model.num_labels'", "data.num_labels"]),
        (["model.norm=layrnorm"], ["model.norm='layrnorm'", "did you mean 'layernorm'", *NORM_TYPES]),
        (["model.norm_placement=middle"], ["model.norm_placement", *NORM_PLACEMENTS]),
        (["model.hidden_size=abc"], ["model.hidden_size", "expected int"]),
        (["model.hidden_size=130"], ["model.hidden_size=130", "num_attention_heads"]),  # built NormLabConfig
        (["model.norm_eps=0"], ["model.norm_eps"]),
        (["train.batch_size=1.5"], ["train.batch_size", "expected int"]),
        (["train.batch_size=0"], ["train.batch_size", ">= 1"]),
        (["train.lr=-1"], ["train.lr", "> 0"]),
        (["train.max_steps=0"], ["train.max_steps", ">= 1"]),
        (["train.cpu_threads=0"], ["train.cpu_threads", ">= 1"]),
        (["train.compile=maybe"], ["train.compile", "expected bool"]),
        (["train.scheduler=cosin"], ["train.scheduler", "did you mean 'cosine'", "linear"]),
        (["train.mixed_precision=fp17"], ["train.mixed_precision", "bf16"]),
        (["train.resume=/no/such/dir"], ["train.resume", "auto", "checkpoints/step_"]),
        (["task=regression"], ["task='regression'", "classification", "mlm"]),
        (["wandb.mode=off"], ["wandb.mode='off'", "auto", "online", "offline", "disabled"]),
        (["wandb.report_to=wandbb"], ["wandb.report_to", "tensorboard"]),
        (["data.max_length=256"], ["data.max_length=256", "model.max_position_embeddings=128",
                                   "model.max_position_embeddings=256"]),
        (["data.num_labels=1"], ["data.num_labels", ">= 2"]),
        (["data.max_train_samples=0"], ["data.max_train_samples"]),
        (["model=3"], ["'model' is a section", "model."]),
        (["train.lr.x=3"], ["train.lr", "not a section"]),
        (["output_dir="], ["output_dir", "null"]),
    ],
)
def test_bad_values_name_the_key_and_what_is_valid(overrides, must_contain):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=overrides)
    msg = str(exc.value)
    assert "\n" not in msg
    for part in must_contain:
        assert part in msg, (part, msg)


def test_max_length_may_grow_with_positions():
    cfg = load_config(overrides=["data.max_length=256", "model.max_position_embeddings=256"])
    assert cfg["data"]["max_length"] == 256


def test_variant_file_errors_name_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  lrr: 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lrr' \(in .*bad.yaml\)"):
        load_config(str(f))
    f.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line \d+ is not valid YAML"):
        load_config(str(f))
    f.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(str(f))
    f.write_text("wandb: {mode: off}\n")  # YAML 1.1 reads `off` as False
    with pytest.raises(ConfigError, match="wandb.mode=False.*quote it"):
        load_config(str(f))
    with pytest.raises(ConfigError, match=r"'post_lnn' not found \(did you mean 'post_ln'\?\).*rmsnorm"):
        load_config("post_lnn")


def test_resume_accepts_auto_and_existing_dir(tmp_path):
    assert load_config(overrides=["train.resume=auto"])["train"]["resume"] == "auto"
    assert load_config(overrides=[f"train.resume={tmp_path}"])["train"]["resume"] == str(tmp_path)


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_file_loads_and_builds_a_model_config(name):
    by_name = load_config(name)
    by_path = load_config(str(CONFIG_DIR / f"{name}.yaml"))
    assert by_name == by_path
    model_cfg = model_config_from(by_name, vocab_size=1000, num_labels=2)
    assert isinstance(model_cfg, NormLabConfig) and model_cfg.vocab_size == 1000 and model_cfg.num_labels == 2
    assert by_name["data"]["max_length"] <= model_cfg.max_position_embeddings
    # a variant holds only what differs from the default (a few lines, not a copy)
    lines = [ln for ln in (CONFIG_DIR / f"{name}.yaml").read_text().splitlines() if ln and not ln.startswith("#")]
    assert name == "default" or len(lines) <= 4


def test_required_variants_exist_and_set_their_norm():
    expected = {"post_ln": ("layernorm", "post"), "pre_ln": ("layernorm", "pre"),
                "custom_ln": ("custom_layernorm", "pre"), "rmsnorm": ("rmsnorm", "pre"),
                "batchnorm": ("batchnorm", "pre"), "masked_batchnorm": ("masked_batchnorm", "pre"),
                "powernorm": ("powernorm", "pre"), "dyt": ("dyt", "pre"), "sandwich": ("layernorm", "sandwich"),
                "deepnorm": ("layernorm", "deepnorm")}
    for name, (norm, placement) in expected.items():
        m = load_config(name)["model"]
        assert (m["norm"], m["norm_placement"]) == (norm, placement), name
    assert load_config("mlm")["task"] == "mlm"
    assert load_config("custom_ln")["model"] == load_config()["model"]


def test_save_config_round_trips_as_a_variant(tmp_path):
    cfg = load_config("imdb", ["wandb.tags=[x]"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(str(tmp_path / "run" / "config.yaml")) == cfg


def test_flatten_config():
    assert flatten_config({"x": 1, "y": {"z": [1, 2]}}) == {"x": 1, "y.z": [1, 2]}


def test_model_config_from_turns_errors_into_config_errors():
    with pytest.raises(ConfigError, match="model.pad_token_id"):
        model_config_from(load_config(), vocab_size=10, pad_token_id=50)


def test_parse_cli():
    assert parse_cli([]) == (None, [], False)
    assert parse_cli(["--config", "post_ln", "--debug", "model.norm=rmsnorm", "train.lr=1e-3"]) == (
        "post_ln", ["model.norm=rmsnorm", "train.lr=1e-3"], True)
    assert parse_cli(["--config=configs/dyt.yaml", "--train.lr=1e-3"]) == ("configs/dyt.yaml", ["train.lr=1e-3"], False)
    with pytest.raises(ConfigError, match="unexpected argument 'rmsnorm'.*key=value"):
        parse_cli(["rmsnorm"])
    with pytest.raises(ConfigError, match="unknown option '--fast'"):
        parse_cli(["--fast"])
    with pytest.raises(ConfigError, match="--config needs a file"):
        parse_cli(["--config"])
    with pytest.raises(ConfigError) as err:
        parse_cli(["--fast"])
    assert "key=value" not in str(err.value).split("usage")[0]  # not a config key: no settings hint


@pytest.mark.parametrize("argv, hint", [
    (["--max_steps", "200"], "unknown option '--max_steps'; settings are key=value: train.max_steps=200;"),
    (["--max-steps", "200"], "settings are key=value: train.max_steps=200;"),
    (["--train.lr", "1e-3"], "settings are key=value: train.lr=1e-3;"),
    (["--epochs"], "settings are key=value: train.epochs=...;"),  # no value after it
    (["--seed", "--debug"], "settings are key=value: seed=...;"),
])
def test_an_option_named_like_a_config_key_points_at_the_key_value_form(argv, hint):
    with pytest.raises(ConfigError) as err:
        parse_cli(argv)
    assert hint in str(err.value)


def test_a_section_key_given_at_the_top_level_names_its_section():
    with pytest.raises(ConfigError, match="unknown config key 'max_steps' .*did you mean 'train.max_steps'"):
        load_config(None, ["max_steps=200"])
    with pytest.raises(ConfigError, match="--config given twice"):
        parse_cli(["--config", "a", "--config", "b"])


@pytest.mark.parametrize(
    "override, must_contain",
    [
        ("wandb.tags=[a, [b]]", ["wandb.tags=['a', ['b']]", "wrong type", "expected list"]),  # merging would take it
        ("data.label_names={a: 1}", ["data.label_names=", "expected list or null"]),
        ("train.lr=inf", ["train.lr='inf'", "finite"]),
        ("train.lr=.nan", ["train.lr=nan", "finite"]),
        ("wandb.report_to=.inf", ["wandb.report_to=inf", "finite"]),
        ("model.norm_eps=null", ["model.norm_eps may not be null", "expected float"]),
    ],
)
def test_values_the_merge_would_take_or_garble_are_refused(override, must_contain):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    for part in must_contain:
        assert part in str(exc.value), (part, str(exc.value))


def test_a_type_error_in_a_file_names_the_file_and_a_later_layer_wins(tmp_path):
    f = tmp_path / "v.yaml"
    f.write_text("train: {batch_size: abc}\n")
    with pytest.raises(ConfigError, match=r"train.batch_size='abc' has the wrong type \(in .*v.yaml\); expected int"):
        load_config(str(f))
    f.write_text("train: {batch_size: 8, lr: 1}\nwandb: {tags: [x]}\n")
    cfg = load_config(str(f), ["train.batch_size=4"])
    assert cfg["train"]["batch_size"] == 4 and cfg["train"]["lr"] == 1.0 and cfg["wandb"]["tags"] == ["x"]


# ----------------------------------------------------------------------------------------------------------------
# the config of a resumed run: the run directory's own (normlab.train.preflight.run_config), without training


def _saved_run(tmp_path, config_file, overrides, record=True):
    """A run directory as train.py leaves it before its first checkpoint: config.yaml (and run.json)."""
    import json

    from normlab.train.preflight import run_config

    out = tmp_path / "run"
    start = run_config(config_file, [f"output_dir={out}", *overrides])
    out.mkdir()
    save_config(start.cfg, out / "config.yaml")
    if record:
        (out / "run.json").write_text(json.dumps({**start.record, "wandb_run_id": "ab12cd34"}))
    return out, start.cfg


def test_a_resume_restores_the_runs_config_and_states_each_allowed_change(tmp_path):
    from normlab.train.preflight import run_config

    out, cfg = _saved_run(tmp_path, "post_ln", ["train.lr=1e-3", "train.max_steps=600"])
    start = run_config(None, [f"output_dir={out}", "train.resume=auto"])
    resumed = start.cfg
    assert resumed == {**cfg, "train": {**cfg["train"], "resume": "auto"}} and start.notices == ()
    assert start.record == {"config_file": "configs/post_ln.yaml"}  # the variant's tag comes back too
    assert start.resume.checkpoint is None  # stopped before its first checkpoint: it starts again from step 0
    for same in ("post_ln", "configs/post_ln.yaml", str(CONFIG_DIR / "post_ln.yaml")):
        assert run_config(same, [f"output_dir={out}", "train.resume=auto", "train.lr=1e-3"]).cfg == resumed
    more = run_config(None, [f"output_dir={out}", "train.resume=auto", "train.max_steps=900", "train.eval_steps=50"])
    assert more.cfg["train"]["max_steps"] == 900 and more.cfg["model"] == cfg["model"]
    assert more.notices == (f"resuming {out} with its saved config, changing train.eval_steps=50 (was None), "
                            f"train.max_steps=900 (was 600)",)


@pytest.mark.parametrize("argv,words", [
    (["train.lr=2e-3"], ["train.lr=0.002 cannot change", "the run has train.lr=0.001",
                         "train.max_steps, train.epochs"]),
    (["model.norm=rmsnorm"], ["model.norm='rmsnorm' cannot change", "a resume may change only"]),
    (["--config", "pre_ln"], ["--config pre_ln differs from the run's own (--config configs/post_ln.yaml",
                              "train.resume=auto"]),
])
def test_a_resume_refuses_another_config_naming_the_key(tmp_path, argv, words):
    from normlab.train.preflight import run_config

    out, _ = _saved_run(tmp_path, "post_ln", ["train.lr=1e-3"])
    config_file = argv[1] if argv[0] == "--config" else None
    overrides = [] if config_file else argv
    with pytest.raises(ConfigError) as err:
        run_config(config_file, [f"output_dir={out}", "train.resume=auto", *overrides])
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_a_run_directory_from_before_run_json_checks_a_given_config_by_its_keys(tmp_path):
    from normlab.train.preflight import run_config

    out, cfg = _saved_run(tmp_path, "post_ln", ["train.lr=1e-3"], record=False)
    start = run_config(None, [f"output_dir={out}", "train.resume=auto"])
    assert start.cfg["train"]["lr"] == 1e-3 and start.record == {}  # the variant is unknown: run.json won't guess it
    assert run_config("post_ln", [f"output_dir={out}", "train.resume=auto"]).record == {
        "config_file": "configs/post_ln.yaml"}
    with pytest.raises(ConfigError, match="--config pre_ln sets model.norm_placement='pre' but the run in"):
        run_config("pre_ln", [f"output_dir={out}", "train.resume=auto"])


def test_a_resume_reads_and_merges_the_runs_saved_config_once(tmp_path, monkeypatch):
    """config.yaml read once; the defaults read twice: for the command's config (where the run is) and under the
    run's own, which the command's overrides then update."""
    import normlab.config.loader as loader
    import normlab.run_dir as run_dir
    from normlab.train.preflight import run_config

    out, _ = _saved_run(tmp_path, "post_ln", ["train.lr=1e-3"])
    reads = []
    for module in (loader, run_dir):
        monkeypatch.setattr(module, "load_yaml_mapping",
                            lambda path, read=module.load_yaml_mapping: reads.append(path) or read(path))
    start = run_config("post_ln", [f"output_dir={out}", "train.resume=auto", "train.max_steps=900"])
    assert start.cfg.train.max_steps == 900 and start.cfg.train.lr == 1e-3
    assert reads.count(out / "config.yaml") == 1 and reads.count(DEFAULT_CONFIG) == 2, reads


@pytest.mark.parametrize("config_file,record", [(None, True), ("post_ln", True), ("post_ln", False)])
def test_a_resume_checks_and_flattens_the_runs_saved_config_once(tmp_path, monkeypatch, config_file, record):
    """The run's saved config, with the command's overrides on it, is checked once, beside the command's own
    config (which says where the run is) and, in a run directory from before run.json, the --config file it is
    compared with; no loaded config is flattened twice."""
    import normlab.config.loader as loader
    import normlab.train.preflight as preflight
    from normlab.config.schema import RunConfig

    out, _ = _saved_run(tmp_path, "post_ln", ["train.lr=1e-3"], record=record)
    checks, flattened = [], []
    monkeypatch.setattr(loader, "_validate", lambda cfg, resume_given, check=loader._validate:
                        checks.append(cfg) or check(cfg, resume_given))

    def counting(cfg, prefix="", flatten=loader.flatten_config):
        if not prefix and isinstance(cfg, RunConfig):  # a loaded config, not a layer of one (nor a recursion)
            flattened.append(cfg)
        return flatten(cfg, prefix)

    for module in (loader, preflight):
        monkeypatch.setattr(module, "flatten_config", counting)
    start = preflight.run_config(config_file, [f"output_dir={out}", "train.resume=auto", "train.max_steps=900"])
    assert start.cfg.train.max_steps == 900 and start.cfg.train.lr == 1e-3
    assert len(checks) == (2 if record else 3), checks
    assert len({id(cfg) for cfg in flattened}) == len(flattened), flattened


def test_resume_auto_where_no_run_is_refused_naming_the_runs_nearby(tmp_path):
    """A typo'd output_dir: one line, the run directories beside it closest first, nothing created; a new run there
    is asked for without train.resume. A directory a run was set up in (a study writes its config.yaml first)
    resumes from step 0."""
    from normlab.train.preflight import run_config

    runs = tmp_path / "runs"
    set_up = runs / "default"  # set up, not started: as a study leaves a run before launching it
    save_config(load_config(overrides=[f"output_dir={set_up}", "train.resume=auto"]), set_up / "config.yaml")
    (runs / "defaults-old").mkdir()
    (runs / "defaults-old" / "summary.json").write_text("{}")
    (runs / "zzz" / "checkpoints" / "step_10").mkdir(parents=True)
    (runs / "notes" / "x").mkdir(parents=True)  # holds no run: not named
    typo = runs / "defualt"
    with pytest.raises(ConfigError) as err:
        run_config(None, [f"output_dir={typo}", "train.resume=auto"])
    nearby = ", ".join(str(runs / name) for name in ("default", "defaults-old", "zzz"))
    assert str(err.value) == (f"train.resume=auto: nothing to resume in output_dir={typo} (it does not exist); run "
                              f"directories nearby: {nearby}; to start a new run there, leave train.resume out (or "
                              f"give train.resume=null)")
    assert not typo.exists()
    with pytest.raises(ConfigError, match="nothing to resume in output_dir=.*notes .no checkpoint, config.yaml or "):
        run_config(None, [f"output_dir={runs / 'notes'}", "train.resume=auto"])
    for fresh in ([], ["train.resume=null"]):
        assert run_config(None, [f"output_dir={typo}", *fresh]).resume is None
    study_run = run_config(None, [f"output_dir={set_up}", "train.resume=auto"])
    assert study_run.resume.checkpoint is None and study_run.cfg.output_dir == str(set_up)


def test_a_damaged_saved_config_is_named_on_resume(tmp_path):
    from normlab.train.preflight import run_config

    out, _ = _saved_run(tmp_path, "post_ln", [])
    (out / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        run_config(None, [f"output_dir={out}", "train.resume=auto"])
    message = str(err.value)
    assert message.startswith(f"{out / 'config.yaml'} line ") and "it is the run's saved config" in message


# ----------------------------------------------------------------------------------------------------------------
# class names: configs/default.yaml's are SST-2's, and stay with it


def test_the_default_class_names_stay_with_sst2(tmp_path):
    assert load_config().data.label_names == ["negative", "positive"]  # SST-2 by name: its local copy or the Hub
    assert load_config(overrides=["data.name=stanfordnlp/sst2"]).data.label_names == ["negative", "positive"]
    mine = tmp_path / "mine.yaml"
    mine.write_text("data: {path: /data/mine.csv}\n")
    for other in (load_config(overrides=["data.path=/data/mine.csv"]), load_config(str(mine)),
                  load_config(overrides=["data.name=someone/reviews"]),
                  load_config(layers=[({"data.path": "/data/mine.csv"}, "in a program's settings")])):
        assert other.data.label_names is None  # the data's own names decide, or a one-line refusal (test_data.py)
    given = load_config(overrides=["data.path=/data/mine.csv", "data.label_names=[bad,good]"])
    assert given.data.label_names == ["bad", "good"]
    assert load_config("imdb").data.label_names == ["neg", "pos"]  # a variant that names its own data's classes
    # a saved run keeps the names it was trained with, whatever its data
    save_config(given, tmp_path / "run" / "config.yaml")
    assert load_config(str(tmp_path / "run" / "config.yaml")).data.label_names == ["bad", "good"]
    older = {**load_config().to_dict(), "data": {**load_config().data, "path": "/data/mine.csv"}}
    assert load_config(saved=(older, "in a run's config.yaml")).data.label_names == ["negative", "positive"]


def test_normlab_train_is_train_py_and_exits_2_on_a_bad_config(tmp_path, capsys):
    """The installed entry point (pyproject.toml) runs train.py's main, from any directory, with its exit codes."""
    import subprocess
    import sysconfig
    from importlib.metadata import entry_points
    from pathlib import Path

    from normlab.train import run as train

    entries = entry_points(group="console_scripts", name="normlab-train")
    assert entries, "no normlab-train entry point: install the checkout again (pip install --no-deps -e .)"
    assert next(iter(entries)).load() is train.main
    with pytest.raises(SystemExit) as done:
        train.main(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: ")
    script = Path(sysconfig.get_path("scripts")) / "normlab-train"
    bad = subprocess.run([str(script), "train.lr=-1", f"output_dir={tmp_path / 'run'}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: train.lr=-1.0 must be > 0"]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------
# what a run derives from its length: warmup and evaluation interval (normlab/config/run_length.py)


def test_the_default_run_keeps_its_200_warmup_steps_and_evaluations_every_500():
    """The defaults scale with the run's length now; the default run (one epoch of SST-2's training split in batches
    of 32, as batching.py counts them) still warms up for 200 steps and evaluates every 500, as when both were
    constants."""
    import math

    import pyarrow.parquet as pq

    from normlab.config.run_length import eval_interval, warmup_steps

    cfg = load_config()
    train_rows = pq.ParquetFile(CONFIG_DIR.parent.parent / "shared" / "datasets" / "sst2" / "train.parquet")
    steps = math.ceil(train_rows.metadata.num_rows / cfg.train.batch_size)
    assert steps == 2105  # the README's "2,105 optimizer steps"
    assert warmup_steps(cfg.train, steps) == 200 and eval_interval(cfg.train, steps) == 500
    # the README's short run: no longer all warmup, and four evaluations instead of one
    assert warmup_steps(cfg.train, 200) == 19 and eval_interval(cfg.train, 200) == 50


@pytest.mark.parametrize("steps", [1, 7, 200, 416, 2105, 10_000])
def test_the_warmup_ratio_gives_hf_trainings_warmup_steps(steps):
    from transformers import TrainingArguments

    from normlab.config.run_length import warmup_steps

    for ratio in (0.095, 0.1, 0.5):
        hf = TrainingArguments(output_dir="unused", warmup_steps=ratio, report_to=[]).get_warmup_steps(steps)
        assert warmup_steps(load_config(None, [f"train.warmup_ratio={ratio}"]).train, steps) == hf


def test_steps_given_win_over_what_the_length_derives():
    from normlab.config.run_length import eval_interval, warmup_steps

    given = load_config(None, ["train.warmup_steps=0", "train.eval_steps=30", "train.eval_count=100"]).train
    assert (warmup_steps(given, 2105), eval_interval(given, 2105)) == (0, 30)  # 0 is no warmup, not "unset"
    none = load_config(None, ["train.warmup_ratio=null"]).train
    assert warmup_steps(none, 2105) == 0
    counted = load_config(None, ["train.eval_count=10"]).train
    # the run's steps / eval_count, rounded down to one significant digit: at least eval_count evaluations
    assert [eval_interval(counted, n) for n in (5, 10, 99, 416, 2105, 123_456)] == [1, 1, 9, 40, 200, 10_000]
    for bad, words in (("train.warmup_ratio=1", "train.warmup_ratio=1.0 must be >= 0 and < 1"),
                       ("train.eval_count=0", "train.eval_count=0 must be >= 1"),
                       ("data.eval_fraction=0", "data.eval_fraction=0.0 must be > 0 and < 1")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, [bad])


def test_a_powernorm_warmup_that_outlasts_the_run_is_said_before_it():
    from model import NormLabConfig, NormLabForSequenceClassification
    from normlab.config.run_length import norm_warmup_notices

    def model(**kw):
        return NormLabForSequenceClassification(NormLabConfig(
            vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, **kw))

    pn = model(norm="powernorm", powernorm_warmup_steps=1000)
    assert norm_warmup_notices(pn, 416) == [
        "PowerNorm's warmup, model.powernorm_warmup_steps=1000, covers all 416 training batches of this run: it "
        "normalizes with each batch's statistic throughout, never with its running one (set a smaller warmup to use "
        "both)"]
    assert norm_warmup_notices(pn, 1000) != [] and norm_warmup_notices(pn, 1001) == []
    assert norm_warmup_notices(model(norm="powernorm", powernorm_warmup_steps=50), 416) == []
    assert norm_warmup_notices(model(norm="batchnorm"), 10) == []  # BN has no warmup of its own


# ----------------------------------------------------------------------------------------------------------
# train.py --help-config: the keys, read off the schema and configs/default.yaml


def test_help_config_lists_every_key_with_its_default_and_doc(capsys):
    from normlab.config.schema import MODEL_KEYS

    with pytest.raises(SystemExit) as done:
        parse_cli(["--help-config"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split(" = ")[0]: line.split(" = ", 1)[1] for line in lines if " = " in line
              and not line.startswith(" ")}
    expected = {k for k in flatten_config(load_config()) if not k.startswith("model.")} | {
        f"model.{k}" for k in MODEL_KEYS}
    assert set(listed) == expected
    assert listed["train.lr"] == "0.0005 (float; > 0)" and listed["model.norm_eps"].startswith("1.0e-05 (float")
    assert listed["train.kernels"] == "auto (str; one of: auto, reference)"
    doc = lines[lines.index("train.warmup_steps = null (int or null; >= 0)") + 1]
    assert doc.strip() == "optimizer steps of linear warmup (0: none); when set, wins over warmup_ratio"
    doc = lines[lines.index("data.label_names = [negative, positive] (list of str or null)") + 1]
    assert doc.strip().startswith("names of classes 0, 1, ... (id2label)")  # a comment continued over lines
    with pytest.raises(SystemExit):
        parse_cli(["--help-config=WANDB"])
    assert [line.split(" = ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("wandb.")] == [
        "wandb.mode", "wandb.project", "wandb.entity", "wandb.group", "wandb.tags", "wandb.report_to",
        "wandb.log_model", "wandb.log_checkpoints"]
    with pytest.raises(SystemExit):
        parse_cli(["--help"])
    assert "--help-config" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# W&B's environment variables: below every layer but the defaults


def test_wandb_environment_variables_set_what_the_config_does_not(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_PROJECT", "their-project")
    monkeypatch.setenv("WANDB_ENTITY", "their-team")
    monkeypatch.setenv("WANDB_RUN_GROUP", "their-group")
    monkeypatch.setenv("WANDB_TAGS", "a, b")
    w = load_config().wandb
    assert (w.project, w.entity, w.group, w.tags) == ("their-project", "their-team", "their-group", ["a", "b"])
    variant = tmp_path / "v.yaml"
    variant.write_text("wandb: {project: mine}\n")
    w = load_config(str(variant), ["wandb.tags=[x]"]).wandb
    assert (w.project, w.entity, w.group, w.tags) == ("mine", "their-team", "their-group", ["x"])
    monkeypatch.setenv("WANDB_PROJECT", "")  # empty: unset, as wandb reads it
    assert load_config().wandb.project == "normlab"


def test_a_checkpoint_from_before_the_length_scaled_keys_still_resumes():
    """A checkpoint's config written before data.eval_fraction, train.warmup_ratio, train.eval_count and
    wandb.entity existed lacks them; their defaults keep what such a run did, so they are no difference. A value
    that does differ is still refused."""
    from normlab.train.preflight import check_resume_config

    cfg = load_config(None, ["train.warmup_steps=200", "train.eval_steps=500", "train.resume=auto"])
    old = cfg.to_dict()
    for section, key in (("data", "eval_fraction"), ("train", "warmup_ratio"), ("train", "eval_count"),
                         ("wandb", "entity")):
        del old[section][key]
    check_resume_config(cfg, old, "ckpt")
    with pytest.raises(ConfigError, match="checkpoint ckpt was trained with train.warmup_steps=100; resume with"):
        check_resume_config(cfg, {**old, "train": {**old["train"], "warmup_steps": 100}}, "ckpt")
    with pytest.raises(ConfigError, match="trained with model.qk_norm=None"):  # a model key it did not set
        check_resume_config(load_config(None, ["model.qk_norm=true"]), old, "ckpt")
