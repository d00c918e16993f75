"""The MXFP8 plan's test cases, shared by the plan kernel's tests and ``route_collect``'s (which
plans what it collects): one 32-element block per SPEC edge case with its scale byte derived by
hand, and those blocks laid out as latent rows."""

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def bf16_from_bits(*values):
    """bfloat16 values from their 16-bit patterns."""
    return np.array(values, np.uint16).view(BF16)


def edge_blocks():
    """One 32-element block per SPEC edge case, as rows of floats (bfloat16-exact); returns
    (blocks [n, 32] bfloat16, the expected scale byte of each, computed by hand)."""
    cases = []

    def case(byte, *values, fill=0.0):
        row = np.full(32, fill, np.float32)
        row[: len(values)] = values
        cases.append((row.astype(BF16), byte))

    case(0)  # all zeros: amax 0, scale byte 0 (decodes to 0), inverse 0
    case(0, *[-0.0] * 32)  # all -0: byte 0, every value -0
    case(0, -0.0, 0.0, -0.0)
    sub = float(bf16_from_bits(0x0001)[0])  # the smallest bfloat16 subnormal, 2**-133
    case(0, sub, -sub, float(bf16_from_bits(0x007F)[0]))  # subnormal amax: byte 0, values +-0
    case(127, 448.0, -448.0, 1.0)  # amax / 448 = 1: scale 2**0, 448 stays the E4M3 max
    case(128, 450.0, -3.0)  # just past 448 * 2**0: the scale rounds up to 2**1, 450 -> 225 -> 224
    case(127, 448.0, 232.0, 248.0, -232.0)  # ties between E4M3 neighbours: 224, 256, -224
    case(127, 448.0, 1.0625, 1.1875, -1.0625)  # ties at 3 mantissa bits: 1.0, 1.25, -1.0
    case(127, 448.0, 2.0**-10, 3 * 2.0**-10, 2.0**-11, -(2.0**-10))  # subnormal ties: 0, 2**-8, 0, -0
    case(127, 448.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6 * 1.875)  # E4M3 subnormals and min normal
    case(119, 1.0, 0.5, -0.25)  # amax a power of two: 2**0 / 448 rounds up to 2**-8
    case(119, 1.75, 1.0)  # amax / 448 = 2**-8 exactly: not rounded up; 1.75 * 256 = 448
    case(120, 1.7578125, 1.0)  # one bf16 ulp above 1.75: up to 2**-7
    case(0, 2.0**-120, 2.0**-121)  # amax / 448 below 2**-127: byte 0
    case(1, 2.0**-118, 2.0**-119)  # amax / 448 = 2**-126.8: rounds up to 2**-126, byte 1
    case(247, float(bf16_from_bits(0x7F7F)[0]), 1.0)  # the largest finite bfloat16
    case(254, np.inf, 1.0, -1.0)  # infinity saturates at byte 254; values 448, 1 * 2**-127 -> 0
    case(254, -np.inf, np.inf, 3.0)  # -inf clamps to -448
    case(254, np.nan, 1.0, 448.0)  # NaN: byte 254 too; the NaN stays a NaN
    case(254, 1.0, float(bf16_from_bits(0xFFC0)[0]))  # a negative NaN
    case(127, 448.0, fill=-1.0)  # a block of negatives and one max
    blocks = np.stack([row for row, _ in cases])
    return blocks, np.array([byte for _, byte in cases], np.uint8)


def edge_latent(width=64):
    """The edge blocks laid out in rows of ``width`` (a multiple of 32), padded with random blocks."""
    blocks, bytes_ = edge_blocks()
    per_row = width // 32
    rows = -(-len(blocks) // per_row)
    fill = rows * per_row - len(blocks)
    pad = np.random.default_rng(0).normal(0, 3, (fill, 32)).astype(BF16)
    latent = np.concatenate([blocks, pad]).reshape(rows, width)
    return latent, bytes_
