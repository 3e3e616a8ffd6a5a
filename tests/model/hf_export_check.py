#!/usr/bin/env python3
"""Checks Strata's Hugging Face GPT-2 export against Strata's own forward.

For fp32 and bf16, runs strata_hf_export_dump (a small GPT with every
parameter perturbed, exported to DIR/model, plus tokens and Strata's
float64 logits for them), then:
  1. parses model.safetensors by hand (8-byte little-endian header length,
     JSON header, data): the exact GPT-2 tensor names, shapes, dtypes,
     contiguous offsets, no lm_head (tied);
  2. runs a GPT-2 forward written here in PyTorch (float64) from those names
     alone, with Hugging Face's conventions (Conv1D: y = x @ W + b with W
     [in, out]; c_attn's output split into q | k | v, each into heads of
     n_embd / n_head side by side; causal softmax scaled by 1/sqrt(head
     size); GELU tanh; LayerNorm eps from config.json; logits = x @ wte^T);
  3. when `transformers` is importable, loads the folder with
     GPT2LMHeadModel.from_pretrained and runs it (float32);
and compares each with Strata's logits: max |ours - strata| <= 1e-4 * max |strata|.

Exit code 77 (ctest SKIP_RETURN_CODE) when torch or numpy is not importable;
exit code 2 instead with --require-torch or STRATA_REQUIRE_TORCH=1. A missing
`transformers` only skips step 3 (said on stdout), unless
--require-transformers or STRATA_REQUIRE_TRANSFORMERS=1.

  hf_export_check.py --dump build/tests/model/strata_hf_export_dump [--keep DIR]
"""
import argparse
import json
import math
import os
import struct
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

REL_TOL = 1e-4
BLOCK_TENSORS = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"]


class CheckFailed(Exception):
    pass


def expect(cond, message):
    if not cond:
        raise CheckFailed(message)


def expected_shapes(cfg):
    V, P, C, L = cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"]
    shapes = {"transformer.wte.weight": [V, C], "transformer.wpe.weight": [P, C]}
    per_block = {"ln_1.weight": [C], "ln_1.bias": [C], "attn.c_attn.weight": [C, 3 * C], "attn.c_attn.bias": [3 * C],
                 "attn.c_proj.weight": [C, C], "attn.c_proj.bias": [C], "ln_2.weight": [C], "ln_2.bias": [C],
                 "mlp.c_fc.weight": [C, 4 * C], "mlp.c_fc.bias": [4 * C], "mlp.c_proj.weight": [4 * C, C],
                 "mlp.c_proj.bias": [C]}
    for i in range(L):
        for name in BLOCK_TENSORS:
            shapes[f"transformer.h.{i}.{name}"] = per_block[name]
    shapes["transformer.ln_f.weight"] = [C]
    shapes["transformer.ln_f.bias"] = [C]
    return shapes


def read_safetensors(path, cfg, want_dtype):
    """name -> float64 tensor, after checking the layout against GPT-2's."""
    with open(path, "rb") as f:
        blob = f.read()
    expect(len(blob) >= 8, f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    expect(8 + n <= len(blob), f"{path}: header length {n} runs past the end ({len(blob)} bytes)")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    expect(header.pop("__metadata__", None) == {"format": "pt"}, f"{path}: __metadata__ must be {{'format': 'pt'}}")
    shapes = expected_shapes(cfg)
    expect(set(header) == set(shapes),
           f"{path}: names differ from GPT-2's: extra {sorted(set(header) - set(shapes))}, "
           f"missing {sorted(set(shapes) - set(header))}")
    width = {"F32": 4, "BF16": 2}[want_dtype]
    end = 0
    tensors = {}
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        expect(t["dtype"] == want_dtype, f"{name}: dtype {t['dtype']}, expected {want_dtype}")
        expect(t["shape"] == shapes[name], f"{name}: shape {t['shape']}, expected {shapes[name]}")
        begin, stop = t["data_offsets"]
        expect(begin == end, f"{name}: starts at {begin}, the previous tensor ended at {end}")
        expect(stop - begin == width * math.prod(t["shape"]), f"{name}: {stop - begin} bytes for shape {t['shape']}")
        raw = data[begin:stop]
        if want_dtype == "F32":
            values = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        else:
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        tensors[name] = torch.from_numpy(values.reshape(t["shape"]).copy())
        end = stop
    expect(end == len(data), f"{path}: {len(data) - end} bytes after the last tensor")
    return tensors


def gpt2_forward(sd, cfg, tokens):
    """GPT-2 (Hugging Face's modeling_gpt2 conventions), float64."""
    B, T = tokens.shape
    C, H = cfg["n_embd"], cfg["n_head"]
    hs = C // H
    eps = cfg["layer_norm_epsilon"]
    expect(cfg["activation_function"] == "gelu_new", "activation_function must be gelu_new (GELU, tanh)")

    def ln(x, prefix):
        return torch.nn.functional.layer_norm(x, (C,), sd[prefix + ".weight"], sd[prefix + ".bias"], eps)

    def conv1d(x, prefix):  # HF Conv1D: weight [in, out]
        return x @ sd[prefix + ".weight"] + sd[prefix + ".bias"]

    x = sd["transformer.wte.weight"][tokens] + sd["transformer.wpe.weight"][torch.arange(T)]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=2)
        q, k, v = (z.view(B, T, H, hs).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(y, p + "attn.c_proj")
        h = torch.nn.functional.gelu(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")
        x = x + conv1d(h, p + "mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    return x @ sd["transformer.wte.weight"].T  # the tied head


def compare(what, ours, strata):
    err = (ours - strata).abs().max().item()
    scale = strata.abs().max().item()
    rel = err / scale
    print(f"  {what}: max |diff| {err:.3e}, max |strata| {scale:.3f}, relative {rel:.3e} (tolerance {REL_TOL:g})")
    expect(rel <= REL_TOL, f"{what}: logits differ from strata's by {rel:.3e} relative (> {REL_TOL:g})")


def load_with_transformers(model_dir, tokens):
    import transformers  # noqa: F401 (imported by the caller's probe already)
    from transformers import GPT2LMHeadModel
    model, info = GPT2LMHeadModel.from_pretrained(model_dir, output_loading_info=True, torch_dtype=torch.float32)
    expect(not info["unexpected_keys"], f"from_pretrained: unexpected keys {info['unexpected_keys']}")
    missing = [k for k in info["missing_keys"] if not (k.endswith("attn.bias") or k.endswith("attn.masked_bias")
                                                       or k == "lm_head.weight")]
    expect(not missing, f"from_pretrained: missing keys {missing}")
    expect(not info.get("mismatched_keys"), f"from_pretrained: mismatched keys {info.get('mismatched_keys')}")
    expect(model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(),
           "from_pretrained: lm_head is not tied to wte")
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.to(torch.float64)


def check(dump, dtype, work, use_transformers):
    out = os.path.join(work, dtype)
    run = subprocess.run([dump, out, dtype], capture_output=True, text=True)
    if run.returncode != 0:
        raise CheckFailed(f"{dump} {out} {dtype} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    print(run.stdout.strip())
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    B, T, V = meta["batch"], meta["seq"], meta["vocab"]
    model_dir = os.path.join(out, "model")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    expect(cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"], "config.json: not a GPT-2")
    expect(cfg["vocab_size"] == V, f"config.json: vocab_size {cfg['vocab_size']}, the dump says {V}")
    expect(cfg["tie_word_embeddings"] is True, "config.json: tie_word_embeddings must be true")
    tokens = np.fromfile(os.path.join(out, "tokens.i32"), dtype="<i4").reshape(B, T).astype(np.int64)
    strata = torch.from_numpy(np.fromfile(os.path.join(out, "logits.f64"), dtype="<f8").reshape(B, T, V))
    sd = read_safetensors(os.path.join(model_dir, "model.safetensors"), cfg, {"fp32": "F32", "bf16": "BF16"}[dtype])
    print(f"  {dtype}: {len(sd)} tensors with GPT-2's names, shapes and offsets")
    with torch.no_grad():
        compare(f"{dtype} GPT-2 forward in torch from the HF names", gpt2_forward(sd, cfg, torch.from_numpy(tokens)),
                strata)
    if use_transformers:
        compare(f"{dtype} transformers.GPT2LMHeadModel.from_pretrained", load_with_transformers(model_dir, tokens),
                strata)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True, help="path of strata_hf_export_dump")
    ap.add_argument("--keep", help="write the exports here instead of a temporary folder")
    ap.add_argument("--require-torch", action="store_true", help="(checked at import) fail instead of skipping")
    ap.add_argument("--require-transformers", action="store_true",
                    help="fail when transformers is not importable (also STRATA_REQUIRE_TRANSFORMERS=1)")
    args = ap.parse_args()
    try:
        import transformers
        use_transformers = True
        print(f"transformers {transformers.__version__}: GPT2LMHeadModel.from_pretrained is compared too")
    except ImportError as e:
        use_transformers = False
        if args.require_transformers or os.environ.get("STRATA_REQUIRE_TRANSFORMERS", "0") not in ("", "0"):
            print(f"ERROR: transformers is required but {sys.executable} cannot import it ({e})", file=sys.stderr)
            return 2
        print(f"NOTE: {sys.executable} cannot import transformers ({e}); "
              "GPT2LMHeadModel.from_pretrained is not exercised, the torch forward over the HF names is")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    try:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            for dtype in ("fp32", "bf16"):
                check(args.dump, dtype, args.keep, use_transformers)
        else:
            with tempfile.TemporaryDirectory(prefix="strata-hf-export-") as work:
                for dtype in ("fp32", "bf16"):
                    check(args.dump, dtype, work, use_transformers)
    except CheckFailed as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print("OK: the exported GPT-2 reproduces strata's logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
