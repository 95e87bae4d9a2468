"""normlab.kernels: the one switch (auto | reference), what `auto` does when a backend cannot be had (one warning,
the reference runs), errors inside a kernel (raised, not swallowed), and a build that leaves no trace (the same
losses whether or not the C++ kernels had to be built first)."""

import importlib
import json
import os
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from transformers.dynamic_module_utils import get_relative_import_files

import normlab.kernels
from model.layer_norm_op import layer_norm_reference
from tests.train_utils import REPO

# train.kernels=reference, or auto without a backend: the reference LayerNorm, and the model's own nn.Dropout and SDPA
REFERENCE = {"normlab::layer_norm": "reference", "normlab::layer_norm_backward": "reference",
             "normlab::dropout": "torch", "normlab::attention": "torch", "normlab::attention_backward": "torch"}


def _args():
    torch.manual_seed(0)
    return torch.randn(6, 40) * 3 + 1, torch.randn(40), torch.randn(40), 1e-5


def test_bad_mode_names_the_choices():
    with pytest.raises(ValueError, match="'fast' is not valid; choose one of: auto, reference"):
        normlab.kernels.enable("fast", "cpu")


def test_the_switch_decides_which_implementation_runs(restore_cpu_backend):
    args = _args()
    got = normlab.kernels.enable("auto", "cpu")
    if got["normlab::layer_norm"] != "cpp":
        pytest.skip(f"the C++ kernels are unavailable here: {normlab.kernels.unavailable('cpu')}")
    assert got == dict.fromkeys(REFERENCE, "cpp")
    from normlab.kernels import cpu

    for a, b in zip(torch.ops.normlab.layer_norm(*args), cpu.load().forward(*args)):
        assert torch.equal(a, b)  # bit for bit: the C++ kernel ran
    assert normlab.kernels.enable("reference", "cpu") == REFERENCE
    for a, b in zip(torch.ops.normlab.layer_norm(*args), layer_norm_reference(*args)):
        assert torch.equal(a, b)  # and now the reference, although the C++ kernel was registered before


def test_auto_without_a_backend_warns_once_and_runs_the_reference(restore_cpu_backend, monkeypatch):
    normlab.kernels.enable("reference", "cpu")
    monkeypatch.setattr(normlab.kernels, "_unavailable", {})  # (this process may have built the kernels already)
    from normlab.kernels import cpu

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu, "register", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = normlab.kernels.enable("auto", "cpu")
        second = normlab.kernels.enable("auto", "cpu")
    assert first == second == REFERENCE
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "cpp backend for cpu is unavailable" in messages[0] and "Ninja" in messages[0]
    assert "Ninja" in normlab.kernels.unavailable("cpu")
    args = _args()
    assert torch.equal(torch.ops.normlab.layer_norm(*args)[0], layer_norm_reference(*args)[0])


def test_an_error_inside_a_kernel_is_raised(restore_cpu_backend, monkeypatch):
    def illegal_address(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    broken = types.ModuleType("broken_kernels")  # a backend whose kernel fails the way a GPU kernel can
    broken.lib = None

    def register():
        broken.lib = torch.library.Library("normlab", "IMPL", "CPU")
        broken.lib.impl("layer_norm", illegal_address)

    broken.register = register
    broken.unregister = lambda: setattr(broken, "lib", None)  # (a Library's registrations end with the object)
    normlab.kernels.enable("reference", "cpu")
    monkeypatch.setitem(sys.modules, "broken_kernels", broken)
    monkeypatch.setitem(normlab.kernels.FAST_BACKENDS, "cpu", ("broken", "broken_kernels"))
    monkeypatch.setattr(normlab.kernels, "_unavailable", {})
    assert normlab.kernels.enable("auto", "cpu")["normlab::layer_norm"] == "broken"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        torch.ops.normlab.layer_norm(*_args())
    assert normlab.kernels.backends("cpu")["normlab::layer_norm"] == "broken"  # no silent switch to another path
    normlab.kernels.enable("reference", "cpu")
    args = _args()
    assert torch.equal(torch.ops.normlab.layer_norm(*args)[0], layer_norm_reference(*args)[0])


def test_a_checkpoints_copy_of_the_model_code_keeps_the_kernels(restore_cpu_backend, tmp_path, monkeypatch):
    """trust_remote_code imports a checkpoint's copy of model/ as another package, maybe in a process that has
    model/ and kernels registered already: the copy finds normlab::layer_norm defined and leaves it, kernels and all."""
    normlab.kernels.enable("reference", "cpu")
    marked = torch.library.Library("normlab", "IMPL", "CPU")  # a kernel whose output says that it ran
    marked.impl("layer_norm", lambda x, w, b, eps: (torch.full_like(x, 7.0), *layer_norm_reference(x, w, b, eps)[1:]))
    package = tmp_path / "checkpoint_code"
    package.mkdir()
    (package / "__init__.py").write_text("")
    norms = REPO / "model" / "norms.py"
    for path in (norms, *get_relative_import_files(norms)):  # what save_pretrained copies for norms.py
        shutil.copy(path, package / Path(path).name)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        copied = importlib.import_module("checkpoint_code.norms")
        x = _args()[0]
        with torch.no_grad():
            assert torch.equal(copied.CustomLayerNorm(40)(x), torch.full_like(x, 7.0))
    finally:
        del marked  # (a Library's registrations end with the object)
        for name in [m for m in sys.modules if m.split(".")[0] == "checkpoint_code"]:
            del sys.modules[name]
    assert torch.equal(torch.ops.normlab.layer_norm(*_args())[0], layer_norm_reference(*_args())[0])


def test_a_build_restores_the_rng_and_the_thread_count(monkeypatch):
    import torch.utils.cpp_extension

    from normlab.kernels import cpu

    def greedy_build(**kwargs):  # what a build could do to the process: draw random numbers, change threads
        torch.rand(3)
        torch.set_num_threads(torch.get_num_threads() + 1)
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", greedy_build)
    monkeypatch.setattr(cpu, "_extension", None)  # (as if this process had not loaded it yet)
    threads, state = torch.get_num_threads(), torch.random.get_rng_state()
    assert cpu.load() == "module"
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), state)


TRAIN_A_LITTLE = """
import json, torch, normlab.kernels
from model import NormLabConfig, NormLabForSequenceClassification
torch.set_num_threads(1)
backends = normlab.kernels.enable("auto", "cpu")  # builds the C++ kernels if this TORCH_EXTENSIONS_DIR has none
torch.manual_seed(0)
config = NormLabConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       norm="custom_layernorm", num_labels=2)
model = NormLabForSequenceClassification(config).train()  # dropout 0.1: the RNG stream matters
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids, labels = torch.randint(1, 50, (4, 9)), torch.tensor([0, 1, 1, 0])
losses = []
for _ in range(3):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print(json.dumps({"backends": backends, "losses": losses}))
"""


@pytest.mark.slow  # two processes, the first linking the C++ kernels
def test_same_losses_whether_or_not_the_kernels_had_to_be_built(cpp, tmp_path):
    """The first run in an extension cache without the library goes through the build (torch's load runs ninja in
    this process, then loads what it made), the second loads the cached library: both train identically. The cache
    starts as this checkout's build less its library and record, so that ninja only links (a compile from scratch
    takes minutes; it runs in ninja's subprocesses, out of reach of this process's RNG and threads, which
    test_a_build_restores_the_rng_and_the_thread_count checks around the whole build)."""
    from normlab.files.cache import MANIFEST
    from normlab.kernels.build_progress import build_dir

    name = normlab.kernels.cpu.extension_name()
    shutil.copytree(build_dir(name), tmp_path / "extensions" / name,
                    ignore=shutil.ignore_patterns(f"{name}.so", MANIFEST, "lock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", TRAIN_A_LITTLE], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "built": "kernels built in" in proc.stderr})
    assert [r["built"] for r in runs] == [True, False], runs
    assert runs[1]["backends"] == runs[0]["backends"] and runs[0]["backends"]["normlab::layer_norm"] == "cpp"
    assert runs[1]["losses"] == runs[0]["losses"]
