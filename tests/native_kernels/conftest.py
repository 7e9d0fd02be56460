"""Every kernel test leaves the dispatch path and the pool's thread count as it found them."""

import pytest

from shm_engine.model import kernels as K


@pytest.fixture(autouse=True)
def _restore():
    path, threads = K.get_path(), K.get_num_threads()
    yield
    K.set_path(path)
    K.set_num_threads(threads)
