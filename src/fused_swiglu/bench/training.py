"""One whole-model training run in this process: the model of a ``RunSpec`` (a Hugging Face
``LlamaForCausalLM`` or Qwen3-MoE from a config, no download) with the variant's MLPs, trained with
AdamW on random tokens, timed window by window. ``bench --model`` runs each variant in a process of
its own (side_by_side.py); the tests and tuning scripts run it here."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

SEQUENCE = 2048
VOCAB = 32000
HEAD_DIM = 128
#: With --moe only: transformers' ``grouped_mm`` experts implementation, the stronger stock baseline.
GROUPED_VARIANTS = ("stock-grouped-compiled",)
LOSS_STEPS = 3  # the first steps' losses, compared with stock eager's
HOST_PROFILE_TOP = 15  # operators listed per run by --host-profile


@dataclass
class RunSpec:
    """One process's work: a variant of one model size in one precision."""

    variant: str
    hidden: int
    intermediate: int
    layers: int
    tokens: int
    precision: str = "autocast"
    steps: int = 20
    windows: int = 3
    device: str = "cuda"
    backend: str = "inductor"
    sequence: int = SEQUENCE
    vocab: int = VOCAB
    lora_rank: int = 0  # > 0: PEFT LoRA of this rank on every linear layer, the base frozen
    experts: int = 0  # > 0: Qwen3-MoE with this many routed experts of ``intermediate`` per layer
    top_k: int = 2  # experts per token (with ``experts``)
    host_profile: bool = False  # also profile one window's host time per operator (torch.profiler)
    cores: tuple[int, ...] = ()  # the CPU cores its process runs on (``--pin-cores``); (): any


def _config(spec: RunSpec):
    from transformers import LlamaConfig, Qwen3MoeConfig

    heads = max(1, spec.hidden // HEAD_DIM)
    common = {
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": spec.hidden // heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.sequence,
        "attn_implementation": "sdpa",
    }
    if not spec.experts:
        if spec.variant in GROUPED_VARIANTS:
            raise ValueError(f"{spec.variant} runs transformers' grouped experts: it needs --moe")
        return LlamaConfig(**common)
    # Every layer routed: the experts are the MLP.
    moe = {"moe_intermediate_size": spec.intermediate, "num_experts": spec.experts, "mlp_only_layers": []}
    config = Qwen3MoeConfig(**common, **moe, decoder_sparse_step=1)
    config.num_experts_per_tok = spec.top_k
    if spec.variant in GROUPED_VARIANTS:
        config._experts_implementation = "grouped_mm"  # else transformers' default loop over the experts
    return config


def build_model(spec: RunSpec):
    """The model of ``spec`` with the variant's MLPs, same weights in every variant (seeded)."""
    from transformers import AutoModelForCausalLM

    kind = spec.variant.split("-")[0]
    if kind == "liger":
        import liger_kernel.transformers as liger

        # The MLP only: the same comparison as the fused swap (rope, norms and loss stay stock).
        patch = liger.apply_liger_kernel_to_qwen3_moe if spec.experts else liger.apply_liger_kernel_to_llama
        patch(rope=False, rms_norm=False, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32  # autocast: fp32 master weights
    model = AutoModelForCausalLM.from_config(_config(spec)).to(device=spec.device, dtype=dtype)
    if spec.lora_rank:
        import peft

        # Adapters first: the swap fuses adapted MLPs with their adapters (lora.py).
        config = peft.LoraConfig(r=spec.lora_rank, lora_alpha=2 * spec.lora_rank, target_modules="all-linear")
        model = peft.get_peft_model(model, config)
    if kind == "fused":
        from ..integrations import swap_swiglu_mlps

        save = next((s for s in ("preact", "recompute") if s in spec.variant), "factors")
        swap_swiglu_mlps(model, save=save, fp8="-fp8" in spec.variant)
    if "torchao" in spec.variant:
        _convert_to_float8(model, "rowwise" if "rowwise" in spec.variant else "tensorwise")
    model.train()
    if "compiled" in spec.variant:
        mode = "reduce-overhead" if spec.variant.endswith("-ro") else None
        model = torch.compile(model, backend=spec.backend, mode=mode)
    return model


def _convert_to_float8(model, recipe: str) -> None:
    """torchao's float8 training on the model's Linears (``recipe``), the output layer and the fused
    MLPs' down projections left out (the fused MLP runs its own, fused_swiglu.fp8.torchao_filter)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from ..fp8 import torchao_filter

    def convert(module, fqn: str) -> bool:
        return torchao_filter(module, fqn) and not fqn.endswith("lm_head")

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, module_filter_fn=convert, config=config)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Training:
    """``spec``'s model built (compiled, for a compiled variant) and trained through its first steps in
    this process, ready to time windows of ``spec.steps`` steps."""

    def __init__(self, spec: RunSpec) -> None:
        from torch._dynamo.utils import counters

        counters.clear()
        self.spec = spec
        model = build_model(spec)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=spec.device.startswith("cuda"))
        batch = max(1, spec.tokens // spec.sequence)
        sequence = spec.tokens // batch
        gen = torch.Generator().manual_seed(1)
        data = torch.randint(0, spec.vocab, (batch, sequence), generator=gen).to(spec.device)
        autocast = torch.autocast(
            spec.device.split(":")[0], dtype=torch.bfloat16, enabled=spec.precision == "autocast"
        )

        def step() -> torch.Tensor:
            if spec.variant.endswith("-ro"):
                torch.compiler.cudagraph_mark_step_begin()
            with autocast:
                loss = model(input_ids=data, labels=data).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().clone()  # a CUDA graph's output is overwritten by its next replay

        self.step = step
        start = time.perf_counter()
        losses = [step()]
        _sync(spec.device)
        self.first_step_s = time.perf_counter() - start
        self.graphs_after_first = counters["stats"]["unique_graphs"]
        losses += [step() for _ in range(LOSS_STEPS - 1)]
        self.losses = [float(loss) for loss in losses]
        if spec.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        self.window_ms: list[float] = []

    def window(self) -> float:
        """Times ``spec.steps`` training steps; returns (and keeps) ms per step."""
        _sync(self.spec.device)
        start = time.perf_counter()
        for _ in range(self.spec.steps):
            self.step()
        _sync(self.spec.device)
        self.window_ms.append((time.perf_counter() - start) * 1e3 / self.spec.steps)
        return self.window_ms[-1]

    def result(self) -> dict:
        """What the run measured, over the windows timed so far."""
        from torch._dynamo.utils import counters

        spec = self.spec
        step_ms = statistics.median(self.window_ms)
        peak = torch.cuda.max_memory_allocated() / 2**20 if spec.device.startswith("cuda") else None
        profiled = {"host_ops": host_profile(self.step, spec.steps)} if spec.host_profile else {}
        compiled = "compiled" in spec.variant
        return {
            **profiled,
            **asdict(spec),
            "step_ms": step_ms,
            "window_ms": self.window_ms,
            "tokens_per_s": spec.tokens / step_ms * 1e3,
            "peak_mib": peak,
            "compile_s": max(0.0, self.first_step_s - step_ms / 1e3) if compiled else None,
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": counters["stats"]["unique_graphs"] - self.graphs_after_first,
            "losses": self.losses,
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        }


def run_variant(spec: RunSpec) -> dict:
    """Train ``spec``'s model in this process for ``spec.windows`` windows and report what it measured."""
    training = Training(spec)
    for _ in range(spec.windows):
        training.window()
    return training.result()


def _profile_row(event, steps: int) -> dict:
    return {
        "name": event.key,
        "calls": event.count / steps,
        "self_us": event.self_cpu_time_total / steps,
        "total_us": event.cpu_time_total / steps,
    }


def host_profile(step, steps: int, top: int = HOST_PROFILE_TOP, by_shape: tuple[str, ...] = ()) -> dict:
    """Where the host's time goes over ``steps`` training steps: torch.profiler's CPU activity, per
    operator (aten ops, custom ops, compiled kernels' launches, the graph's own frames) its calls and
    its self and total host microseconds per step, the ``top`` by self time; ``self_us`` is every
    operator's self time together, per step. The operators named in ``by_shape`` are also listed
    per input shapes (``"by_shape"``; recording shapes adds host time to every operator)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=bool(by_shape)) as prof:
        for _ in range(steps):
            step()
    rows = sorted((_profile_row(e, steps) for e in prof.key_averages()), key=lambda r: -r["self_us"])
    result = {"self_us": sum(row["self_us"] for row in rows), "top": rows[:top]}
    if by_shape:
        shaped = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in by_shape]
        rows = [{**_profile_row(e, steps), "shapes": e.input_shapes} for e in shaped]
        result["by_shape"] = sorted(rows, key=lambda r: -r["total_us"])
    return result
