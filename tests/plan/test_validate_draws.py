"""`plan --validate`'s verdicts on one measurement against the prediction's draws
(plan/validate.py: a capacity measured on one draw of requests is a sample), by hand."""
from pp_runtime.plan.validate import ranking, within


def test_a_measurement_is_judged_against_the_range_of_the_draws():
    draws = [0.9, 1.0, 1.2]
    assert within(draws, 0.9) == "within the draws"
    assert within(draws, 1.2) == "within the draws"
    assert within(draws, 0.89) == "below the draws"
    assert within(draws, 1.21) == "above the draws"


def test_the_ranking_is_settled_only_where_the_draws_do_not_overlap():
    line = ranking(([1.0, 1.2], 0.6), ([0.9, 1.1], 1.2))
    # measured 0.6 / 1.2; predicted mean 1.1 / 1.0; the ratio the draws allow: 1.0/1.1 .. 1.2/0.9
    assert line.startswith("the plan's choice / the reference, measured: 0.50x, predicted 1.10x;")
    assert "the draws overlap (ratio 0.91-1.33): one measurement cannot rank them" in line
    assert ranking(([1.5, 1.6], 1.5), ([1.0, 1.2], 1.1)).endswith("the draws settle the ranking")
    assert ranking(([0.5, 0.6], 0.5), ([1.0, 1.2], 1.1)).endswith("the draws settle the ranking")
