"""PEFT's LoRA adapters on a swapped model (lora.py): PEFT first, then the swap fuses the adapted
MLPs with their gate and up adapters inside the fused GEMM. Logits and every adapter gradient equal
stock PEFT's, dropout included; adapters save in PEFT's format and load onto a stock base model;
what the fused forward does not compute is left alone with the reason, or refused by name."""

import copy

import pytest
import torch

from fused_swiglu import SwiGLUMLP, swap_swiglu_mlps
from fused_swiglu.testing import relative_error

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def tiny_llama(device, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).to(device)


def lora_pair(device, **lora):
    """Stock PEFT and the same PEFT model swapped, with random (not zero) B so adapters matter."""
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, **lora)
    stock = peft.get_peft_model(tiny_llama(device), config)
    fused = copy.deepcopy(stock)
    report = swap_swiglu_mlps(fused)
    assert len(report) == 2 and not report.skipped
    return stock, fused


def step(model, ids, seed=1):
    torch.manual_seed(seed)  # the adapters' dropout draws the same masks in both models
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_adapters_train_like_stock_peft(device, dropout):
    stock, fused = lora_pair(device, lora_dropout=dropout)
    stock.train(), fused.train()
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(0)).to(device)
    logits, grads = step(stock, ids)
    fused_logits, fused_grads = step(fused, ids)
    assert relative_error(fused_logits, logits) < 1e-5
    assert fused_grads.keys() == grads.keys()
    mlp_adapters = [n for n in grads if ".mlp." in n]
    assert len(mlp_adapters) == 2 * 3 * 2  # layers x (gate, up, down) x (A, B)
    for name, grad in grads.items():
        assert relative_error(fused_grads[name], grad) < 1e-4, name


def test_the_swapped_mlp_keeps_peft_names_and_holds_no_second_base_weight(device):
    _, fused = lora_pair(device)
    mlp = fused.base_model.model.model.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP)
    stock_keys = set(lora_pair(device)[0].state_dict())
    assert set(fused.state_dict()) == stock_keys
    assert not any(
        "gate_proj.base_layer" in n or "up_proj.base_layer" in n for n, _ in fused.named_parameters()
    )


def test_adapters_save_in_peft_format_and_load_onto_a_stock_model(device, tmp_path):
    _, fused = lora_pair(device)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0)).to(device)
    fused.eval()
    with torch.no_grad():
        expected = fused(input_ids=ids).logits
    fused.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(tiny_llama(device), tmp_path).eval()
    with torch.no_grad():
        assert relative_error(loaded(input_ids=ids).logits, expected) < 1e-5


def test_disabled_adapters_give_the_base_model(device):
    _, fused = lora_pair(device)
    base = tiny_llama(device).eval()
    fused.eval()
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), fused.disable_adapter():
        without = fused(input_ids=ids).logits
    with torch.no_grad():
        assert relative_error(without, base(input_ids=ids).logits) < 1e-5


def test_merging_after_the_swap_is_refused_by_name(device):
    _, fused = lora_pair(device)
    with pytest.raises(RuntimeError, match="packed in the fused MLP"):
        fused.merge_and_unload()


def test_dora_is_left_alone_with_the_reason(device):
    config = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"], use_dora=True)
    model = peft.get_peft_model(tiny_llama(device), config)
    report = swap_swiglu_mlps(model)
    assert report == [] and all("LoRA variant" in why for why in report.skipped.values())


def test_compiled_fused_adapters_match_eager(device):
    _, fused = lora_pair(device)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0)).to(device)
    eager_logits, eager_grads = step(fused, ids)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fused)(input_ids=ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(fused, backend="aot_eager")
    logits, grads = step(compiled, ids)
    assert relative_error(logits, eager_logits) < 1e-6
    for name, grad in grads.items():
        assert relative_error(grad, eager_grads[name.removeprefix("_orig_mod.")]) < 1e-5, name


def test_peft_after_the_swap_says_that_gate_and_up_got_no_adapter(device, caplog):
    model = tiny_llama(device)
    swap_swiglu_mlps(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0)).to(device)
    with caplog.at_level("WARNING", logger="fused_swiglu"):
        model(input_ids=ids)
        model(input_ids=ids)
    said = [r for r in caplog.records if "PEFT was applied after the swap" in r.getMessage()]
    assert len(said) == 2  # once per MLP module, not once per call
