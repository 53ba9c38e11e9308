"""SwiGLUMLP: Hugging Face state-dict compatibility, initialisation, training and inference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fused_swiglu import SwiGLUMLP, pack_gate_up
from fused_swiglu.testing import relative_error


class HFStyleMLP(nn.Module):
    """The shape of transformers' LlamaMLP (bias-free Linears, SiLU gate)."""

    def __init__(self, hidden, inter, dtype=None, device=None):
        super().__init__()
        kw = {"dtype": dtype, "device": device, "bias": False}
        self.gate_proj = nn.Linear(hidden, inter, **kw)
        self.up_proj = nn.Linear(hidden, inter, **kw)
        self.down_proj = nn.Linear(inter, hidden, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_state_dict_uses_hugging_face_names_and_round_trips_exactly():
    mlp = SwiGLUMLP(40, 72)
    state = mlp.state_dict()
    assert set(state) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert state["gate_proj.weight"].shape == (72, 40) and state["down_proj.weight"].shape == (40, 72)
    other = SwiGLUMLP(40, 72)
    other.load_state_dict(state)
    assert torch.equal(other.gate_up_proj, mlp.gate_up_proj)
    assert torch.equal(other.down_proj.weight, mlp.down_proj.weight)


def test_loads_an_hf_mlp_state_dict_without_renaming(device):
    hf = HFStyleMLP(40, 72, device=device)
    mlp = SwiGLUMLP(40, 72, device=device)
    mlp.load_state_dict(hf.state_dict())
    assert torch.equal(mlp.gate_up_proj, pack_gate_up(hf.gate_proj.weight, hf.up_proj.weight))
    back = mlp.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_nested_state_dict_keys_keep_their_prefix():
    outer = nn.Sequential(SwiGLUMLP(16, 16))
    assert set(outer.state_dict()) == {"0.gate_proj.weight", "0.up_proj.weight", "0.down_proj.weight"}
    outer.load_state_dict(nn.Sequential(HFStyleMLP(16, 16)).state_dict())


@pytest.mark.parametrize("save", ["factors", "preact"])
def test_training_matches_hf_module(device, save):
    hf = HFStyleMLP(40, 72, device=device, dtype=torch.float32)
    mlp = SwiGLUMLP.from_mlp(hf, save=save)
    x = torch.randn(3, 11, 40, device=device)
    x_hf = x.clone().requires_grad_()
    x.requires_grad_()
    dy = torch.randn(3, 11, 40, device=device)
    hf(x_hf).backward(dy)
    y = mlp(x)
    y.backward(dy)
    assert relative_error(y, hf(x_hf)) < 1e-5
    assert relative_error(x.grad, x_hf.grad) < 1e-5
    assert (
        relative_error(mlp.gate_up_proj.grad, pack_gate_up(hf.gate_proj.weight.grad, hf.up_proj.weight.grad))
        < 1e-5
    )
    assert relative_error(mlp.down_proj.weight.grad, hf.down_proj.weight.grad) < 1e-5


def test_inference_matches_hf_module(device):
    hf = HFStyleMLP(40, 72, device=device)
    mlp = SwiGLUMLP.from_mlp(hf)
    x = torch.randn(5, 40, device=device)
    with torch.inference_mode():
        assert relative_error(mlp(x), hf(x)) < 1e-5


def test_multipliers_are_applied():
    mlp = SwiGLUMLP(16, 16, gate_multiplier=0.5, down_multiplier=3.0, dtype=torch.float64)
    state = mlp.state_dict()
    gate, up = state["gate_proj.weight"].t(), state["up_proj.weight"].t()
    x = torch.randn(4, 16, dtype=torch.float64)
    expected = 3.0 * (F.silu(0.5 * x @ gate) * (x @ up)) @ mlp.down_proj.weight.t()
    torch.testing.assert_close(mlp(x), expected)
    assert "gate_multiplier=0.5" in repr(mlp)


def test_initialisation_matches_nn_linear_bounds():
    mlp = SwiGLUMLP(64, 256)
    assert mlp.gate_up_proj.abs().max() <= 64**-0.5
    assert mlp.down_proj.weight.abs().max() <= 256**-0.5
    assert mlp.gate_up_proj.std() > 0.5 * 64**-0.5 / 3**0.5  # uniform, not collapsed


@pytest.mark.parametrize(
    "kwargs, error",
    [
        pytest.param({"intermediate_size": 20}, ValueError, id="I-not-multiple-of-8"),
        pytest.param({"save": "all"}, ValueError, id="bad-save"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        SwiGLUMLP(**{"hidden_size": 16, "intermediate_size": 16, **kwargs})


def test_transformers_llama_mlp_state_dict_loads():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64)
    hf = transformers.models.llama.modeling_llama.LlamaMLP(config)
    mlp = SwiGLUMLP.from_mlp(hf)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert relative_error(mlp(x), hf(x)) < 1e-5


def test_from_mlp_keeps_frozen_weights_frozen():
    hf = HFStyleMLP(40, 72)
    hf.gate_proj.weight.requires_grad_(False)
    hf.up_proj.weight.requires_grad_(False)
    mlp = SwiGLUMLP.from_mlp(hf)
    assert not mlp.gate_up_proj.requires_grad and mlp.down_proj.weight.requires_grad
    hf.up_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="both"):
        SwiGLUMLP.from_mlp(hf)
