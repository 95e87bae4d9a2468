"""Suite-wide test settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models: one thread is fastest, and on a shared 2-core machine a second thread mostly waits for the
    first (a modeling test file took 85 s with two threads, 29 s with one)."""
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
