"""swap_swiglu_mlps: one call puts the fused module into a LLaMA-style model, and only where it
computes the same function."""

import pytest
import torch
from torch import nn

from fused_swiglu import SwiGLUMLP, swap_swiglu_mlps
from fused_swiglu.testing import relative_error


class LlamaLikeMLP(nn.Module):
    def __init__(self, hidden=40, inter=72, act=None, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GateOnUp(LlamaLikeMLP):
    """The pattern's attributes, a different function: the activation sits on the up projection."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class ScaledLinear(nn.Linear):
    """A Linear subclass that computes more than x @ W^T (as adapters and quantized layers do)."""

    def forward(self, x):
        return 2 * super().forward(x)


class LoraLikeMLP(LlamaLikeMLP):
    def __init__(self):
        super().__init__()
        self.gate_proj = ScaledLinear(40, 72, bias=False)


class TinyModel(nn.Module):
    def __init__(self, mlps):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": m}) for m in mlps)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["mlp"](x)
        return x


def test_swaps_every_llama_mlp_and_keeps_the_function(device):
    torch.manual_seed(0)
    model = TinyModel([LlamaLikeMLP(), LlamaLikeMLP()]).to(device)
    x = torch.randn(3, 37, 40, device=device)
    with torch.no_grad():
        expected = model(x)
    state_before = model.state_dict()

    swapped = swap_swiglu_mlps(model, save="preact")

    assert swapped == ["layers.0.mlp", "layers.1.mlp"]
    mlps = [layer["mlp"] for layer in model.layers]
    assert all(isinstance(m, SwiGLUMLP) and m.save == "preact" for m in mlps)
    assert model.state_dict().keys() == state_before.keys()
    with torch.no_grad():
        assert relative_error(model(x), expected) < 1e-5


@pytest.mark.parametrize(
    "mlp",
    [
        pytest.param(LlamaLikeMLP(act=nn.GELU()), id="gelu"),
        pytest.param(LlamaLikeMLP(bias=True), id="bias"),
        pytest.param(LlamaLikeMLP(inter=70), id="intermediate-not-multiple-of-8"),
        pytest.param(LoraLikeMLP(), id="linear-subclass"),
    ],
)
def test_leaves_other_mlps_alone(mlp):
    model = TinyModel([mlp])
    assert swap_swiglu_mlps(model) == []
    assert model.layers[0]["mlp"] is mlp


def test_refuses_a_module_whose_forward_is_not_swiglu_and_swaps_nothing():
    model = TinyModel([LlamaLikeMLP(), GateOnUp()])
    with pytest.raises(ValueError, match="differs from SwiGLU"):
        swap_swiglu_mlps(model)
    assert isinstance(model.layers[0]["mlp"], LlamaLikeMLP)  # nothing half-done
    assert isinstance(model.layers[1]["mlp"], GateOnUp)
    assert swap_swiglu_mlps(model, check=False) == ["layers.0.mlp", "layers.1.mlp"]  # the caller's call


def test_refuses_half_frozen_gate_and_up():
    mlp = LlamaLikeMLP()
    mlp.up_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="both"):
        swap_swiglu_mlps(TinyModel([mlp]))


def test_rejects_the_model_being_the_mlp_itself_and_bad_modes():
    with pytest.raises(ValueError, match="from_mlp"):
        swap_swiglu_mlps(LlamaLikeMLP())
    with pytest.raises(ValueError, match="save"):
        swap_swiglu_mlps(TinyModel([LlamaLikeMLP()]), save="everything")


def test_transformers_llama_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=97
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        expected = model(ids).logits
    assert swap_swiglu_mlps(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    with torch.no_grad():
        assert relative_error(model(ids).logits, expected) < 1e-5


def test_meta_device_models_are_swapped_without_a_forward():
    """Models built on the meta device (weights materialised later) swap too; there is nothing to run."""
    model = TinyModel([LlamaLikeMLP()]).to("meta")
    assert swap_swiglu_mlps(model) == ["layers.0.mlp"]
    assert model.layers[0]["mlp"].gate_up_proj.device.type == "meta"


def test_swapping_leaves_the_global_random_stream_alone():
    model = TinyModel([LlamaLikeMLP()])
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    swap_swiglu_mlps(model)
    assert torch.equal(torch.rand(3), expected)
