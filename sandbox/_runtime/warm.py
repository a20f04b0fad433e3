"""Making the zygote cheap to fork from: warm-up code and huge pages.

Warm-up runs representative numpy/sympy work (``LIGHT_WARMUP``: only the standard library, for
the light template) once in the zygote, so lazily imported modules
and first-use initialisation are done before any child exists (each child would otherwise
redo them). The heap is then moved onto transparent huge pages, so that fork copies 2 MiB
page-table entries instead of 4 KiB ones for as long as the zygote leaves those pages alone.
"""

from __future__ import annotations

import ctypes

_libc = ctypes.CDLL(None, use_errno=True)

WARMUP = r"""
import numpy as np, sympy as sp, fractions, decimal, itertools, math, statistics, re, json, ast
ast.parse("x = [i ** 2 for i in range(3)]\nx[-1]")  # children parse to AST: init its state here
x, y, n = sp.symbols('x y n')
_ = [sp.factor(x**6 - y**6), sp.expand((x + 2)**7), sp.solve(x**2 - 3*x + 1, x),
     sp.simplify(sp.sin(x)**2 + sp.cos(x)**2), sp.Rational(2, 7) + sp.Rational(1, 9),
     sp.sqrt(12), sp.integrate(x**3 * sp.exp(x), x), sp.diff(sp.tan(x), x), sp.nsimplify(0.25),
     sp.Matrix([[2, 1], [1, 3]]).inv(), sp.isprime(101), sp.binomial(12, 5), sp.latex(x**3),
     sp.N(sp.pi, 20), sp.summation(n**2, (n, 1, 10)), sp.limit(sp.sin(x) / x, x, 0),
     sp.gcd(12, 18), sp.factorint(360), sp.nroots(x**3 - 2), sp.Poly(x**3 + 1, x).all_coeffs(),
     sp.series(sp.exp(x), x, 0, 4), sp.solveset(x**2 - 4, x, sp.S.Reals), sp.Eq(x, 2),
     sp.log(8, 2), sp.floor(sp.Rational(7, 2)), sp.Mod(17, 5), sp.divisors(28)]
print(*_)
a = np.arange(12, dtype=float).reshape(3, 4)
print(a, a.T @ a, np.linalg.det(np.eye(4) * 3), np.linalg.solve(np.eye(2), [1, 2]),
      np.linalg.eig(np.eye(2)), np.random.default_rng(1).random(2), np.mean(a), np.sort(a[0]),
      np.linalg.inv(np.eye(2) * 2), np.polyfit([0, 1, 2], [1, 3, 5], 1), np.cumsum([1, 2]))
print(fractions.Fraction(3, 8), decimal.Decimal(2).sqrt(), math.comb(9, 4),
      statistics.median([1, 5, 2]), list(itertools.permutations(range(3)))[:2],
      re.findall(r"\d+", "a1b22"), json.dumps({"k": [1]}), f"{math.pi:.5f}", 10**30 // 7)
"""

LIGHT_WARMUP = r"""
import fractions, itertools, math, re, random, ast
ast.parse("x = [i ** 2 for i in range(3)]\nx[-1]")  # children parse to AST: init its state here
compile("x = 1\nprint(x)", "<warmup>", "exec")
print(fractions.Fraction(3, 8), math.comb(9, 4), list(itertools.permutations(range(3)))[:2],
      re.findall(r"\d+", "a1b22"), f"{math.pi:.5f}", 10**30 // 7, random.random())
"""


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def collapse_huge_pages() -> int:
    """madvise(HUGEPAGE) + madvise(COLLAPSE) every private anonymous region >= 2 MiB.

    Returns the AnonHugePages total (KiB). Best effort: kernels without THP or MADV_COLLAPSE
    (< 6.1) just keep 4 KiB pages.
    """
    huge = 2 << 20
    madvise = _libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as f:
        lines = f.readlines()
    for line in lines:
        parts = line.split()
        if parts[1] != "rw-p" or (len(parts) > 5 and parts[5] != "[heap]"):
            continue
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        lo = (lo + huge - 1) // huge * huge
        hi = hi // huge * huge
        if hi > lo:
            madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE
            madvise(lo, hi - lo, 25)  # MADV_COLLAPSE
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
