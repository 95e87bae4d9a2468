"""Hugging Face's own common model tests (ModelTesterMixin, ConfigTester), run against NormLab as they run against
an in-tree model. They ship in the transformers *sdist* (tests/test_modeling_common.py,
tests/test_configuration_common.py), not in the wheel, so `transformers_tests()` fetches the sdist of the installed
version from the package registry once (`pip download --no-deps --no-binary :all:`), keeps those two files in the
cache ($NORMLAB_CACHE, default .cache/) and makes them importable as the package `transformers_tests`.

The sdist holds only the top-level files of transformers' tests/ folder. Three modules they import are not in it,
and this harness writes its own stand-ins for them (no transformers test code is copied):
  - exporters/test_export.py: `ExportTesterMixin`, the torch.export / ONNX exporters' tests (our own export test is
    in tests/test_hf_common.py);
  - generation/test_utils.py: `GenerationTesterMixin`, used only as a marker of generative models (NormLab is an
    encoder: it never generates);
  - utils/test_configuration_utils.py: `config_common_kwargs`, non-default values of PreTrainedConfig's common
    arguments that ConfigTester checks a config accepts (ours below).
"""

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

from module_loader import load_module

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "transformers_tests"
SHIPPED = ("test_modeling_common.py", "test_configuration_common.py")

STAND_INS = {
    "exporters/test_export.py": '''
class ExportTesterMixin:
    """Not in the transformers sdist: the exporters' tests are not run here."""
''',
    "generation/test_utils.py": '''
class GenerationTesterMixin:
    """Not in the transformers sdist. ModelTesterMixin only checks whether a tester inherits it (generative models
    must); an encoder's tester does not."""
''',
    "utils/test_configuration_utils.py": '''
# Non-default values for common PreTrainedConfig arguments: ConfigTester.check_config_arguments_init builds a
# config from them and checks every one was kept.
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "tie_word_embeddings": False,
    "chunk_size_feed_forward": 5,
    "architectures": ["NormLabForMaskedLM"],
    "finetuning_task": "sst2",
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "tokenizer_class": "BertTokenizerFast",
    "bos_token_id": 6,
    "pad_token_id": 7,
    "eos_token_id": 8,
    "sep_token_id": 9,
    "problem_type": "regression",
}
''',
}


def cache_root() -> Path:
    return Path(os.environ.get("NORMLAB_CACHE") or REPO / ".cache") / "transformers-tests" / transformers.__version__


def _download_tests(dest: Path) -> None:
    """The installed version's sdist from the package registry -> its two common test files in dest/."""
    version = transformers.__version__
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"transformers=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        archives = list(Path(tmp).glob("transformers-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise RuntimeError(f"`{' '.join(cmd[2:])}` failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
        with tarfile.open(archives[0]) as tar:
            for name in SHIPPED:
                member = tar.getmember(f"{archives[0].name[: -len('.tar.gz')]}/tests/{name}")
                (dest / name).write_bytes(tar.extractfile(member).read())


def transformers_tests() -> str:
    """Import path of the package holding transformers' common tests (fetched on first use); RuntimeError when the
    registry cannot be reached and nothing is cached."""
    root = cache_root()
    pkg = root / PACKAGE
    if not all((pkg / name).exists() for name in SHIPPED):
        with tempfile.TemporaryDirectory(dir=_mkdir(root)) as tmp:
            staged = Path(tmp) / PACKAGE
            _download_tests(_mkdir(staged))
            (staged / "__init__.py").touch()  # ConfigTester's module executes its package's __init__.py
            for rel, text in STAND_INS.items():
                path = staged / rel
                _mkdir(path.parent)
                (path.parent / "__init__.py").touch()
                path.write_text(text.lstrip())
            try:
                os.replace(staged, pkg)  # atomic: a concurrent or killed fetch never leaves half a package
            except OSError:
                if not all((pkg / name).exists() for name in SHIPPED):
                    raise
    load_module(PACKAGE, pkg)
    return PACKAGE


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
