"""Tensor parallelism (tensor_parallel.py): SwiGLUMLP and SwiGLULinear sharded over two CPU processes
(gloo, kernels under the Triton interpreter) give the unsharded module's output and gradients, keep
the Hugging Face checkpoint keys (a distributed checkpoint of two ranks loads in one process), and
refuse sizes that would split a packed chunk pair; FSDP2 over tensor parallelism on a [2, 2] mesh of
four processes does the same; the swap leaves stock MLPs that are already sharded alone, saying what
to do instead."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(
    rank: int, store_file: str, save: str, checkpoint: str, backend: str = "gloo", world: int = WORLD
):
    if backend == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cpu"
    else:
        device = "cuda"
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from fused_swiglu import SwiGLULinear, SwiGLUMLP
        from fused_swiglu.tensor_parallel import parallelize_swiglu
        from fused_swiglu.testing import relative_error

        mesh = init_device_mesh(device, (world,))
        torch.manual_seed(0)
        x = torch.randn(37, 40).to(device)  # the same input on every rank
        for cls in (SwiGLUMLP, SwiGLULinear):
            extra = {"save": save} if cls is SwiGLUMLP or save != "preact" else {}
            reference = cls(40, 48, **extra, device=device)
            model = cls(40, 48, **extra, device=device)
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
            if cls is SwiGLUMLP:  # a sharded checkpoint, loaded in one process by the test
                import torch.distributed.checkpoint as dcp

                dcp.save(model.state_dict(), checkpoint_id=checkpoint)
        # A stock MLP already sharded (as transformers' tp_plan leaves it) is left alone, with what to do.
        from torch.distributed.tensor import Shard, distribute_tensor

        from fused_swiglu import swap_swiglu_mlps

        stock = torch.nn.Module()
        stock.mlp = torch.nn.Module()
        for name, shape in (("gate_proj", (48, 40)), ("up_proj", (48, 40)), ("down_proj", (40, 48))):
            layer = torch.nn.Linear(shape[1], shape[0], bias=False, device=device)
            layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.data, mesh, [Shard(0)]))
            setattr(stock.mlp, name, layer)
        stock.mlp.act_fn = torch.nn.SiLU()
        report = swap_swiglu_mlps(stock)
        assert not report and "parallelize_swiglu" in report.skipped["mlp"]
        if world > 1:
            try:
                parallelize_swiglu(SwiGLUMLP(40, 8 * (2 * world - 1), device=device), mesh)
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
    checkpoint = tmp_path / "checkpoint"
    mp.spawn(_worker, args=(str(tmp_path / "store"), save, str(checkpoint)), nprocs=WORLD)
    # The two ranks' checkpoint, loaded into an unsharded module in this one process.
    import torch.distributed.checkpoint as dcp

    from fused_swiglu import SwiGLUMLP

    torch.manual_seed(0)
    torch.randn(37, 40)
    reference = SwiGLUMLP(40, 48, save=save)
    loaded = SwiGLUMLP(40, 48, save=save)
    state = loaded.state_dict()
    assert set(state) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    dcp.load(state, checkpoint_id=str(checkpoint))
    loaded.load_state_dict(state)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def _worker_2d(rank: int, store_file: str) -> None:
    """FSDP2 over 2 ranks times tensor parallel over 2: a [2, 2] mesh of four processes."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=4)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from fused_swiglu import SwiGLUMLP
        from fused_swiglu.tensor_parallel import parallelize_swiglu
        from fused_swiglu.testing import relative_error

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        reference = SwiGLUMLP(40, 48)
        model = SwiGLUMLP(40, 48)
        model.load_state_dict(reference.state_dict())
        parallelize_swiglu(model, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        # Data parallel: each dp group its own batch, the same within a tp group.
        x = torch.randn(29, 40, generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
        y = model(x)
        expected = reference(x)
        assert relative_error(y, expected) < 1e-6
        y.sum().backward()
        expected.sum().backward()
        for name, param in model.named_parameters():
            averaged = dict(reference.named_parameters())[name].grad.clone()
            dist.all_reduce(averaged, group=mesh["dp"].get_group())
            assert relative_error(param.grad.full_tensor(), averaged / 2) < 1e-6, name
        state, expected_state = model.state_dict(), reference.state_dict()
        assert state.keys() == expected_state.keys()
        for key, value in state.items():
            assert torch.equal(value.full_tensor(), expected_state[key]), key
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def test_fsdp2_and_tensor_parallel_on_a_2d_mesh(device, tmp_path):
    if device.type != "cpu":
        pytest.skip("CPU processes over gloo")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_worker_2d, args=(str(tmp_path / "store"),), nprocs=4)


@pytest.mark.gpu
def test_gpu_ranks_over_nccl(tmp_path):
    """One process per GPU, up to two (one GPU: the DTensor paths around the kernels over NCCL)."""
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    world = min(2, torch.cuda.device_count())
    args = (str(tmp_path / "store"), "factors", str(tmp_path / "checkpoint"), "nccl", world)
    mp.spawn(_worker, args=args, nprocs=world)
