"""YaRN rope scaling (hpengine/nn/rope.py) against values worked out here from the YaRN paper (Peng et al. 2023,
Eq. 21 for the temperature; pairs turning more than beta_fast times over the original context kept, fewer than
beta_slow times interpolated) and Hugging Face's _compute_yarn_parameters (a ramp over the pair index between the
floor and ceiling of the correction dimensions), for DeepSeek-V3's settings.
"""
import math

import numpy as np
import pytest

from hpengine.nn.mla import MLADims
from hpengine.nn.rope import YaRN, rope_tables, yarn_get_mscale

# DeepSeek-V3: rotary width 64, theta 10000, factor 40 over 4096 original positions, beta 32 / 1, mscale 1 / 1
DR, THETA, FACTOR, ORIG = 64, 10000.0, 40.0, 4096
V3 = YaRN(factor=FACTOR, original_max_position_embeddings=ORIG, beta_fast=32, beta_slow=1, mscale=1.0,
          mscale_all_dim=1.0)


def test_correction_range_by_hand():
    """The correction dimension d(r) = dr ln(L / (2 pi r)) / (2 ln theta): d(32) = 10.47 and d(1) = 22.51 here,
    so the ramp runs from pair 10 (floor) to pair 23 (ceiling)."""
    d = lambda rot: DR * math.log(ORIG / (2 * math.pi * rot)) / (2 * math.log(THETA))
    assert math.floor(d(32)) == 10 and math.ceil(d(1)) == 23
    assert d(32) == pytest.approx(10.4722408, abs=1e-6) and d(1) == pytest.approx(22.5134406, abs=1e-6)


def test_inv_freq_hugging_face_ramp():
    inv = V3.inv_freq(DR, THETA)
    assert inv.shape == (DR // 2,) and inv.dtype == np.float64
    for i in range(DR // 2):
        base = THETA ** (-2 * i / DR)
        ramp = min(max((i - 10) / (23 - 10), 0.0), 1.0)        # 0: keep the frequency, 1: divide it by the factor
        assert inv[i] == pytest.approx(base * (1 - ramp) + base / FACTOR * ramp, rel=1e-14), i


def test_inv_freq_paper_endpoints():
    """Pairs with r = L / wavelength above beta_fast keep theta_i; below beta_slow they become theta_i / s."""
    inv = V3.inv_freq(DR, THETA)
    kept = interp = 0
    for i in range(DR // 2):
        base = THETA ** (-2 * i / DR)
        r = ORIG * base / (2 * math.pi)
        if r > 32:
            assert inv[i] == pytest.approx(base, rel=1e-14)
            kept += 1
        elif r < 1:
            assert inv[i] == pytest.approx(base / FACTOR, rel=1e-14)
            interp += 1
        else:
            assert base / FACTOR < inv[i] <= base
    assert kept == 11 and interp == 9


def test_inv_freq_untruncated_and_degenerate():
    """truncate=False ramps between the exact correction dimensions; equal bounds get HF's 0.001 width."""
    y = YaRN(factor=4.0, original_max_position_embeddings=ORIG, truncate=False)
    lo, hi = 10.472240810318025, 22.513440636877274
    inv = y.inv_freq(DR, THETA)
    for i in (10, 11, 16, 22, 23):
        base = THETA ** (-2 * i / DR)
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        assert inv[i] == pytest.approx(base * (1 - ramp) + base / 4.0 * ramp, rel=1e-14)
    # beta_fast = beta_slow, untruncated: one correction dimension d(8) = 15.29: pair 15 kept, 16 divided
    inv = YaRN(factor=4.0, original_max_position_embeddings=ORIG, beta_fast=8, beta_slow=8,
               truncate=False).inv_freq(DR, THETA)
    assert np.isfinite(inv).all()
    assert inv[15] == pytest.approx(THETA ** (-30 / DR), rel=1e-14)
    assert inv[16] == pytest.approx(THETA ** (-32 / DR) / 4.0, rel=1e-14)


def test_mscale_and_attention_factor():
    assert yarn_get_mscale(40.0) == pytest.approx(0.1 * math.log(40.0) + 1, rel=1e-15)
    assert yarn_get_mscale(40.0, 0.707) == pytest.approx(0.0707 * math.log(40.0) + 1, rel=1e-15)
    assert yarn_get_mscale(1.0, 5.0) == 1.0 and yarn_get_mscale(0.5) == 1.0
    assert V3.attention_factor() == 1.0                          # mscale = mscale_all_dim: the ratio is 1
    assert YaRN(40.0, ORIG).attention_factor() == pytest.approx(0.1 * math.log(40.0) + 1, rel=1e-15)
    assert YaRN(40.0, ORIG, mscale=0.707).attention_factor() == pytest.approx(0.1 * math.log(40.0) + 1)
    ratio = (0.1 * math.log(40.0) + 1) / (0.0707 * math.log(40.0) + 1)
    assert YaRN(40.0, ORIG, mscale=1.0, mscale_all_dim=0.707).attention_factor() == pytest.approx(ratio, rel=1e-15)


def test_softmax_scale():
    """DeepSeek's softmax scale: (qk_nope + qk_rope)^-1/2 times mscale(factor, mscale_all_dim)^2."""
    m = 0.1 * math.log(40.0) + 1
    assert V3.softmax_mscale() == pytest.approx(m * m, rel=1e-15)
    assert YaRN(40.0, ORIG, mscale=1.0).softmax_mscale() == 1.0           # mscale_all_dim unset
    d = MLADims(n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, mscale=V3.softmax_mscale())
    assert d.scale == pytest.approx(m * m / math.sqrt(192), rel=1e-15)
    assert MLADims(2, 0, 4, 3, 4, 2).scale == pytest.approx(1 / math.sqrt(7), rel=1e-15)


def test_rope_tables_with_yarn():
    y = YaRN(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2)
    T, hd, theta = 9, 8, 500.0
    cos, sin = rope_tables(np, T, hd, theta, np.float64, scale=0.5, yarn=y)
    af = 0.1 * math.log(8.0) + 1                                # attention factor with mscale unset
    inv = y.inv_freq(hd, theta)
    for t in range(T):
        for i in range(hd // 2):
            assert cos[t, i] == pytest.approx(0.5 * af * math.cos(t * inv[i]), rel=1e-14, abs=1e-15)
            assert sin[t, i] == pytest.approx(0.5 * af * math.sin(t * inv[i]), rel=1e-14, abs=1e-15)
    c0, s0 = rope_tables(np, T, hd, theta, np.float64)
    assert not np.allclose(c0, cos / (0.5 * af))            # yarn changed the frequencies
