#!/usr/bin/env python3
"""Fits the int8 codebooks of the non-uniform KV formats q4nl / q3nl / q2nl (src/quant/kv_formats.cpp,
include/kvq/quant.h): Lloyd-Max levels (Lloyd 1982; Max 1960) for groups of G = 32 i.i.d. standard
Gaussian values, the distribution a random rotation gives each coordinate of a row (TurboQuant,
Zandieh et al. 2025, arXiv:2504.19874, Sec. 3.1), each group coded the way kvq's quantizer codes it:
start scale extreme / levels[0] (the element of largest magnitude on the negative end), nearest
levels, then two least-squares refits of the scale kept when the squared error drops. Lloyd's
iteration alternates that coding with centroid updates of the levels (in units of each group's
scale), normalised to levels[0] = -1, then x 127 rounded.

    python3 scripts/fit_kv_levels.py     # prints the three tables and their MSE (numpy)

Output at the commit that added it (seed 1): q2 [-127, -47, 17, 85], q3 [-127, -86, -53, -23, 4, 33,
64, 102], q4 [-127, -106, -88, -71, -55, -41, -27, -13, 0, 14, 28, 43, 58, 75, 93, 115]; MSE per
unit variance 0.105 / 0.025 / 0.0061 against the uniform signed formats' 0.268 / 0.034 / 0.0075.
"""
import numpy as np

G = 32


def code(x, lv, refits=2):
    """kvq's coding of groups x [n, G] with levels lv (ascending): (values, codes, scales)."""
    a = np.abs(x).max(1)
    sgn = np.sign(x[np.arange(len(x)), np.abs(x).argmax(1)])
    s = (a / (-lv[0]) * (-sgn))[:, None]
    mid = (lv[1:] + lv[:-1]) / 2
    c = np.searchsorted(mid, x / s)
    best_e, best_c, best_s = ((lv[c] * s - x) ** 2).sum(1), c, s
    for _ in range(refits):
        q = lv[best_c]
        s = ((x * q).sum(1) / np.maximum((q * q).sum(1), 1e-30))[:, None]
        c = np.searchsorted(mid, x / s)
        e = ((lv[c] * s - x) ** 2).sum(1)
        m = e < best_e
        best_e = np.where(m, e, best_e)
        best_c = np.where(m[:, None], c, best_c)
        best_s = np.where(m[:, None], s, best_s)
    return lv[best_c] * best_s, best_c, best_s


def uniform_mse(x, bits):
    qneg, qpos = 2 ** (bits - 1), 2 ** (bits - 1) - 1
    mn, mx = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    neg = -mn >= mx
    ext, oth = np.where(neg, -mn, mx), np.where(neg, mx, -mn)
    s = np.maximum(ext / qneg, oth / qpos)
    s = np.where(neg, s, -s)[:, None]
    return ((np.clip(np.rint(x / s), -qneg, qpos) * s - x) ** 2).mean() / (x ** 2).mean()


def main():
    rng = np.random.default_rng(1)
    for bits in (2, 3, 4):
        x = rng.standard_normal((60000, G))
        n = 2 ** bits
        lv = np.linspace(-1, 1 - 2 / n, n)
        for _ in range(40):
            _, c, s = code(x, lv)
            z = x / s
            lv = np.array([z[c == k].mean() for k in range(n)])
            lv = lv / (-lv[0])
        lv8 = np.rint(lv * 127).astype(int)
        xt = rng.standard_normal((60000, G))
        e = ((code(xt, lv8.astype(float))[0] - xt) ** 2).mean() / (xt ** 2).mean()
        rng.laplace(size=(60000, G))  # drawn (for a heavier-tailed check) by the fit that made the tables
        print("q%dnl" % bits, list(map(int, lv8)), "mse %.4f (uniform q%d %.4f)" % (e, bits, uniform_mse(xt, bits)))


if __name__ == "__main__":
    main()
