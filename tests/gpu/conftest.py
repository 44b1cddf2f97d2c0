"""Fixtures of the GPU tests.

* `restores_cuda_defaults`: after the test, the default stream is current again and the default CUDA
  generator is out of capture mode, whatever the test left. For tests of failed graph captures, so that a
  regression there fails that test alone and not the GPU tests after it in the process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def restores_cuda_defaults() -> Iterator[None]:
    yield
    torch.cuda.set_stream(torch.cuda.default_stream())
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.graphsafe_set_state(generator.clone_state())
