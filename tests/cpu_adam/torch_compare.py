#!/usr/bin/env python3
"""Compares strata's CPU optimizers with torch.optim element by element.

Runs torch.optim.Adam / AdamW / Adagrad over a multi-step trajectory (random
params and gradients, a learning-rate schedule) and the same trajectory
through strata_cpu_adam_replay on every kernel path this machine supports,
then checks every element of params and moments:
  fp32 state, fp32, bf16 or fp16 gradients: |ours - torch| <= 1e-6 * |torch| + floor
      (floor = 1e-6 * max|torch| of that tensor, for elements that cancel to ~0)
  bf16/fp16 param copy: equal to torch's final params rounded, or 1 ulp apart
  bf16 moments: against torch with its moments rounded to bf16 after every
      step (torch has no bf16-moment Adam); within 1 bf16 ulp (2^-8 relative)
      per element, since a 1-ulp fp32 difference can flip a bf16 rounding
Exit code 77 (ctest SKIP_RETURN_CODE) when torch or numpy is not importable;
exit code 2 instead with --require-torch or STRATA_REQUIRE_TORCH=1 (CI, where a
skipped comparison would hide that it never ran).

  torch_compare.py --replay build/tests/cpu_adam/strata_cpu_adam_replay [--count N] [--steps S]
                   [--require-torch]
"""
import argparse
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:  # a developer machine without python3-torch: skip, unless required
    required = "--require-torch" in sys.argv[1:] or os.environ.get("STRATA_REQUIRE_TORCH", "0") not in ("", "0")
    hint = (f"{sys.executable} cannot import torch and numpy ({e}); install them with "
            "scripts/install-deps.sh --with-torch (Debian: apt-get install python3-torch python3-numpy, "
            "under /usr/bin/python3) or point cmake at an interpreter that has them: "
            "-DSTRATA_SYSTEM_PYTHON3=/path/to/python3")
    if required:
        print(f"ERROR: the PyTorch comparison is required (--require-torch / STRATA_REQUIRE_TORCH=1) but {hint}",
              file=sys.stderr)
        sys.exit(2)
    print(f"SKIP: {hint}")
    sys.exit(77)


def torch_run(kind, params0, grads, lrs, betas, eps, wd, bf16_moments=False):
    p = torch.nn.Parameter(torch.from_numpy(params0.copy()))
    if kind == "adam":
        opt = torch.optim.Adam([p], lr=lrs[0], betas=betas, eps=eps, weight_decay=wd)
    elif kind == "adamw":
        opt = torch.optim.AdamW([p], lr=lrs[0], betas=betas, eps=eps, weight_decay=wd)
    elif kind == "adagrad":
        opt = torch.optim.Adagrad([p], lr=lrs[0], eps=eps, weight_decay=wd)
    else:
        raise ValueError(kind)
    for t, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        p.grad = torch.from_numpy(grads[t].copy())
        opt.step()
        if bf16_moments:  # torch's update in fp32, moments stored as bf16 (what ours does)
            for key in ("exp_avg", "exp_avg_sq", "sum"):
                if key in opt.state[p]:
                    t_ = opt.state[p][key]
                    t_.copy_(t_.to(torch.bfloat16).to(torch.float32))
    st = opt.state[p]
    if kind == "adagrad":
        return p.detach().numpy().copy(), None, st["sum"].numpy().copy()
    return p.detach().numpy().copy(), st["exp_avg"].numpy().copy(), st["exp_avg_sq"].numpy().copy()


def to_bf16_values(x):
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


def bf16_bits(x):
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)


def fp16_bits(x):
    return torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().astype(np.uint16)


def rel_check(name, ours, ref, rel):
    floor = rel * float(np.max(np.abs(ref))) if ref.size else 0.0
    err = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    bound = rel * np.abs(ref.astype(np.float64)) + floor
    bad = int(np.count_nonzero(err > bound))
    nz = np.abs(ref) > 1e-3 * np.max(np.abs(ref))
    max_rel = float(np.max(err[nz] / np.abs(ref[nz]))) if np.any(nz) else 0.0
    return bad, max_rel, f"{name}: max rel err {max_rel:.2e} (elements above {rel:.0e}+floor: {bad})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replay", required=True)
    ap.add_argument("--count", type=int, default=10007)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--require-torch", action="store_true",
                    help="fail (exit 2), not skip (77), when torch or numpy is missing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = subprocess.run([args.replay, "--list-paths"], check=True, capture_output=True,
                           text=True).stdout.split()
    rng = np.random.default_rng(1234)
    n, steps = args.count, args.steps
    params0 = rng.standard_normal(n).astype(np.float32)
    grads = (0.1 * rng.standard_normal((steps, n))).astype(np.float32)
    grads_bf16 = to_bf16_values(grads)
    grads_fp16 = torch.from_numpy(grads).to(torch.float16).to(torch.float32).numpy()
    lrs = [1e-3 * (1.0 - 0.02 * t) for t in range(steps)]  # a schedule: lr changes every step

    cases = []  # (kind, grad dtype, moment dtype, copy, wd, eps)
    for kind in ("adam", "adamw"):
        for wd in (0.0, 0.01):
            cases.append((kind, "fp32", "fp32", "none", wd, 1e-8))
        cases.append((kind, "bf16", "fp32", "bf16", 0.01, 1e-8))
        cases.append((kind, "bf16", "bf16", "bf16", 0.01, 1e-8))
        cases.append((kind, "fp16", "fp32", "fp16", 0.01, 1e-8))
    cases.append(("adagrad", "fp32", "fp32", "none", 0.0, 1e-10))
    cases.append(("adagrad", "fp32", "fp32", "none", 0.01, 1e-10))
    cases.append(("adagrad", "bf16", "fp32", "bf16", 0.0, 1e-10))

    failures = 0
    with tempfile.TemporaryDirectory(prefix="strata_torch_compare_") as tmp:
        params0.tofile(os.path.join(tmp, "params.f32"))
        np.asarray(lrs, dtype=np.float64).tofile(os.path.join(tmp, "lr.f64"))
        for kind, gdt, mdt, copy, wd, eps in cases:
            g = {"bf16": grads_bf16, "fp16": grads_fp16}.get(gdt, grads)
            g.astype(np.float32).tofile(os.path.join(tmp, "grads.f32"))
            tp, tm, tv = torch_run(kind, params0, g, lrs, (0.9, 0.999), eps, wd, bf16_moments=mdt == "bf16")
            for path in paths:
                cmd = [args.replay, tmp, kind, path, gdt, mdt, copy, str(steps), str(n), "0.9", "0.999",
                       repr(eps), repr(wd), "2"]
                subprocess.run(cmd, check=True)
                op = np.fromfile(os.path.join(tmp, "out_params.f32"), dtype=np.float32)
                om = np.fromfile(os.path.join(tmp, "out_exp_avg.f32"), dtype=np.float32)
                ov = np.fromfile(os.path.join(tmp, "out_exp_avg_sq.f32"), dtype=np.float32)
                oc = np.fromfile(os.path.join(tmp, "out_copy.u16"), dtype=np.uint16)
                label = f"{kind:7s} grads={gdt} moments={mdt} copy={copy:4s} wd={wd:<5} path={path:11s}"
                rel = 1e-6 if mdt == "fp32" else 2.0 ** -8
                prel = 1e-6 if mdt == "fp32" else 1e-5
                checks = [rel_check("params", op, tp, prel), rel_check("exp_avg_sq", ov, tv, rel)]
                if tm is not None:
                    checks.append(rel_check("exp_avg", om, tm, rel))
                bad = sum(c[0] for c in checks)
                msg = "; ".join(c[2] for c in checks)
                if copy != "none":
                    ref_bits = (bf16_bits(tp) if copy == "bf16" else fp16_bits(tp)).astype(np.int32)
                    ulps = np.abs(oc.astype(np.int32) - ref_bits)
                    copy_bad = int(np.count_nonzero(ulps > 1))
                    bad += copy_bad
                    msg += f"; {copy} copy: {int(np.count_nonzero(ulps == 0))}/{n} bit-equal, max {int(ulps.max())} ulp"
                status = "ok  " if bad == 0 else "FAIL"
                failures += bad != 0
                print(f"{status} {label} {msg}")
    total = len(cases) * len(paths)
    print(f"torch_compare: {total - failures}/{total} comparisons passed "
          f"({n} elements, {steps} steps, torch {torch.__version__})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
