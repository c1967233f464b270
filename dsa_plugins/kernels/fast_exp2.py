"""2^x as one ``ex2.approx.ftz.f32`` (MUFU.EX2), shared by the softmax of the attention kernels.

The attention programs are compiled without fast math (so that divisions, logarithms and the epilogues stay
exact to the reference), and there ``exp2f`` becomes ex2.approx.f32 without ftz: ptxas wraps each MUFU.EX2
in a compare and two FMULs so that a result below 2^-126 comes out denormal instead of 0. A softmax takes
one exponential per score, so those three instructions per score sit on the path between the score MMA and
the P @ V MMA. With ftz the result is the same wherever 2^x >= 2^-126 (P below that is 0, which a bf16 P
would barely hold anyway); NaN stays NaN and -inf gives 0.

``PRELUDE`` is CUDA source for a program's prelude; :func:`ex2_ftz` calls it from TileLang and :func:`exp2`
picks it or TileLang's ``exp2`` by a program's ``fast_exp2`` flag.
"""

PRELUDE = r"""
__device__ __forceinline__ float dsa_ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def ex2_ftz(T, x):
    """TileLang expression 2^x (fp32) through ``dsa_ex2_ftz``; the program's prelude must hold :data:`PRELUDE`."""
    return T.call_extern("float32", "dsa_ex2_ftz", x)


def exp2(T, x, ftz: bool):
    """2^x (fp32): :func:`ex2_ftz` where ``ftz`` (the prelude must hold :data:`PRELUDE`), else ``T.exp2``."""
    return ex2_ftz(T, x) if ftz else T.exp2(x)
