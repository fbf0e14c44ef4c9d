"""benchmarks/steady_state.py's pipelines: each mix's config with the layer split chosen for
that mix where the config leaves it to `auto` (a profile and no split), explicit so the
planner and the workers read one cut; a given split is kept. No Ray: the configs only."""
from benchmarks_loader import load_benchmark

steady = load_benchmark("steady_state")


def test_each_mix_gets_its_own_cut_and_a_given_split_stays():
    from pp_runtime.config import load_config

    cfg = load_config("cpu/gpt2_pp2")  # its CPU profile, no split: auto
    cuts = {mix: steady.mix_config(cfg, spec) for mix, spec in steady.MIXES.items()}
    for mix, (pd, lo, hi) in steady.MIXES.items():
        w = cuts[mix].workload
        assert (w.pd_ratio, w.min_len, w.max_len) == (pd, lo, hi)
        assert isinstance(cuts[mix].parallel.layer_split, list)  # explicit: one cut for all
    # decodes load the LM head's stage: the decode-heavy mix moves more off it
    last = {mix: c.parallel.layer_split[1] for mix, c in cuts.items()}
    assert last["decode-heavy"] < last["prefill-heavy"], last
    given = cfg.with_overrides(layer_split=[6, 6])
    assert all(steady.mix_config(given, spec).parallel.layer_split == [6, 6]
               for spec in steady.MIXES.values())
