import pytest

from moetune.workers.engine.schedule import lr_factor, total_steps


def test_total_steps_from_epochs_or_max_steps():
    assert total_steps(100, 8, max_steps=None, n_epochs=3) == 13 * 3
    assert total_steps(100, 8, max_steps=7, n_epochs=None) == 7


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_then_decay(kind):
    total, warmup_ratio = 100, 0.1
    factors = [lr_factor(s, total, warmup_ratio, kind) for s in range(total)]
    warmup = factors[:10]
    assert 0 < warmup[0] and warmup == sorted(warmup) and warmup[-1] < 1
    assert factors[10] == 1.0
    if kind == "constant":
        assert set(factors[10:]) == {1.0}
    else:
        rest = factors[10:]
        assert rest == sorted(rest, reverse=True) and rest[-1] < 0.05
    if kind == "cosine":  # cosine stays high longer than linear
        assert factors[30] > lr_factor(30, total, warmup_ratio, "linear")


def test_no_warmup_starts_at_peak():
    assert lr_factor(0, 10, 0.0, "cosine") == 1.0
