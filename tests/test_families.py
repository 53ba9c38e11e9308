"""The swap across every causal-LM family of the installed transformers (``fused_swiglu.families``): each
tiny model is built, every MLP class in it is swapped with the forward check, and whatever the swap
takes by structure alone (weights on the meta device, nothing to compare) computes the same function."""

import pytest

pytest.importorskip("transformers")

from fused_swiglu.families import family_rows, markdown  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {row["family"]: row for row in family_rows()}


def test_what_the_swap_takes_unchecked_computes_the_same_function(rows):
    """A class the swap would take on the meta device must pass the forward check when materialised."""
    unsafe = {
        family: [name for name in row["unchecked"] if row["mlps"][name] != "fused"]
        for family, row in rows.items()
        if row["built"]
    }
    assert {family: names for family, names in unsafe.items() if names} == {}


@pytest.mark.parametrize(
    "family, mlp",
    [
        ("llama", "LlamaMLP"),
        ("mistral", "MistralMLP"),
        ("qwen3", "Qwen3MLP"),
        ("falcon_h1", "FalconH1MLP"),
        ("phi3", "Phi3MLP"),
        ("glm4", "Glm4MLP"),
        ("olmo2", "Olmo2MLP"),
    ],
)
def test_dense_swiglu_families_are_fused(rows, family, mlp):
    row = rows[family]
    assert row["built"] and row["swapped"] >= 2 and row["mlps"][mlp] == "fused"


@pytest.mark.parametrize(
    "family, experts",
    [
        ("mixtral", "MixtralExperts"),
        ("qwen2_moe", "Qwen2MoeExperts"),
        ("qwen3_moe", "Qwen3MoeExperts"),
        ("deepseek_v3", "DeepseekV3Experts"),
        ("olmoe", "OlmoeExperts"),
        ("glm4_moe", "Glm4MoeExperts"),
    ],
)
def test_routed_experts_of_the_standard_layout_are_fused(rows, family, experts):
    assert rows[family]["mlps"][experts] == "fused"


def test_experts_with_a_gate_of_their_own_are_left_alone(rows):
    assert "_apply_gate" in rows["deepseek_v4"]["mlps"]["DeepseekV4Experts"]
    assert "router_indices" in rows["gpt_oss"]["mlps"]["GptOssExperts"]


@pytest.mark.parametrize(
    "family, mlp, why",
    [
        ("gemma", "GemmaMLP", "GELUTanh"),
        ("bitnet", "BitNetMLP", "ReLUSquared"),
        ("seed_oss", "SeedOssMLP", "dropout"),
        ("recurrent_gemma", "RecurrentGemmaMlp", "bias"),
    ],
)
def test_other_mlps_are_left_alone_with_the_reason(rows, family, mlp, why):
    row = rows[family]
    assert row["swapped"] == 0 and why in row["mlps"][mlp]


def test_the_table_lists_every_family(rows):
    table = markdown(list(rows.values()))
    assert all(f"| {family} |" in table for family in rows)


def test_the_summary_groups_families_by_outcome(rows):
    from fused_swiglu.families import summary

    lines = {line.split(" (")[0].strip("| "): line for line in summary(list(rows.values())).splitlines()[2:]}
    assert "mixtral" in lines["routed experts fused"] and "llama" in lines["MLPs fused"]
    assert "gemma (the activation is GELUTanh)" in lines["left alone"]
    assert "deepseek_v4 (DeepseekV4Experts" in lines["partly fused"]
