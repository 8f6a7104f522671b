import numpy as np

from specserve.algorithm.rng import Purpose, uniform


def test_same_key_same_number_and_vectorised_equals_scalar():
    a = uniform(42, np.arange(100), Purpose.ACCEPT)
    b = np.array([float(uniform(42, i, Purpose.ACCEPT)) for i in range(100)])
    assert np.array_equal(a, b)
    assert np.array_equal(a, uniform(42, np.arange(100), Purpose.ACCEPT))


def test_keys_give_independent_streams():
    pos = np.arange(20000)
    streams = [uniform(1, pos, Purpose.ACCEPT), uniform(2, pos, Purpose.ACCEPT),
               uniform(1, pos, Purpose.DRAFT), uniform(1, pos, Purpose.BONUS)]
    for i in range(len(streams)):
        for j in range(i + 1, len(streams)):
            # |corr| of independent uniforms ~ N(0, 1/sqrt(n)) = 0.007; 0.04 is > 5 sigma
            assert abs(np.corrcoef(streams[i], streams[j])[0, 1]) < 0.04


def test_uniform_in_unit_interval_and_flat():
    u = uniform(7, np.arange(200000), Purpose.RECOVER)
    assert u.min() >= 0.0 and u.max() < 1.0
    hist, _ = np.histogram(u, bins=20, range=(0, 1))
    # each bin expects 10000 +- 98 (binomial sd); 600 is > 6 sd
    assert np.abs(hist - 10000).max() < 600


def test_large_seeds_wrap_into_64_bits():
    assert np.array_equal(uniform(2**64 - 1, [3], Purpose.DRAFT), uniform(np.array([2**64 - 1], dtype=np.uint64), [3], Purpose.DRAFT))
