"""Tensor parallelism (tensor_parallel.py): SwiGLUMLP and SwiGLULinear sharded over two CPU processes
(gloo, kernels under the Triton interpreter) give the unsharded module's output and gradients, keep
the Hugging Face checkpoint keys, and refuse sizes that would split a packed chunk pair."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, store_file: str, save: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from fused_swiglu import SwiGLULinear, SwiGLUMLP
        from fused_swiglu.tensor_parallel import parallelize_swiglu
        from fused_swiglu.testing import relative_error

        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        x = torch.randn(37, 40)  # the same input on every rank
        for cls in (SwiGLUMLP, SwiGLULinear):
            extra = {"save": save} if cls is SwiGLUMLP or save != "preact" else {}
            reference = cls(40, 48, **extra)
            model = cls(40, 48, **extra)
            model.load_state_dict(reference.state_dict())
            parallelize_swiglu(model, mesh)
            leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
            y = model(leaf)
            y = y.full_tensor() if cls is SwiGLULinear else y
            expected = reference(ref_leaf)
            assert relative_error(y, expected) < 1e-6, cls.__name__
            y.square().sum().backward()
            expected.square().sum().backward()
            assert relative_error(leaf.grad, ref_leaf.grad) < 1e-6, cls.__name__
            for name, param in model.named_parameters():
                want = dict(reference.named_parameters())[name].grad
                assert relative_error(param.grad.full_tensor(), want) < 1e-6, (cls.__name__, name)
            # Checkpoints: the Hugging Face keys, each sharded, and loadable again.
            state, expected_state = model.state_dict(), reference.state_dict()
            assert state.keys() == expected_state.keys()
            for key, value in state.items():
                assert torch.equal(value.full_tensor(), expected_state[key]), key
            model.load_state_dict(state)
            assert torch.equal(model.gate_up_proj.full_tensor(), reference.gate_up_proj)
        try:
            parallelize_swiglu(SwiGLUMLP(40, 40), mesh)
        except ValueError as error:
            assert "whole packed chunk pairs" in str(error)
        else:
            raise AssertionError("an intermediate size that splits a chunk pair was accepted")
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as in test_distributed.py: no C++ static destructors after the checks passed


@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
def test_two_cpu_ranks(device, save, tmp_path):
    if device.type != "cpu":
        pytest.skip("CPU processes over gloo")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_worker, args=(str(tmp_path / "store"), save), nprocs=WORLD)
