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
