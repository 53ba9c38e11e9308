"""SwiGLUMLP inside FSDP2 (``fully_shard``) and DDP: two CPU processes over gloo, the kernels under
the Triton interpreter. Each rank's output and the synchronised gradients must equal an unwrapped
copy's (gradients averaged over the ranks by hand), and the sharded state dict must round-trip."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, store_file: str, wrapper: str, save: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # A file store, not TCP: no port to pick, so no race with a port another test just released.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD)
    try:
        from fused_swiglu import SwiGLUMLP
        from fused_swiglu.testing import relative_error

        torch.manual_seed(0)
        reference = SwiGLUMLP(40, 72, save=save)
        model = SwiGLUMLP(40, 72, save=save)
        model.load_state_dict(reference.state_dict())
        if wrapper == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            wrapped = model
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        x = torch.randn(37, 40, generator=torch.Generator().manual_seed(rank))
        y = wrapped(x)
        y.sum().backward()
        expected = reference(x)
        expected.sum().backward()
        assert relative_error(y, expected) < 1e-6
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if wrapper == "fsdp" else param.grad
            averaged = dict(reference.named_parameters())[name].grad.clone()
            dist.all_reduce(averaged)
            assert relative_error(grad, averaged / WORLD) < 1e-6, name
        if wrapper == "fsdp":
            # Checkpointing: Hugging Face names, sharded like the parameters, and loadable again.
            state, expected_state = model.state_dict(), reference.state_dict()
            assert state.keys() == expected_state.keys()
            for key, value in state.items():
                assert torch.equal(value.full_tensor(), expected_state[key]), key
            model.load_state_dict(state)
            assert torch.equal(model.gate_up_proj.full_tensor(), reference.gate_up_proj)
    finally:
        dist.destroy_process_group()
    # Every check passed. Leave without running C++ static destructors: at interpreter exit a
    # torch/gloo background thread is sometimes destroyed while joinable and aborts the process
    # ("terminate called without an active exception"), which would fail a test that has passed.
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize("save", ["factors", "recompute"])
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_two_cpu_ranks(device, wrapper, save, tmp_path):
    if device.type != "cpu":
        pytest.skip("CPU processes over gloo; multi-GPU runs are not part of this suite")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_worker, args=(str(tmp_path / "store"), wrapper, save), nprocs=WORLD)
