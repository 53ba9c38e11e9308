"""SwiGLUMLP and SwiGLUExperts inside FSDP2 (``fully_shard``) and DDP: two CPU processes over gloo
with the kernels under the Triton interpreter, or one process per GPU over NCCL (as many as there
are, up to two). Each rank's output and the synchronised gradients must equal an unwrapped copy's (gradients
averaged over the ranks by hand), and the sharded state dict must round-trip."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CPU_WORLD = 2


def _modules(kind: str, save: str, device, rank: int):
    """(reference, model, call): an MLP or routed experts, the same weights in both, and how to call
    one on this rank's input."""
    from fused_swiglu import SwiGLUExperts, SwiGLUMLP

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(37, 40, generator=g).to(device)
    if kind in ("mlp", "mlp-fp8"):
        fp8 = kind == "mlp-fp8"  # the FP8 path's sizes are whole groups of 128
        hidden, inter = (128, 256) if fp8 else (40, 72)
        x = torch.randn(37, hidden, generator=g).to(device)
        reference = SwiGLUMLP(hidden, inter, save=save, fp8=fp8, device=device)
        model = SwiGLUMLP(hidden, inter, save=save, fp8=fp8, device=device)
        model.load_state_dict(reference.state_dict())
        return reference, model, lambda m: m(x)
    reference = SwiGLUExperts(4, 40, 24, save=save, device=device)
    model = SwiGLUExperts(4, 40, 24, save=save, device=device)
    model.load_state_dict(reference.state_dict())
    weights, index = torch.topk(torch.rand(37, 4, generator=g).softmax(-1), 2)
    weights, index = weights.to(device), index.to(device)
    return reference, model, lambda m: m(x, index, weights)


def _worker(rank: int, store_file: str, wrapper: str, save: str, backend: str, world: int, kind: str) -> None:
    if backend == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    # A file store, not TCP: no port to pick, so no race with a port another test just released.
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        from fused_swiglu.testing import relative_error

        reference, model, call = _modules(kind, save, device, rank)
        if wrapper == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            wrapped = model
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        y = call(wrapped)
        y.sum().backward()
        expected = call(reference)
        expected.sum().backward()
        assert relative_error(y, expected) < 1e-6
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if wrapper == "fsdp" else param.grad
            averaged = dict(reference.named_parameters())[name].grad.clone()
            dist.all_reduce(averaged)
            assert relative_error(grad, averaged / world) < 1e-6, name
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


@pytest.mark.parametrize("kind", ["mlp", "experts"])
@pytest.mark.parametrize("save", ["factors", "recompute"])
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_two_cpu_ranks(device, wrapper, save, kind, tmp_path):
    if device.type != "cpu":
        pytest.skip("CPU processes over gloo; multi-GPU runs are not part of this suite")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(
        _worker, args=(str(tmp_path / "store"), wrapper, save, "gloo", CPU_WORLD, kind), nprocs=CPU_WORLD
    )


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_fp8_mlp_on_two_cpu_ranks(device, wrapper, tmp_path):
    """The FP8 path quantizes the weights FSDP2 gathers, in every call: the same output and gradients."""
    if device.type != "cpu":
        pytest.skip("CPU processes over gloo; multi-GPU runs are not part of this suite")
    mp.spawn(
        _worker,
        args=(str(tmp_path / "store"), wrapper, "factors", "gloo", CPU_WORLD, "mlp-fp8"),
        nprocs=CPU_WORLD,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mlp", "mlp-fp8", "experts"])
@pytest.mark.parametrize("save", ["factors", "recompute"])
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_gpu_ranks_over_nccl(wrapper, save, kind, tmp_path):
    """One process per GPU, up to two: on a single GPU this still runs the wrappers' CUDA paths
    (FSDP2's unsharded parameters, DDP's bucketed all-reduce) around the fused kernels."""
    if kind == "mlp-fp8" and save == "recompute":
        pytest.skip("the FP8 path keeps factors or pre-activations")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    world = min(2, torch.cuda.device_count())
    mp.spawn(_worker, args=(str(tmp_path / "store"), wrapper, save, "nccl", world, kind), nprocs=world)
