"""What several unit modules share."""
import pytest


@pytest.fixture(scope="module")
def megatron_process_group():
    """A one-rank gloo process group with megatron-core's parallel state (seed 1234), for the
    module's tests that build megatron modules; torn down after the module."""
    from megatron_rl.platform import destroy_distributed, init_distributed

    init_distributed(seed=1234)
    yield
    destroy_distributed()
