"""Test setup: the device, the Triton interpreter on CPU, NaN-poisoned allocations, seeds.

On a machine without CUDA the real kernels run under ``TRITON_INTERPRET=1``, which must be set before
Triton decorates any kernel, so before ``fused_swiglu`` is imported.
"""

import os

import pytest
import torch
from shapes import dtypes_for, shapes_for

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device the kernels run on (cpu means the Triton interpreter)",
    )


def pytest_generate_tests(metafunc):
    device = torch.device(metafunc.config.getoption("--device"))
    if "shape" in metafunc.fixturenames:
        metafunc.parametrize("shape", shapes_for(device))
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", dtypes_for(device), ids=lambda d: str(d).removeprefix("torch."))


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    return torch.device(request.config.getoption("--device"))


def pytest_collection_modifyitems(config, items):
    on_gpu = config.getoption("--device").startswith("cuda")
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if not on_gpu and ("gpu" in item.keywords or "large" in item.keywords):
            item.add_marker(skip)


def _poison_value(dtype: torch.dtype):
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool or dtype.is_complex:
        return None
    return torch.iinfo(dtype).max  # integers (row indices, tile tables): never a valid row or expert


def _poisoned(factory):
    def make(*args, **kwargs):
        t = factory(*args, **kwargs)
        value = _poison_value(t.dtype)
        if value is None:
            return t
        # No grad: e.g. torch.utils.checkpoint's empty leaf that requires grad. The version counter
        # stays at 0, as torch.empty leaves it (the fused backward reads it).
        if t.is_inference():  # inference tensors have no version counter
            return t.fill_(value)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
            t.fill_(value)
        return t

    return make


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """Every torch.empty is NaN-filled (integers: their largest value), so an element a kernel never
    writes fails the test."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))


@pytest.fixture(autouse=True)
def no_plans_from_earlier_tests():
    """Launch plans recorded in another test (perhaps under a patched kernel choice) are dropped."""
    from fused_swiglu.kernels import plans

    plans.forget()


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
