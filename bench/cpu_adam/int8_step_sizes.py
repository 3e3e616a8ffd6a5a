"""How big Adam's steps are with block-wise 8-bit moments, against fp32 moments (issue 24 §2's convergence
question: why the `small` preset ends 2.5 % *below* fp32 with int8 moments).

A simulation, not the kernels: float64 torch emulating the moment codes of cpu_adam/src/int8_format.h (first
moment: sign and a 7-bit magnitude, 4 exponent bits and 3 mantissa bits; second moment: sqrt(v) in 8 bits, 4
exponent and 4 mantissa bits; both relative to their block's largest |value|, subnormals below 2^-14, rounded to
nearest even) and the step's order (decode with the old scales, update m and v, step with the new unrounded m
and sqrt(v), encode with the new block maxima). Elements get gradient scales spread log-uniformly over eight
decades, shuffled within blocks of 256, each step a drift plus Gaussian noise. Printed, by how far the element's scale sits
below its block's largest, over steps 51..N: the ratio of the steps' root mean squares (8-bit moments over fp32
moments: how much bigger the steps are on average) and the median of the per-step ratios |step8| / |step32|.

    build/python/venv/bin/python bench/cpu_adam/int8_step_sizes.py [--moments both|m|v] [--steps N]

`--moments m` rounds only the first moment, `v` only the second (the other kept in float64).
"""
import argparse

import torch

BLOCK = 256


def round_to_code(r, mantissa_bits):
    """|r| in [0, 1] -> the nearest code value (4 exponent bits with bias 15, subnormals below 2^-14)."""
    r = r.clamp(0, 1)
    normal = r >= 2.0 ** -14
    exponent = torch.floor(torch.log2(torch.where(normal, r, torch.ones_like(r))))
    ulp = torch.where(normal, 2.0 ** (exponent - mantissa_bits), torch.full_like(r, 2.0 ** (-14 - mantissa_bits)))
    return torch.round(r / ulp) * ulp  # torch.round: half to even


def blockwise(x, mantissa_bits, signed):
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    rounded = round_to_code(blocks.abs() * inverse, mantissa_bits) * scale
    return (torch.sign(blocks) * rounded if signed else rounded).view(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moments", choices=["both", "m", "v"], default="both")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps <= 50 or args.blocks <= 0:
        parser.error("--steps must be > 50 (the first 50 are not counted) and --blocks > 0")
    torch.manual_seed(args.seed)
    b1, b2, eps = args.beta1, args.beta2, 1e-8
    n = args.blocks * BLOCK
    scale = 10 ** (-8 * torch.rand(n, dtype=torch.float64))
    m32, v32 = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    m8, u8 = torch.zeros_like(m32), torch.zeros_like(m32)
    steps8, steps32 = [], []
    for t in range(1, args.steps + 1):
        g = scale * (0.3 + torch.randn_like(scale))
        m32 = b1 * m32 + (1 - b1) * g
        v32 = b2 * v32 + (1 - b2) * g * g
        m = b1 * m8 + (1 - b1) * g
        v = b2 * u8 * u8 + (1 - b2) * g * g
        m8 = blockwise(m, 3, True) if args.moments in ("both", "m") else m
        u8 = blockwise(v.sqrt(), 4, False) if args.moments in ("both", "v") else v.sqrt()
        c1, c2 = 1 - b1 ** t, (1 - b2 ** t) ** 0.5
        step32 = (m32 / c1) / (v32.sqrt() / c2 + eps)
        step8 = (m / c1) / (v.sqrt() / c2 + eps)
        if t > 50:
            steps8.append(step8)
            steps32.append(step32)
    steps8 = torch.stack(steps8).view(len(steps8), args.blocks, BLOCK)
    steps32 = torch.stack(steps32).view(len(steps32), args.blocks, BLOCK)
    below = (scale.view(args.blocks, BLOCK) / scale.view(args.blocks, BLOCK).amax(dim=1, keepdim=True)).log10()
    print(f"moments rounded: {args.moments}; {args.blocks} blocks of {BLOCK}, steps 51..{args.steps}, "
          f"betas {b1}/{b2}")
    print(f"{'scale / block max':>20} {'elements':>9} {'rms ratio':>10} {'median ratio':>13}")
    for high in range(0, -8, -1):
        low = high - 1 if high > -7 else -9
        chosen = (below > low) & (below <= high + (0.1 if high == 0 else 0))
        if chosen.any():
            a, b = steps8[:, chosen], steps32[:, chosen]
            rms = (a.square().mean() / b.square().mean()).sqrt()
            median = ((a.abs() + 1e-30) / (b.abs() + 1e-30)).median()
            print(f"{f'1e{low} .. 1e{high}':>20} {int(chosen.sum()):9d} {rms:10.3f} {median:13.3f}")


if __name__ == "__main__":
    main()
