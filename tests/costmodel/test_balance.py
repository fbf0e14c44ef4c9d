"""`parallel.layer_split: auto`: the split that minimises the slowest stage, on costs where
the answer can be worked out by hand, and on the simulator, whose stages end up busier
alike than with the even split. No torch."""
from __future__ import annotations

import pytest

from pp_runtime.config import Config, ConfigError, even_split, load_config
from pp_runtime.costmodel import balance
from pp_runtime.costmodel.balance import balanced_split, typical_microbatches


@pytest.mark.parametrize("layers, extra, split", [
    (12, [0.0, 2.0], [7, 5]),  # LM head = 2 layers: 7 | 5 + 2
    (12, [1.0, 0.0, 0.0, 3.0], [3, 4, 4, 1]),  # 16 layer-times over 4 stages: 4 each
    (12, [0.0, 20.0], [11, 1]),  # a head heavier than the model: every stage keeps a layer
    (12, [5.0], [12]),  # pp = 1
    (96, [0.5, 0, 0, 0, 0, 0, 0, 3.0], [12, 13, 13, 13, 12, 12, 12, 9]),  # slowest 13
])
def test_balanced_split_minimises_the_slowest_stage_by_hand(layers, extra, split):
    assert balanced_split(layers, 1.0, extra) == split


def test_with_no_extras_the_balanced_split_is_the_even_split():
    """Ties (13 layers on 2 stages) go to earlier stages, as the even split does."""
    for n in range(1, 30):
        for pp in range(1, min(n, 16) + 1):
            assert balanced_split(n, 0.37, [0.0] * pp) == even_split(n, pp), (n, pp)


def test_100_layers_on_16_stages_is_quick():
    """This process's CPU time (not the wall clock, which other processes stretch): the
    dynamic programme is ~16 x 100^2 steps, a few tens of ms."""
    import time

    t0 = time.process_time()
    split = balanced_split(100, 0.3, [0.1] + [0.0] * 14 + [0.9])
    assert time.process_time() - t0 < 1.0
    assert sum(split) == 100 and min(split) >= 1 and split[-1] == 3  # 3 * 0.3 + 0.9 = 1.8


class MadeUpCost:
    """One layer costs 1 s, the embedding nothing, final norm + LM head 2 s, whatever the
    micro-batch."""

    def attention_half(self, prefills, decode_kv_lens):
        return 0.5  # half the layer: whole layers balance these stages as well as halves

    def parts(self, prefills, decode_kv_lens):
        return 1.0, 0.0, 2.0


def test_auto_on_a_made_up_cost_model_is_worked_out_by_hand(monkeypatch):
    """12 layers, pp = 2, an LM head costing 2 layers: stage times 7 | 5 + 2."""
    from pp_runtime.costmodel import model

    built = []
    monkeypatch.setattr(balance, "_CHOSEN", {})
    monkeypatch.setattr(model, "build_cost_model", lambda cfg: built.append(cfg) or MadeUpCost())
    cfg = balance.resolve_layer_split(Config().with_overrides(num_layers=12, pp=2,
                                                              layer_split="auto"))
    assert cfg.parallel.layer_split == [7, 5] and cfg.layers_per_stage() == [7, 5]
    assert [cfg.stage_layers(s) for s in (0, 1)] == [(0, 7), (7, 12)]
    assert len(built) == 1 and built[0].parallel.layer_split == "even"  # priced on an even cut
    # pp = 3: slowest 5 at best (14 layer-times); [5, 5, 2], [5, 4, 3], [4, 5, 3] tie on
    # every measure, and earlier stages keep more
    three = Config().with_overrides(num_layers=12, pp=3, layer_split="auto")
    assert balance.resolve_layer_split(three).layers_per_stage() == [5, 5, 2]


def test_an_auto_split_not_chosen_is_refused_and_chosen_once_at_the_boundary(monkeypatch):
    """Config does not price: it refuses to cut an auto split nobody chose. The boundary
    (`resolve_layer_split`: LLM, simulate, a torchrun rank, the plan, the calibrator)
    chooses it once; a split given as a list or "even" passes through as it is."""
    from pp_runtime.costmodel import model

    monkeypatch.setattr(balance, "_CHOSEN", {})
    monkeypatch.setattr(model, "build_cost_model", lambda cfg: MadeUpCost())
    cfg = Config().with_overrides(num_layers=12, pp=2, layer_split="auto")
    with pytest.raises(ConfigError, match="parallel.layer_split: auto is not chosen yet"):
        cfg.layers_per_stage()
    with pytest.raises(ConfigError, match="auto is not chosen yet"):
        cfg.with_layer_split_resolved()
    for given in ("even", [5, 7]):
        same = cfg.with_overrides(layer_split=given)
        assert balance.resolve_layer_split(same) is same


def test_the_mix_is_one_full_microbatch_plus_the_decodes_left_over_per_chunk():
    """GPT-2 workload, C = 256, B = 8, P:D = 10: a chunk of 249 brings 24.9 decodes; 7 ride
    along with it, the other 17.9 fill 2.24 decode-only micro-batches of 8."""
    cfg = load_config("cpu/gpt2_pp2")
    (w1, pre1, dec1), (w2, pre2, dec2) = typical_microbatches(cfg)
    assert (w1, pre1, dec1) == (1.0, [(0, 249)], [512] * 7)
    assert w2 == pytest.approx((249 / 10 - 7) / 8) and (pre2, dec2) == ([], [512] * 8)
    short = cfg.with_overrides(pd_ratio=50.0)  # 5 decodes per chunk: all ride along
    assert len(typical_microbatches(short)) == 1


def test_simulated_stages_are_busy_alike_with_auto():
    """GPT-2-small on two stages (priced for an A100: the config's own CPU profile unset):
    with the even split the last stage (LM head) is far busier than the first; with auto
    the two stages' busy times over the whole simulated run are close."""
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import build_report

    def busy_ratio(split):  # sarathi: the C + (B - 1) mix that `typical_microbatches` prices
        #                       (uniform's own order moves with its rules: 1.075 since 166d37c)
        cfg = load_config("cpu/gpt2_pp2", layer_split=split, planner="sarathi",
                          **{"workload.num_requests": 32, "hardware.profile": None})
        busy = [st["busy_s"] for st in build_report(simulate(cfg, progress=False))
                ["summary"]["per_stage"]]
        return max(busy) / min(busy), balance.resolve_layer_split(cfg).layers_per_stage()

    (even, even_cut), (auto, auto_cut) = busy_ratio(None), busy_ratio("auto")
    assert even_cut == [6, 6] and auto_cut == [8, 4]
    assert even > 1.5 and auto < 1.05  # measured: 1.682 and 1.012


def test_a_half_layer_cut_where_whole_layers_cannot_balance_by_hand():
    """Two layers, attention halves 1 s, MLP halves 2 s, the last stage's head 3 s: whole
    layers give [1, 1] (3 s | 6 s); cutting layer 1 after its attention gives [1.5, 0.5]
    (4 s | 5 s). With nothing to balance the whole-layer split stays."""
    from pp_runtime.costmodel.balance import balanced_half_split, balanced_units

    assert balanced_units([1.0, 2.0, 1.0, 2.0], [0.0, 3.0]) == [3, 1]
    assert balanced_half_split(2, 1.0, 2.0, [0.0, 3.0]) == [1.5, 0.5]
    assert balanced_half_split(2, 1.0, 1.0, [0.0, 0.0]) == [1, 1]
    assert balanced_half_split(4, 1.0, 1.0, [0.0, 2.0]) == [2.5, 1.5]  # 6 | 4 whole; 5 | 5
    assert balanced_half_split(4, 1.0, 1.0, [0.0, 4.0]) == [3, 1]  # whole layers balance: 6 | 6


def test_the_cost_model_prices_each_half_on_its_own_stage():
    """A cut moved by half a layer moves one half's time from one stage to the other; the
    stages' sum is the whole-layer split's."""
    from pp_runtime.costmodel.model import build_cost_model

    mb = ([(0, 128)], [300] * 20)
    a100 = {"hardware.profile": None}  # the config's CPU profile scales each stage on its own
    whole = build_cost_model(load_config("cpu/gpt2_pp2", layer_split=[6, 6], **a100))
    whole = whole.stage_times(*mb)
    cut_cost = build_cost_model(load_config("cpu/gpt2_pp2", layer_split=[6.5, 5.5], **a100))
    cut = cut_cost.stage_times(*mb)
    attn = cut_cost.attention_half(*mb)
    assert cut == pytest.approx([whole[0] + attn, whole[1] - attn])
    per_layer = cut_cost.parts(*mb)[0]
    assert 0.2 < attn / per_layer < 0.5  # QKV + out: 4 h^2 of GPT-2's 12 h^2, plus attention


@pytest.mark.parametrize("name", ["cpu/gpt2_pp2", "cpu/llama_pp2"])
def test_the_cpu_configs_carry_a_profile_of_their_model_and_auto_cuts_on_it(name):
    """The real CPU pipelines are priced on a CPU (`configs/cpu/profiles/`), not on the A100
    tables: the profile is of the config's model, prices every stage, holds the Ray
    executor's calibration at pp = 2, and `auto` (the unset split) cuts on it. GPT-2's LM
    head (50257 x 768) weighs on the last stage, which gets fewer layers."""
    import json
    from pathlib import Path

    from pp_runtime.config import CONFIG_DIR
    from pp_runtime.costmodel.model import build_cost_model, find_calibration

    cfg = load_config(name)
    prof = Path(cfg.hardware.profile)
    assert prof.parent == (CONFIG_DIR / "cpu" / "profiles").resolve()
    assert json.loads((prof / "device.json").read_text())["model"] == cfg.model.name
    assert find_calibration(cfg) is not None
    split = balance.resolve_layer_split(cfg).parallel.layer_split
    assert sum(split) == cfg.model.num_layers
    assert all(t > 0 for t in build_cost_model(balance.resolve_layer_split(cfg)).stage_times(
        [(0, 128)], [512] * 4))
    if name == "cpu/gpt2_pp2":
        assert split[1] < split[0], split
