"""torchtitan configs for ``bench.titan`` (``torchtitan.train --module
fused_swiglu.bench.titan_configs --config NAME``): torchtitan's own models at the shapes of its
Llama 3 8B and Qwen3-30B-A3B with fewer layers (to fit one GPU with AdamW), and its Qwen3 MoE debug
model; offline byte-level data (titan.py); compiled, with torchtitan's activation checkpointing
for that model (selective for Llama 3 8B and the debug MoE, full for Qwen3-30B-A3B), checkpoints
and validation off. Batch, sequence, steps and checkpointing are torchtitan's command-line options.

torchtitan's trainer imports what the package's ``[torchtitan]`` extra does not install
(``datasets``, ``torchdata``, ``tensorboard``: torchtitan's own dependencies).
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from .titan import ByteTokenizer, SourceDataLoader


def _trainer(spec: ModelSpec, *, batch: int, seq_len: int, ac) -> Trainer.Config:
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=".",  # no Hugging Face assets: the tokenizer is bytes, checkpoints are off
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
        ),
        tokenizer=ByteTokenizer.Config(),
        dataloader=SourceDataLoader.Config(),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=20),
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=50),
        metrics=MetricsProcessor.Config(log_freq=5),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=True),
        debug=DebugConfig(seed=0),
    )


def _first_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    spec.model.layers = spec.model.layers[:layers]
    return spec


def llama3_8b_8_layers() -> Trainer.Config:
    """Llama 3 8B's shapes (hidden 4096, intermediate 14336, vocabulary 128256), 8 of its 32 layers,
    at its torchtitan defaults: batch 1 of 8192 tokens, selective activation checkpointing."""
    from torchtitan.models.llama3 import model_registry

    return _trainer(_first_layers(model_registry("8B"), 8), batch=1, seq_len=8192, ac=SelectiveAC.Config())


def qwen3_moe_debug() -> Trainer.Config:
    """torchtitan's Qwen3 MoE debug model at its defaults: batch 4 of 4096 tokens, selective AC."""
    from torchtitan.models.qwen3 import model_registry

    return _trainer(model_registry("debugmodel_moe"), batch=4, seq_len=4096, ac=SelectiveAC.Config())


def qwen3_30b_a3b_4_layers() -> Trainer.Config:
    """Qwen3-30B-A3B's shapes (128 experts of intermediate 768, 8 routed per token, hidden 2048),
    4 of its 48 layers, at its torchtitan defaults: batch 2 of 4096 tokens, full AC."""
    from torchtitan.models.qwen3 import model_registry

    return _trainer(_first_layers(model_registry("30B-A3B"), 4), batch=2, seq_len=4096, ac=FullAC.Config())
