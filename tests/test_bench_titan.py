"""bench.titan's pieces that run without a GPU: the byte tokenizer, the dataloader torchtitan's
trainer builds (windows of the standard library's source, next-byte labels, one stream per data
parallel rank, resumable), the reading of torchtitan's log and the report. The trainer runs
themselves need a GPU (docs/performance.md)."""

import pytest
import torch

pytest.importorskip("torchtitan", reason='torchtitan: pip install --no-deps "torchtitan==0.3.*"')

from fused_swiglu.bench import titan  # noqa: E402


def test_byte_tokenizer_round_trips_text():
    tokenizer = titan.ByteTokenizer.Config().build(tokenizer_path=".")
    ids = tokenizer.encode("déjà vu", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert max(ids[1:-1]) < 256 and tokenizer.get_vocab_size() == 258
    assert tokenizer.decode(ids) == "déjà vu"


def _loader(rank: int, seq_len: int = 64, batch: int = 3):
    tokenizer = titan.ByteTokenizer.Config().build(tokenizer_path=".")
    return titan.SourceDataLoader.Config().build(
        dp_world_size=2, dp_rank=rank, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=batch
    )


def test_the_dataloader_gives_windows_and_their_next_bytes():
    inputs, labels = next(iter(_loader(0)))
    tokens = inputs["input"]
    assert tokens.shape == labels.shape == (3, 64) and tokens.dtype == torch.long
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256
    assert torch.equal(inputs["positions"], torch.arange(64).expand(3, 64))
    # The same stream for the same rank in every process; another rank's differs.
    assert torch.equal(next(iter(_loader(0)))[1], labels)
    assert not torch.equal(next(iter(_loader(1)))[1], labels)


def test_the_dataloader_resumes_where_its_state_was_taken():
    loader = _loader(0)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    want = next(batches)[1]
    resumed = _loader(0)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))[1], want)


LOG = """\
[titan] 2026-12-07 12:00:00,000 - root - INFO - [Override] fused_swiglu.torchtitan.fused_feed_forward: \
model_spec.model.layers.0.feed_forward FeedForward.Config -> FusedFeedForward.Config
[titan] 2026-12-07 12:00:00,000 - root - INFO - [Override] fused_swiglu.torchtitan.fused_feed_forward: \
model_spec.model.layers.1.feed_forward FeedForward.Config -> FusedFeedForward.Config
[titan] - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.00000  \x1b[33mgrad_norm:  5.0000  \
\x1b[36mmemory: 40.00GiB(50.00%)  \x1b[34mtps: 100  \x1b[36mtflops: 1.00  \x1b[35mmfu: 0.10%\x1b[39m
[titan] - root - INFO - step: 10  loss:  8.00000  grad_norm:  2.0000  memory: 41.50GiB(52.00%)  tps: 5,000  \
tflops: 300.00  mfu: 30.00%
[titan] - root - INFO - step: 20  loss:  6.50000  grad_norm:  1.0000  memory: 41.00GiB(51.00%)  tps: 5,400  \
tflops: 320.00  mfu: N/A
[titan] - root - INFO - step: 30  loss:  6.00000  grad_norm:  0.9000  memory: 41.25GiB(51.50%)  tps: 5,200  \
tflops: 310.00  mfu: N/A
"""


def test_torchtitans_log_is_read_and_summarized():
    parsed = titan.parse_log(LOG)
    assert parsed["replaced"] == 2
    assert [s["step"] for s in parsed["steps"]] == [1, 10, 20, 30]
    assert parsed["steps"][0] == {"step": 1, "loss": 12.0, "grad_norm": 5.0, "memory_gib": 40.0, "tps": 100}
    summary = titan.summarize(parsed["steps"], skip=10)  # the windows of steps 20 and 30
    assert summary == {"tps": 5300, "memory_gib": 41.25, "final_loss": 6.0}
    with pytest.raises(ValueError, match="no logged step past"):
        titan.summarize(parsed["steps"], skip=30)


def test_the_report_compares_each_variant_with_stock():
    stock = titan.parse_log(LOG)
    faster = titan.parse_log(LOG.replace("tps: 5,400", "tps: 6,000").replace("tps: 5,200", "tps: 5,800"))
    rows = titan.report({"stock": [stock, stock], "fused": [faster, stock]}, skip=10)
    by_name = {r["variant"]: r for r in rows}
    assert by_name["stock"]["vs stock"] == 1.0 and by_name["stock"]["spread"] == 0.0
    assert by_name["fused"]["tokens/s"] == (5900 + 5300) / 2
    assert by_name["fused"]["vs stock"] == pytest.approx(5600 / 5300)
    table = titan.markdown(rows)
    assert table.count("\n") == 4 and "| fused | 5,600 | 1.057 |" in table


def test_each_variant_names_its_overrides_on_torchtitans_command_line():
    stock = titan.command("qwen3_moe_debug", "stock", 20, 5, "/tmp/x", [])
    assert "--override.imports" not in stock and stock[stock.index("--config") + 1] == "qwen3_moe_debug"
    fused = titan.command(
        "qwen3_moe_debug", "fused-recompute", 20, 5, "/tmp/x", ["activation_checkpoint:none"]
    )
    imports = fused[fused.index("--override.imports") + 1 : -1]
    assert imports == [
        'fused_swiglu.torchtitan.fused_feed_forward={"save": "recompute"}',
        'fused_swiglu.torchtitan.fused_grouped_experts={"save": "recompute"}',
    ]
    assert fused[-1] == "activation_checkpoint:none"
