"""Reference float conversions for tests/convert.rs, from numpy and ml_dtypes.

Usage: convert_ref.py DIR. DIR holds in_<dtype>.bin (packed little-endian inputs) for dtypes
float16, bfloat16, float32, float64. For every pair (source, target) of different dtypes this
writes, in DIR:
  lib_<src>_<dst>.bin   numpy / ml_dtypes `astype` of the inputs (bits),
  rule_<src>_<dst>.bin  for NaN inputs, the documented NaN rule computed here from the bits
                        (sign kept, payload's high bits kept, quiet bit set unless widening);
                        zeros elsewhere,
and for float64 -> bfloat16 also
  rto_float64_bfloat16.bin  the correctly rounded result: round to odd to float32, then
                        round to nearest even (ml_dtypes rounds through float32 twice).
"""
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np

warnings.simplefilter("ignore")
D = Path(sys.argv[1])
TYPES = {
    "float16": (np.float16, np.uint16, 5, 10),
    "bfloat16": (ml_dtypes.bfloat16, np.uint16, 8, 7),
    "float32": (np.float32, np.uint32, 8, 23),
    "float64": (np.float64, np.uint64, 11, 52),
}


def nan_rule(bits, s, d):
    _, _, se, sm = TYPES[s]
    _, dut, de, dm = TYPES[d]
    out = []
    for b in bits.tolist():
        sign = (b >> (se + sm)) & 1
        payload = b & ((1 << sm) - 1)
        payload = payload << (dm - sm) if dm >= sm else payload >> (sm - dm)
        quiet = 0 if (de >= se and dm >= sm) else 1 << (dm - 1)
        out.append((sign << (de + dm)) | (((1 << de) - 1) << dm) | quiet | payload)
    return np.array(out, dtype=dut)


for s, (sdt, sut, _, _) in TYPES.items():
    bits = np.fromfile(D / f"in_{s}.bin", dtype=sut)
    vals = bits.view(sdt)
    isnan = np.isnan(vals.astype(np.float64))
    for d, (ddt, dut, _, _) in TYPES.items():
        if s == d:
            continue
        vals.astype(ddt).view(dut).tofile(D / f"lib_{s}_{d}.bin")
        rule = np.zeros(len(bits), dtype=dut)
        rule[isnan] = nan_rule(bits[isnan], s, d)
        rule.tofile(D / f"rule_{s}_{d}.bin")

# float64 -> bfloat16, correctly rounded: round to odd into float32 (24 bits >= 8 + 2), then
# round to nearest even into bfloat16.
x = np.fromfile(D / "in_float64.bin", dtype=np.uint64).view(np.float64)
r = x.astype(np.float32)
over = np.abs(r.astype(np.float64)) > np.abs(x)
r[over] = np.nextafter(r[over], np.float32(0))
rb = r.view(np.uint32).copy()
inexact = (r.astype(np.float64) != x) & ~np.isnan(x)
rb[inexact] |= 1
rb.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).tofile(D / "rto_float64_bfloat16.bin")
print("ok")
