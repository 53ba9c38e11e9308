"""swap_swiglu_mlps: one call puts the fused module into a LLaMA-style model, and only where it
computes the same function."""

import re

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


class DropoutMLP(LlamaLikeMLP):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(super().forward(x))


def half_frozen():
    mlp = LlamaLikeMLP()
    mlp.up_proj.weight.requires_grad_(False)
    return mlp


@pytest.mark.parametrize(
    "mlp, why",
    [
        pytest.param(LlamaLikeMLP(act=nn.GELU()), "activation is GELU", id="gelu"),
        pytest.param(LlamaLikeMLP(bias=True), "has a bias", id="bias"),
        pytest.param(LlamaLikeMLP(inter=70), "not a multiple of 8", id="intermediate-not-multiple-of-8"),
        pytest.param(LoraLikeMLP(), "ScaledLinear, not a plain nn.Linear", id="linear-subclass"),
        pytest.param(
            DropoutMLP().eval(), r"submodules beyond the SwiGLU \(dropout\)", id="dropout-in-eval-mode"
        ),
        pytest.param(half_frozen(), "both be trainable or both frozen", id="half-frozen"),
    ],
)
def test_leaves_other_mlps_alone_and_says_why(mlp, why, caplog):
    model = TinyModel([mlp])
    with caplog.at_level("WARNING", logger="fused_swiglu"):
        report = swap_swiglu_mlps(model)
    assert report == [] and list(report.skipped) == ["layers.0.mlp"]
    assert re.search(why, report.skipped["layers.0.mlp"])
    assert model.layers[0]["mlp"] is mlp
    assert re.search(why, caplog.text) and "left 1 alone" in caplog.text


def test_a_shared_mlp_stays_shared():
    shared = LlamaLikeMLP()
    model = TinyModel([shared, shared])
    x = torch.randn(3, 40)
    with torch.no_grad():
        expected = model(x)
    assert swap_swiglu_mlps(model) == ["layers.0.mlp", "layers.1.mlp"]
    assert model.layers[0]["mlp"] is model.layers[1]["mlp"]
    assert isinstance(model.layers[0]["mlp"], SwiGLUMLP)
    with torch.no_grad():
        assert relative_error(model(x), expected) < 1e-5


def test_tied_weights_are_not_untied():
    first, second = LlamaLikeMLP(), LlamaLikeMLP()
    second.gate_proj.weight = first.gate_proj.weight
    model = TinyModel([first, second])
    report = swap_swiglu_mlps(model)
    assert report == []
    assert "tied to layers.1.mlp.gate_proj.weight" in report.skipped["layers.0.mlp"]
    assert model.layers[1]["mlp"].gate_proj.weight is model.layers[0]["mlp"].gate_proj.weight


def test_offloaded_weights_are_left_alone():
    mlp = LlamaLikeMLP()
    mlp._hf_hook = object()  # what accelerate's dispatch puts on a module it offloads
    report = swap_swiglu_mlps(TinyModel([mlp]))
    assert report == [] and "accelerate" in report.skipped["layers.0.mlp"]


def test_on_mismatch_skip_swaps_the_rest():
    model = TinyModel([LlamaLikeMLP(), GateOnUp()])
    report = swap_swiglu_mlps(model, on_mismatch="skip")
    assert report == ["layers.0.mlp"] and "differs from SwiGLU" in report.skipped["layers.1.mlp"]
    assert isinstance(model.layers[1]["mlp"], GateOnUp)
    with pytest.raises(ValueError, match="on_mismatch"):
        swap_swiglu_mlps(model, on_mismatch="ignore")


def test_a_model_without_swiglu_mlps_says_so(caplog):
    with caplog.at_level("WARNING", logger="fused_swiglu"):
        assert swap_swiglu_mlps(nn.Sequential(nn.Linear(4, 4))) == []
    assert "no module with gate, up and down projection Linears" in caplog.text


def test_refuses_a_module_whose_forward_is_not_swiglu_and_swaps_nothing():
    model = TinyModel([LlamaLikeMLP(), GateOnUp()])
    with pytest.raises(ValueError, match="differs from SwiGLU"):
        swap_swiglu_mlps(model)
    assert isinstance(model.layers[0]["mlp"], LlamaLikeMLP)  # nothing half-done
    assert isinstance(model.layers[1]["mlp"], GateOnUp)
    assert swap_swiglu_mlps(model, check=False) == ["layers.0.mlp", "layers.1.mlp"]  # the caller's call


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


class FalconLikeMLP(LlamaLikeMLP):
    """Falcon-H1's MLP: multipliers on the gate pre-activation and on the output."""

    gate_multiplier, down_multiplier = 0.7, 1.9

    def forward(self, x):
        return (
            self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier))
            * self.down_multiplier
        )


@pytest.mark.parametrize("path", ["materialised", "unchecked", "meta-then-loaded"])
def test_falcon_multipliers_are_carried_on_every_load_path(path):
    """The swapped module reads the MLP's multipliers whether the swap compares outputs, is told not
    to, or sees weights on the meta device that are loaded afterwards."""
    source = TinyModel([FalconLikeMLP()])
    x = torch.randn(3, 40)
    with torch.no_grad():
        expected = source.layers[0]["mlp"](x)
    if path == "meta-then-loaded":
        model = TinyModel([FalconLikeMLP()]).to("meta")
        swap_swiglu_mlps(model)
        model.to_empty(device="cpu").load_state_dict(source.state_dict())
    else:
        model = source
        swap_swiglu_mlps(model, check=path == "materialised")
    mlp = model.layers[0]["mlp"]
    assert (mlp.gate_multiplier, mlp.down_multiplier) == (0.7, 1.9)
    with torch.no_grad():
        assert relative_error(mlp(x), expected) < 1e-5


def test_transformers_falcon_h1_mlp():
    transformers = pytest.importorskip("transformers")
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    config = transformers.FalconH1Config(hidden_size=40, intermediate_size=72, mlp_multipliers=[0.6, 1.7])
    model = TinyModel([FalconH1MLP(config)])
    x = torch.randn(5, 40)
    with torch.no_grad():
        expected = model.layers[0]["mlp"](x)
    swap_swiglu_mlps(model, check=False)
    with torch.no_grad():
        assert relative_error(model.layers[0]["mlp"](x), expected) < 1e-5


def test_a_wrapped_down_projection_is_run_not_bypassed():
    """An adapter put on the swapped module's down_proj (as PEFT does with target "down_proj" or
    "all-linear") computes and trains what it adds."""
    torch.manual_seed(0)
    model = TinyModel([LlamaLikeMLP()])
    swap_swiglu_mlps(model)
    mlp = model.layers[0]["mlp"]
    plain = mlp.down_proj
    wrapped = ScaledLinear(plain.in_features, plain.out_features, bias=False)
    wrapped.load_state_dict(plain.state_dict())
    mlp.down_proj = wrapped
    x = torch.randn(3, 40)
    with torch.no_grad():
        expected = 2 * swap_reference(mlp, x)
        assert relative_error(mlp(x), expected) < 1e-5


def swap_reference(mlp, x):
    from fused_swiglu import swiglu_mlp

    return swiglu_mlp(x, mlp.gate_up_proj, mlp.down_proj.weight)


def test_peft_lora_on_a_swapped_model_trains_its_adapters():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = TinyModel([LlamaLikeMLP()])
    x = torch.randn(3, 40)
    swap_swiglu_mlps(base)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False)
    )
    down = model.base_model.model.layers[0]["mlp"].down_proj
    model(x).sum().backward()
    assert (
        down.lora_A["default"].weight.grad is not None and down.lora_A["default"].weight.grad.abs().sum() > 0
    )
    with torch.no_grad(), model.disable_adapter():
        without = model(x)
    with torch.no_grad():
        assert relative_error(model(x), without) > 1e-3  # the adapter changes the output


@pytest.mark.parametrize("family", ["Phi3", "Glm4"])
def test_stacked_gate_up_models_swap_and_keep_their_checkpoints(family, tmp_path):
    """Phi-3 and GLM-4 keep gate and up stacked in one gate_up_proj Linear: the swap fuses them, the
    logits stay, and the state dict keeps the model's own keys and layout, so it loads into the stock
    model."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=97,
        pad_token_id=0,
    )
    model_class = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    model = model_class(config).eval()
    ids = torch.randint(1, 97, (2, 11))
    with torch.no_grad():
        expected = model(ids).logits
    stock_state = model.state_dict()
    assert swap_swiglu_mlps(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert model.model.layers[0].mlp.checkpoint_keys == "stacked"
    with torch.no_grad():
        assert relative_error(model(ids).logits, expected) < 1e-5
    state = model.state_dict()
    assert state.keys() == stock_state.keys()
    assert all(torch.equal(state[k], stock_state[k]) for k in state)
    stock = model_class(config).eval()
    stock.load_state_dict(state)
    with torch.no_grad():
        assert relative_error(stock(ids).logits, expected) < 1e-6
