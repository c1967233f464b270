"""A/B of the sparse attention backward against a text-patched copy of its kernel module, in one process.

    python benchmarks/kernels/ab_bwd_patch.py PATCH [--shapes mla_h64,v4_h128_sink] [--det] [--rounds 6]

The patched copy (``source_patch.import_patched``) runs beside the shipped module on the same inputs
(``bench_sparse_attention_bwd.make_inputs``); both are captured in CUDA graphs and timed in interleaved rounds
(``bench.runner.interleaved_graph_ms``). Before timing, dq and dkv of the two are compared bit for bit (the patches
here change how the same values are computed or stored, never the values). ``--det``: the deterministic mode (its
default ``det_mode``), else the atomic default.

Two changes to the deterministic rows with permuted columns (MLA, unpaired V4) were measured with this tool and
are shipped: the exponent bytes in 16-bit stores (1.06x at V4 H64, 1.01x at 576/512) and each lane's 8 values of a
block side by side in one 16-byte store (``contrib_st16``, with the reduce's maps patched alike: 1.057x MLA H64, 1.043x
MLA H128, 1.012x V4 H64); so is the slot sort on int16 keys (``slot_keys_i16``, H100 --det: 1.011x MLA H64, 1.002x
MLA H128, 1.010x V4 H128, 1.022x V4 H64, same bits, 2026-11-28). A patch may edit the contribution reduce too
("reduce": the patched backward then imports the patched reduce). Patches:
  exps_u16_pair  the int16 contribution rows' exponent bytes (``contrib_i16``) of the pair's half tiles (V4 H128)
                 in 16-bit stores: lanes q and q ^ 2 swap one byte and each stores one row's two adjacent bytes.
                 H100, --det: 1.005x (the exchange costs what the second store did); not shipped. It patches the
                 pair's rows in their real column order, which det_pair_perm (the default since 2026-11-27, 1.17x
                 at V4 H128) no longer runs: pass it only with that default turned off, through
                 DSA_PLUGINS_BWD_TUNING='{"det_pair_perm": false}' (else it times two identical programs)
  reduce_v8      the reduce reads permuted int16 rows (the default rows of MLA and unpaired V4) 16 bytes a lane:
                 8 columns, one whole block and its one exponent byte per load, 3 loads a 576-wide row instead of 5;
                 each column is still summed by one warp over its slots in order, so the sums keep their bits.
                 H100, --det, same bits: MLA H64 0.995x [0.991, 1.007], MLA H128 1.013x [1.009, 1.036], V4 H64
                 1.000x [0.995, 1.004]; not shipped (the reduce's loads were not what limits it)
  reduce_no_i2f  the reduce turns each int16 value into fp32 with integer ops and one FADD (its bits with the sign
                 flipped placed in the mantissa of 2^23, then 2^23 + 2^15 subtracted: exact) instead of I2F, which
                 sm_90 issues at a quarter of the FP32 rate. H200, --det, same bits: MLA H64 0.999x [0.968, 1.004],
                 MLA H128 1.026x [1.021, 1.168], V4 H128 0.987x, V4 H64 0.981x; not shipped (2026-11-29)
  rows_reversed  the ws program's CTAs take query rows from the last back, so that causal rows (the last ones the
                 longest) start longest first. H200, atomic (dkv's last bits differ, rel 1e-6): MLA H64 causal
                 1.002x [0.990, 1.090], MLA H128 causal 0.981x, MLA H64 1.007x, V4 H128 0.998x; not shipped
                 (2026-11-29: the row order is not what costs causal rows their TFLOP/s)
The reduce without TileLang's safe-memory legalisation (bounds tests and zero fills around the loads whose row comes
from Rows) was measured with this tool and is shipped: the int16 loop 167 -> 106 instructions a row; H200, --det, same
bits: MLA H64 1.051x, MLA H128 1.092x, V4 H128 1.005x, V4 H64 1.012x (2026-11-29). reduce_v8 on top of it measured
0.96x at MLA H64 and 0.94x at MLA H128 (from the same run: 1.005x and 1.030x against the legalised reduce).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from source_patch import import_patched, replace_exact  # noqa: E402

_OLD_EXPS_AB = """      if (row_a >= 0) exps[(row0 + slot) * (ld / kBlock) + blk] = static_cast<unsigned char>(__float_as_uint(sa.y) >> 23);
      if (row_b >= 0) exps[(row0 + slot + 1) * (ld / kBlock) + blk] = static_cast<unsigned char>(__float_as_uint(sb.y) >> 23);"""
_NEW_EXPS_AB = """      // lanes q and q ^ 2 hold adjacent bytes of rows a and b: one exchange, then each stores one row's pair
      const unsigned ea = __float_as_uint(sa.y) >> 23, eb = __float_as_uint(sb.y) >> 23;
      const bool hi = (q >> 1) != 0;
      const unsigned other = __shfl_xor_sync(0xffffffffu, hi ? ea : eb, 2);
      const unsigned both = hi ? (other | (eb << 8)) : (ea | (other << 8));
      const int row_s = hi ? row_b : row_a;
      if (row_s >= 0)
        *reinterpret_cast<unsigned short*>(exps + (row0 + slot + (hi ? 1 : 0)) * (ld / kBlock) + (blk & ~1)) =
            static_cast<unsigned short>(both);"""

# reduce_v8: permuted int16 rows read 16 bytes a lane (8 columns: one whole block, one exponent byte per load)
_OLD_VEC = """    vec = 2 if contrib_dtype == "float32" else 4  # columns per lane and run: 8 bytes"""
_NEW_VEC = """    vec = 2 if contrib_dtype == "float32" else 8 if (scaled and perm) else 4  # columns per lane and run"""

# reduce_no_i2f: each int16 value made exact fp32 without I2F (see the module docstring)
_OLD_I2F = """                                        acc[r * vec + c] += T.cast(Contrib[base + hb * kp, r * width + lane * vec + c],
                                                                   f32) * sc
"""
_NEW_I2F = """                                        acc[r * vec + c] += (T.reinterpret(T.bitwise_xor(T.cast(T.reinterpret(
                                            Contrib[base + hb * kp, r * width + lane * vec + c], T.uint16), T.uint32),
                                            T.uint32(0x4B008000)), f32) - T.float32(8421376.0)) * sc
"""

# rows_reversed: the ws program's CTAs take query rows from the last one back (longest causal rows first)
_OLD_ROWS = """        with TC.Kernel(NHB * Tq, threads=256, prelude=_WS_PRELUDE, cluster_dims=(2, 1, 1) if pair else None) as bx:
            hb = bx % NHB
            t = bx // NHB"""
_NEW_ROWS = """        with TC.Kernel(NHB * Tq, threads=256, prelude=_WS_PRELUDE, cluster_dims=(2, 1, 1) if pair else None) as bx:
            hb = bx % NHB
            t = Tq - 1 - bx // NHB"""

# the backward's import of the reduce, redirected to the patched copy where a patch edits the reduce
_OLD_IMPORT = "from .contrib_reduce import DET_BUDGET_BYTES"

#: name -> {"bwd": edits of sparse_attention_bwd.py, "reduce": edits of contrib_reduce.py (the patched backward then
#: imports the patched reduce)}; an edit is (old, new, count)
PATCHES = {
    "exps_u16_pair": {"bwd": [(_OLD_EXPS_AB, _NEW_EXPS_AB, 1)]},
    "reduce_v8": {"reduce": [(_OLD_VEC, _NEW_VEC, 1)]},
    "reduce_no_i2f": {"reduce": [(_OLD_I2F, _NEW_I2F, 1)]},
    "rows_reversed": {"bwd": [(_OLD_ROWS, _NEW_ROWS, 1)]},
}


def patched_sources(name: str) -> dict:
    """{"bwd": source, "reduce": source or None} of patch ``name``."""
    import dsa_plugins.kernels.contrib_reduce as reduce_mod
    import dsa_plugins.kernels.sparse_attention_bwd as shipped

    out = {"bwd": Path(shipped.__file__).read_text(), "reduce": None}
    for part, edits in PATCHES[name].items():
        src = Path((shipped if part == "bwd" else reduce_mod).__file__).read_text()
        for old, new, count in edits:
            src = replace_exact(src, old, new, count)
        out[part] = src
    if out["reduce"] is not None:
        out["bwd"] = replace_exact(out["bwd"], _OLD_IMPORT, f"from ._ab_reduce_{name} import DET_BUDGET_BYTES")
    return out


def patched_module(name: str):
    src = patched_sources(name)
    if src["reduce"] is not None:
        import_patched(src["reduce"], f"ab_reduce_{name}")
    return import_patched(src["bwd"], f"ab_bwd_{name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patch", choices=sorted(PATCHES))
    ap.add_argument("--shapes", default="mla_h64,mla_h128,v4_h128_sink,v4_h64_sink")
    ap.add_argument("--det", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--replays", type=int, default=5)
    args = ap.parse_args(argv)

    import dsa_plugins.kernels.sparse_attention_bwd as shipped
    from bench_sparse_attention_bwd import LONG_SHAPES, SHAPES, make_inputs

    from dsa_plugins.bench.runner import capture_graph, interleaved_graph_ms, ratio_text

    variant = patched_module(args.patch)
    known = {s[0]: s for s in SHAPES + LONG_SHAPES}
    print(f"{torch.cuda.get_device_name()}: patch {args.patch}, deterministic {args.det}", flush=True)
    for sname in args.shapes.split(","):
        _, B, S, Skv, H, Dqk, Dv, K, sink = known[sname]
        q, kv, idx, out, lse, dout, z, scale = make_inputs(B, S, Skv, H, Dqk, Dv, K, sink, causal="causal" in sname)

        def call(m):
            return lambda: m.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=Dv,
                                                  deterministic=args.det)

        a, b = call(shipped)(), call(variant)()
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(a[:2], b[:2], strict=True))
        # the atomic mode's dkv sums follow the CTAs' timing: a patch that reorders them changes the last bits only
        rel = max(((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()
                  for x, y in zip(a[:2], b[:2], strict=True))
        graphs = [capture_graph(call(shipped)), capture_graph(call(variant))]
        times = interleaved_graph_ms(graphs, args.rounds, args.replays)
        med = [statistics.median(t) for t in times]
        print(f"{sname}: shipped {med[0]:.3f} ms, {args.patch} {med[1]:.3f} ms, shipped / patched "
              f"{ratio_text(times[0], times[1])}; dq and dkv bit for bit the same: {same} (rel diff {rel:.1e})", flush=True)
        del graphs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
