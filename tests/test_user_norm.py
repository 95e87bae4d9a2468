"""A norm from the user's own code, without forking: registered from outside NormLab (`register_norm`, or
`model.norm=module:Class`), its name checked when the config is, a run trained with it, and the saved folders
loading with `trust_remote_code=True` in a fresh process where the user's package (and NormLab) cannot be
imported, with the same logits. A norm whose module cannot travel is refused in one line before the first step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from model import NormLabConfig, NormLabForSequenceClassification
from model.norm_code import check_norm_code
from model.norms import NORM_PRESETS, NORM_REGISTRY, NORM_TYPES, DyT, MaskedBatchNorm, Norm, register_norm
from train_utils import env, run_here

PKG = "normlab_test_user_pkg"  # a name nothing else uses: the test removes it from sys.modules afterwards

SCALE_NORM = '''"""ScaleNorm (Nguyen & Salazar, 2019): g * x / ||x||, one learned scalar g."""
import math

import torch
from torch import nn

from model.norms import Norm, register_norm


@register_norm
class ScaleNorm(Norm, nn.Module):
    name = "scalenorm"

    def __init__(self, dim, eps=1e-5, g=None):
        super().__init__()
        self.eps = eps
        self.g_init = math.sqrt(dim) if g is None else float(g)
        self.g = nn.Parameter(torch.tensor(self.g_init))

    def initial_values(self):
        return {"g": self.g_init}

    def forward(self, x, mask=None):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp(min=self.eps)
'''

# imports a sibling module of its own package, which a saved folder would not hold
LOCAL_NORM = f'''from torch import nn

from model.norms import Norm
from {PKG}.helpers import SCALE


class LocalNorm(Norm, nn.Module):
    name = "localnorm"

    def __init__(self, dim, eps=1e-5):
        super().__init__()

    def initial_values(self):
        return {{}}

    def forward(self, x, mask=None):
        return SCALE * x
'''

# In a fresh interpreter that cannot import the user's package, NormLab's model package or normlab: each folder
# loaded as a user elsewhere would load it; prints the class of its first norm and its logits on fixed ids.
LOAD = f'''
import importlib.abc, json, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ({PKG!r}, "model", "normlab", "tests"):
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Absent())
import torch
from transformers import AutoModelForSequenceClassification
out = {{}}
for folder in sys.argv[1:]:
    model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[2, 5, 9, 4, 7]])).logits
    out[folder] = [type(model.normlab.embeddings.norm or model.normlab.encoder.final_norm).__module__,
                   logits.tolist()]
print(json.dumps(out))
'''

IDS = torch.tensor([[2, 5, 9, 4, 7]])


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    """The user's package on sys.path (as PYTHONPATH or an install would put it); the registry and sys.modules
    as they were afterwards."""
    root = tmp_path / "src"
    (root / PKG).mkdir(parents=True)
    (root / PKG / "__init__.py").write_text("")
    (root / PKG / "scale.py").write_text(SCALE_NORM)
    (root / PKG / "helpers.py").write_text("SCALE = 2.0\n")
    (root / PKG / "local.py").write_text(LOCAL_NORM)
    monkeypatch.syspath_prepend(str(root))
    registry, presets = dict(NORM_REGISTRY), dict(NORM_PRESETS)
    yield root
    for table, before in ((NORM_REGISTRY, registry), (NORM_PRESETS, presets)):
        table.clear()
        table.update(before)
    for name in [m for m in sys.modules if m.split(".")[0] == PKG]:
        del sys.modules[name]


def _tiny(norm, **kw):
    return NormLabConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, num_labels=2, norm=norm, **kw)


def _load_elsewhere(tmp_path, *folders) -> dict:
    """{folder: (module of its norm class, logits)} from a fresh process that cannot import the user's package."""
    e = env()
    e.pop("PYTHONPATH")
    e["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")  # this test's copies of the saved code only
    res = subprocess.run([sys.executable, "-c", LOAD, *map(str, folders)], cwd=tmp_path, env=e,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return {folder: (module, torch.tensor(logits)) for folder, (module, logits)
            in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def _assert_loaded_elsewhere(tmp_path, expected: dict) -> None:
    """Each folder, loaded where the user's package is absent, runs its saved copy of the norm's code and gives
    the `expected` logits."""
    loaded = _load_elsewhere(tmp_path, *expected)
    for folder, logits in expected.items():
        module, got = loaded[str(folder)]
        assert module.startswith("transformers_modules.") and module.split(".")[-1] in (f"norm_{PKG}_scale", "norms")
        torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-6, msg=lambda m: f"{folder}: {m}")


def test_registered_norms_and_presets_load_where_their_package_is_absent(user_pkg, tmp_path):
    """register_norm from outside: the decorator's name, a preset of the user's class, a preset of NormLab's DyT."""
    from normlab_test_user_pkg.scale import ScaleNorm

    register_norm(ScaleNorm, name="scalenorm_g1", g=1.0)
    register_norm(DyT, name="dyt_alpha1", alpha_init=1.0)
    assert {"scalenorm", "scalenorm_g1", "dyt_alpha1"} <= set(NORM_TYPES)
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(_tiny("scalenorm_g1", final_norm="dyt_alpha1", embedding_norm=True))
    assert model.normlab.embeddings.norm.g.item() == 1.0 and model.normlab.encoder.final_norm.alpha.item() == 1.0
    model.eval().save_pretrained(tmp_path / "saved")
    saved_norms = (tmp_path / "saved" / "saved_norms.py").read_text()
    assert "register_norm(ScaleNorm, name='scalenorm_g1', g=1.0)" in saved_norms
    assert "register_norm(DyT, name='dyt_alpha1', alpha_init=1.0)" in saved_norms
    with torch.no_grad():
        _assert_loaded_elsewhere(tmp_path, {tmp_path / "saved": model(IDS).logits})


def test_a_preset_of_a_norm_defined_beside_norms_py_loads_from_the_folders_own_copy(user_pkg, tmp_path):
    """A preset of a NormLab class that norms.py imports from another file (masked BN, in batch_norms.py): the saved
    folder already holds that file, so saved_norms.py imports the class from it and no other copy is written."""
    register_norm(MaskedBatchNorm, name="masked_bn_m05", momentum=0.05)
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(_tiny("layernorm", final_norm="masked_bn_m05", embedding_norm=False))
    assert model.normlab.encoder.final_norm.momentum == 0.05
    model.train()(torch.randint(0, 16, (4, 5)))  # running statistics away from their initial values
    model.eval().save_pretrained(tmp_path / "saved")
    saved_norms = (tmp_path / "saved" / "saved_norms.py").read_text()
    assert "from .batch_norms import MaskedBatchNorm\n" in saved_norms
    assert "register_norm(MaskedBatchNorm, name='masked_bn_m05', momentum=0.05)" in saved_norms
    assert not [f for f in (tmp_path / "saved").iterdir() if f.name.startswith("norm_") and f.name != "norm_code.py"]
    with torch.no_grad():
        expected = model(IDS).logits
    (module, got), = _load_elsewhere(tmp_path, tmp_path / "saved").values()
    assert module.startswith("transformers_modules.") and module.endswith(".batch_norms"), module
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _scale_norm_run(tmp_path) -> Path:
    """A 3-step run of the user's ScaleNorm, given as `model.norm=module:Class` on the command line."""
    out = tmp_path / "run"
    assert run_here(out, f"model.norm={PKG}.scale:ScaleNorm", "train.max_steps=3", "train.eval_steps=3",
                    "train.save_steps=3") == 0
    return out


@pytest.mark.slow
def test_a_run_with_a_user_norm_loads_where_its_package_is_absent(user_pkg, tmp_path):
    """`model.norm=module:Class` on the command line: trained, and final/ and the checkpoint carry its module."""
    out, path = _scale_norm_run(tmp_path), f"{PKG}.scale:ScaleNorm"
    final, checkpoint = out / "final", out / "checkpoints" / "step_3"
    assert json.loads((final / "config.json").read_text())["norm"] == path  # as written: loads here by import
    for folder in (final, checkpoint):
        assert (folder / f"norm_{PKG}_scale.py").read_text().count("from .norms import Norm, register_norm") == 1
    trained = NormLabForSequenceClassification.from_pretrained(final).eval()
    scale = trained.normlab.encoder.final_norm
    assert type(scale).__name__ == "ScaleNorm" and scale.g.item() != pytest.approx(4.0)  # trained away from sqrt(16)
    with torch.no_grad():
        _assert_loaded_elsewhere(tmp_path, {final: trained(IDS).logits, checkpoint: trained(IDS).logits})


@pytest.mark.slow
def test_evaluate_runs_the_code_a_checkpoint_carries_only_with_trust_remote_code(user_pkg, tmp_path, capsys):
    """Where the user's package is absent, evaluate.py refuses the run in one line naming --trust-remote-code,
    and with it scores the text as the run's own model does. Without it, the checkpoint's carried model code
    never runs, even where the package is present (a modified modeling file does nothing)."""
    from normlab.cli import evaluate

    out = _scale_norm_run(tmp_path)
    with open(out / "final" / "modeling_normlab.py", "a") as f:
        f.write(f"\nopen({str(tmp_path / 'ran')!r}, 'w').close()\n")
    argv = [str(out), "--text", "a fine film", "--json"]
    capsys.readouterr()  # the training's lines
    assert evaluate.main(argv) == 0  # here the package imports: NormLab's own code, never the carried one
    expected = json.loads(capsys.readouterr().out)["predictions"][0]["probabilities"]
    assert not (tmp_path / "ran").exists()
    assert evaluate.main([str(out), "--json"]) == 0  # the run's own split, as NormLab's own code scores it
    own_split = capsys.readouterr().out

    def elsewhere(*args) -> subprocess.CompletedProcess:
        e = {**env(), "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}  # PYTHONPATH: NormLab, not the package
        return subprocess.run([sys.executable, "-m", "normlab.cli.evaluate", *args], cwd=tmp_path, env=e,
                              capture_output=True, text=True, timeout=240)

    refused = elsewhere(*argv)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]
    assert f"No module named '{PKG}'" in refused.stderr and "pass --trust-remote-code" in refused.stderr
    trusted = elsewhere(*argv, "--trust-remote-code")
    assert trusted.returncode == 0 and trusted.stderr == "", trusted.stderr[-3000:]
    got = json.loads(trusted.stdout)["predictions"][0]["probabilities"]
    assert got == pytest.approx(expected, abs=1e-6) and (tmp_path / "ran").exists()  # the carried code ran
    split = elsewhere(str(out), "--trust-remote-code", "--json")  # the run's own split, read from its config.yaml
    assert split.returncode == 0 and split.stderr == "", split.stderr[-3000:]
    assert json.loads(split.stdout)["accuracy"] == pytest.approx(json.loads(own_split)["accuracy"])


def test_norm_names_are_checked_when_the_config_is(user_pkg, tmp_path, capsys):
    assert "scalenorm" not in NORM_TYPES  # not registered until its module is imported
    with pytest.raises(ValueError, match=r"NormLabConfig.norm='scalenorm' is not valid; choose one of: layernorm, "):
        _tiny("scalenorm")
    import normlab_test_user_pkg.scale  # noqa: F401 - its decorator registers "scalenorm"

    assert _tiny("scalenorm").norm == "scalenorm"
    for bad, says in (("scalenrm", "did you mean 'scalenorm'?"), (f"{PKG}.nothere:X", "cannot import it"),
                      (f"{PKG}.scale:Nothere", "cannot import it"), ("torch.nn:LayerNorm", "not a norm class")):
        assert run_here(tmp_path / "bad", f"model.norm={bad}") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "rmsnorm_noweight" in err, err
    assert not (tmp_path / "bad").exists()


def test_a_norm_that_cannot_travel_is_refused_before_the_first_step(user_pkg, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_here(out, f"model.norm={PKG}.local:LocalNorm", "train.max_steps=2") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"imports its own package {PKG}" in err, err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()

    def __init__(self, dim, eps=1e-5):
        nn.Module.__init__(self)

    def forward(self, x, mask=None):
        return x

    body = {"name": "mainnorm", "__init__": __init__, "forward": forward, "initial_values": lambda self: {}}
    main_norm = register_norm(type("MainNorm", (Norm, nn.Module), {**body, "__module__": "__main__"}))
    with pytest.raises(ValueError, match=r"norm 'mainnorm' \(__main__.MainNorm\) cannot be saved .* defined in __main"):
        check_norm_code(_tiny("mainnorm"))

    class LocalScale(main_norm):  # defined inside a function: no module attribute to import it by
        name = "localscale"

    register_norm(LocalScale)
    model = NormLabForSequenceClassification(_tiny("localscale"))
    with pytest.raises(ValueError, match="not a top-level class of its module"):
        model.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused" / "config.json").exists()
