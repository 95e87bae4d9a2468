"""Suite-wide test settings."""

import pytest
import torch

import normlab.kernels


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models: one thread is fastest, and on a shared 2-core machine a second thread mostly waits for the
    first (docs/architecture.md has the measurement)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def wandb_home(tmp_path_factory):
    """wandb's staging and cache folders in a temporary folder (inherited by the subprocesses tests start), not the
    user's ~/.local/share/wandb: an offline run's artifacts and tables are copied there to wait for `wandb sync`."""
    root = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DATA_DIR", str(root / "data"))
        mp.setenv("WANDB_CACHE_DIR", str(root / "cache"))
        yield root


def _register_cpu(backend: str) -> bool:
    """Register `backend` ("reference" or "cpp") for NormLab's operators on CPU; False if it cannot be had."""
    got = normlab.kernels.enable("auto" if backend == "cpp" else "reference", "cpu")
    return got["normlab::layer_norm"] == backend


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted tiny run (train_utils.REFERENCE) that the resume tests compare their resumed runs with."""
    from train_utils import REFERENCE, run_here

    out = tmp_path_factory.mktemp("reference") / "run"
    assert run_here(out, *REFERENCE) == 0
    return out


@pytest.fixture(params=["reference", "cpp"])
def backend(request):
    """The test runs on each CPU implementation of NormLab's operators: their reference math and normlab.kernels'
    C++ kernels (skipped, with the reason, only where those cannot be built); what was registered before is put
    back."""
    before = normlab.kernels.backends("cpu")["normlab::layer_norm"]
    if not _register_cpu(request.param):
        pytest.skip(f"the C++ kernels are unavailable here: {normlab.kernels.unavailable('cpu')}")
    yield request.param
    _register_cpu(before)


@pytest.fixture
def restore_cpu_backend():
    """The test changes which implementation runs on CPU: put back what was registered before."""
    before = normlab.kernels.backends("cpu")["normlab::layer_norm"]
    yield
    _register_cpu(before)


@pytest.fixture
def cpp():
    """The test needs the C++ kernels registered (skipped, with the reason, where they cannot be built)."""
    before = normlab.kernels.backends("cpu")["normlab::layer_norm"]
    if not _register_cpu("cpp"):
        pytest.skip(f"the C++ kernels are unavailable here: {normlab.kernels.unavailable('cpu')}")
    yield
    _register_cpu(before)


def pytest_configure(config):
    """`slow`: this suite's heavy tests (training runs, launched processes, builds), which the quick tier
    `pytest -m "not slow"` leaves out; transformers' own slow group carries it too. The other marks are those
    transformers' common tests carry (tests/test_hf_common.py runs them), registered so pytest does not warn about
    them: they select test groups in transformers' CI; here every test runs unless it skips."""
    config.addinivalue_line("markers", "slow: a heavy test, left out of the quick tier (pytest -m 'not slow')")
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                 "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a test group of transformers' CI")


def pytest_ignore_collect(collection_path, config):
    """The quick tier does not even import tests/test_hf_common.py: importing it fetches transformers' test files
    from the package registry (once; cached in .cache/)."""
    if collection_path.name == "test_hf_common.py" and "not slow" in (config.option.markexpr or ""):
        return True
    return None
