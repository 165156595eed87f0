"""benchmarks/random_models.py writes the checkpoints transformers expects: for the MoE config, the
same tensor names and shapes as Qwen3MoeForCausalLM's own (built on the meta device, no memory), and
an active parameter count equal to its dense twin's (benchmarks/moe_decode.py) plus the routers."""

from __future__ import annotations

from benchmarks import moe_decode, random_models

# Qwen3-30B-A3B's keys at a size a test can build: fewer layers, experts and dimensions.
SMALL = {
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


def transformers_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    import torch
    import transformers

    kind = {"qwen3_moe": "Qwen3Moe", "qwen3": "Qwen3"}[config["model_type"]]
    with torch.device("meta"):
        model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**config))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def test_moe_checkpoint_holds_what_transformers_expects():
    config = random_models.CONFIGS[moe_decode.MOE] | SMALL
    assert random_models.tensor_shapes(config) == transformers_shapes(config)


def test_the_dense_twin_reads_what_a_routed_token_reads():
    moe = random_models.CONFIGS[moe_decode.MOE] | SMALL
    dense = moe_decode.dense_twin(moe)
    assert random_models.tensor_shapes(dense) == transformers_shapes(dense)
    routers = (SMALL["num_hidden_layers"] - 1) * SMALL["num_experts"] * SMALL["hidden_size"]
    # The dense layer (mlp_only_layers) is 96 wide in the MoE model and 2 x 32 = 64 in the twin.
    dense_layer_gap = 3 * SMALL["hidden_size"] * (SMALL["intermediate_size"] - 2 * SMALL["moe_intermediate_size"])
    assert random_models.active_parameter_count(moe) == random_models.parameter_count(dense) + routers + dense_layer_gap
    assert random_models.parameter_count(moe) > random_models.active_parameter_count(moe)
