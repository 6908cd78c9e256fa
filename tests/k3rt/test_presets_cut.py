"""k3rt.presets.cut_layers (benchmarks/decode.py --layers): the 48B preset's first n layers, its KDA and MLA layer
lists cut with it, parsed into a config whose layer kinds follow them."""
from __future__ import annotations

import pytest

from k3rt.model_config import parse_model_config
from k3rt.presets import KIMI_LINEAR_48B, cut_layers


def test_the_48b_cut_to_12_layers_keeps_its_kda_mla_pattern() -> None:
    raw = cut_layers(KIMI_LINEAR_48B, 12)
    lac = raw["linear_attn_config"]
    assert raw["num_hidden_layers"] == 12
    assert lac["kda_layers"] == [1, 2, 3, 5, 6, 7, 9, 10, 11] and lac["full_attn_layers"] == [4, 8, 12]
    assert KIMI_LINEAR_48B["num_hidden_layers"] == 27  # the preset itself untouched
    assert len(KIMI_LINEAR_48B["linear_attn_config"]["kda_layers"]) == 20
    cfg = parse_model_config(raw)
    assert cfg.num_hidden_layers == 12


@pytest.mark.parametrize("n", [0, 28])
def test_out_of_range_is_refused(n: int) -> None:
    with pytest.raises(ValueError, match="layers: 1 to 27"):
        cut_layers(KIMI_LINEAR_48B, n)
