"""The token-balanced assignment over data-parallel replicas (engines/batch/dp_balance.py) on the
host; the exchange and order restore over ranks: tests/distributed/test_dp_balance_ranks.py."""
import pytest

from polyfsdp.engines.config import ConfigFieldError, EngineConfig
from polyfsdp.engines.batch.dp_balance import balance_plan, sequence_weights, token_imbalance


def test_token_imbalance_is_max_over_mean():
    assert token_imbalance([30, 10]) == pytest.approx(1.5)
    assert token_imbalance([5, 5, 5]) == 1.0
    assert token_imbalance([0, 0]) == 1.0


def test_plan_places_every_sequence_once_and_balances_a_skewed_batch():
    lengths = [[40, 33, 20, 18, 9], [2, 3], [1], [5, 4, 4]]
    plan = balance_plan(lengths)
    placed = sorted(item for group in plan for item in group)
    assert placed == sorted((r, i) for r, lens in enumerate(lengths) for i in range(len(lens)))
    loads = [sum(lengths[r][i] for r, i in group) for group in plan]
    before = token_imbalance([sum(lens) for lens in lengths])
    assert before > 3.0 and token_imbalance(loads) < 1.3
    # Longest-first greedy: no replica's load exceeds the ideal by more than the longest item it got last.
    assert max(loads) <= sum(loads) / len(loads) + max(max(lens) for lens in lengths)


def test_balance_flag_must_be_a_bool():
    with pytest.raises(ConfigFieldError, match="EngineConfig.balance_dp_tokens"):
        EngineConfig(balance_dp_tokens="yes")


def test_text_only_sequences_weigh_their_tokens_exactly():
    lengths = [[40, 33], [2, 3]]
    assert sequence_weights(lengths) is lengths
    assert sequence_weights(lengths, [[0, 0], [0, 0]], 0.1) is lengths  # a VLM batch of text rows
    assert sequence_weights(lengths, [[0, 64], [0, 0]], 0.0) is lengths  # a tower that costs nothing
    assert balance_plan(lengths, [[0, 0], [0, 0]], 0.1) == balance_plan(lengths)


def test_image_heavy_sequences_are_spread_over_the_replicas():
    """Replica 0 brings a 100-token text row and a 55-token row of 880 image patches, replica 1
    another such image row. By tokens both image rows land together (55 + 55 against 100); at
    0.1 tokens a patch (about Qwen2-VL-7B's 0.098) they weigh 143 each and are split."""
    lengths, patches = [[100, 55], [55]], [[0, 880], [880]]
    by_tokens = balance_plan(lengths)
    weighed = balance_plan(lengths, patches, 0.1)
    image_rows = {(0, 1), (1, 0)}

    def holders(plan):
        return [g for g, group in enumerate(plan) if image_rows & set(group)]

    assert len(holders(by_tokens)) == 1 and len(holders(weighed)) == 2
    weights = sequence_weights(lengths, patches, 0.1)
    loads = [[sum(weights[r][i] for r, i in group) for group in plan] for plan in (by_tokens, weighed)]
    assert token_imbalance(loads[1]) < token_imbalance(loads[0])


def test_patch_cost_is_the_towers_work_per_patch_in_decoder_tokens():
    import torch

    from polyfsdp.engines.model.builder import auto_class_for
    from polyfsdp.engines.model.vision import freeze_vision, patch_cost
    from polyfsdp.engines.presets import preset_config

    def meta(preset):
        config = preset_config(preset)
        with torch.device("meta"):
            return auto_class_for(config).from_config(config)

    model = meta("qwen2-vl-tiny")
    # Per patch: the 1176 x 32 patch convolution, two blocks' qkv, proj, fc1, fc2 (32 wide, MLP 64),
    # the merger's two 128 x 128 / 128 x 32 linears over 4 patches; per token two decoder layers.
    block = 32 * 96 + 32 * 32 + 2 * 32 * 64
    layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    expected = (1176 * 32 + 2 * block + (128 * 128 + 128 * 32) / 4) / (2 * layer)
    assert patch_cost(model) == pytest.approx(expected)
    freeze_vision(model)
    assert patch_cost(model) == pytest.approx(expected / 3)
    assert patch_cost(meta("qwen2-tiny")) == 0.0


def test_patches_per_sequence_sum_its_images_rows():
    import torch

    from polyfsdp.engines.batch.images import ImageInputs

    images = ImageInputs(torch.zeros(40, 1), torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4]]), [2, 0, 1], [16, 8, 16])
    assert images.patches_per_seq() == [24, 0, 16]
    assert images.select([2, 1]).patches_per_seq() == [16, 0]
