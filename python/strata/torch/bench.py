"""strata.torch.bench: what each placement of the training state costs, for
your own model (`strata bench offload` measures it for the built-in GPT;
docs/offload-bench.md).

    import strata.torch.bench as sb
    doc = sb.offload(lambda: MyModel(), lambda i: make_batch(i), config="ds.json",
                     json_path="bench.json", plot_path="bench.png")

    python -m strata.torch.bench --model gpt2 --set n_layer=2 --set n_embd=64 --batch-size 2 --seq 64 \\
        --json bench.json --plot bench.png

Each row is one placement (ZeRO stage x offload_optimizer x offload_param x
ratio x dtype; strata/torch/_bench_rows.py, the C++ bench's rows and row
files). A fresh model and engine per row and repeat; warm-up steps, then
measured steps back to back (the engine's updates overlap the next step as in
training: nothing drains between steps); repeats in ABBA order (Note [ABBA
order]). Per row: the engine's step time (median, spread, per repeat), the
penalty against the fastest row that ran, the passes, the exposed waits,
bytes per link, the peaks per tier against the engine's plan: the fields of
`strata bench offload --json`, drawn by the same scripts/plot_offload.py.
docs/torch.md, "What does offload cost for my model?".
"""
import argparse
import collections.abc
import gc
import importlib
import json
import os
import statistics
import sys
import time
import warnings

import torch

from .. import config as strata_config
from .._checks import check_int, printable, short_repr
from .._sizes import parse_size
from ..errors import InvalidArgument, OutOfMemory, ResourceExhausted, StrataError
from . import _bench_report as report
from ._bench_rows import DTYPES, default_rows, load_rows_file, rows_from_list

__all__ = ["offload", "token_batches", "main"]

# Note [ABBA order]
# A shared machine drifts (other jobs, page cache, thermals); running one
# row's repeats and then the next row's lets the drift decide the comparison.
# Repeat r runs every row once, in the list's order rotated left by r // 2,
# reversed when r is odd: each pair of repeats is A B ... B A, so a drift
# that is linear in time adds the same to every row's pair, and the rotation
# gives every row other neighbours from pair to pair. The JSON's `schedule`
# lists the order actually run.


def abba_order(count, repeat):
    """The row indices repeat `repeat` (0-based) runs, Note [ABBA order]."""
    shift = (repeat // 2) % count if count else 0
    order = [(i + shift) % count for i in range(count)]
    return order[::-1] if repeat % 2 else order


def token_batches(vocab_size, batch_size, seq, seed=0):
    """A batch_fn for a causal language model: micro-batch i is
    {"input_ids": ids, "labels": ids} of random token ids (batch_size x seq, drawn from `seed` and i, so every
    row trains on the same batches)."""
    vocab_size = check_int(vocab_size, "vocab_size", 1, 1 << 31)
    batch_size = check_int(batch_size, "batch_size", 1, 1 << 16)
    seq = check_int(seq, "seq", 1, 1 << 24)

    def make(i):
        g = torch.Generator().manual_seed(seed * 1000003 + i)
        ids = torch.randint(0, vocab_size, (batch_size, seq), generator=g)
        return {"input_ids": ids, "labels": ids}

    make.describe = f"random tokens, {batch_size} x {seq} of vocab {vocab_size}"
    return make


# The argument names of offload() in messages; the command line names its flags instead.
_API_NAMES = {"model": "model_fn", "batch": "batch_fn", "loss": "loss_fn", "config": "config", "rows": "rows",
              "dtype": "dtype", "steps": "steps", "warmup": "warmup", "repeats": "repeats",
              "device_memory": "device_memory", "nvme_path": "nvme_path", "seed": "seed", "json": "json_path",
              "csv": "csv_path", "plot": "plot_path", "plot_script": "plot_script"}
_CLI_NAMES = {"model": "--model", "batch": "--batch", "loss": "--loss", "config": "--config", "rows": "--rows",
              "dtype": "--dtype", "steps": "--steps", "warmup": "--warmup", "repeats": "--repeats",
              "device_memory": "--device-memory", "nvme_path": "--nvme-path", "seed": "--seed", "json": "--json",
              "csv": "--csv", "plot": "--plot", "plot_script": "--plot-script"}


def offload(model_fn, batch_fn=None, config=None, rows=None, steps=3, warmup=1, repeats=3, loss_fn=None, dtype=None,
            device_memory=0, nvme_path=None, seed=0, json_path=None, csv_path=None, plot_path=None,
            plot_script=None, verbose=False):
    """Runs every row and returns the JSON document (a dict; `strata bench offload --json`'s fields).

    model_fn: a callable returning a fresh torch.nn.Module (called once per row and repeat, after
    torch.manual_seed(seed)), or a Hugging Face PretrainedConfig (its AutoModelForCausalLM). batch_fn(i): the
    i-th micro-batch of a run (i from 0; the same i gives every row the same batch), passed as engine(**mb) for
    a dict, engine(*mb) for a tuple or list, else engine(mb); None: token_batches() of the model's
    config.vocab_size, 2 samples x 64 tokens (at most its positions).
    loss_fn(output, micro_batch): the loss (default: the output's .loss, or the output when it is a scalar).
    config: the DeepSpeed config (a path or dict) every row starts from; each row writes its stage, placement,
    ratio and precision into it (default: AdamW lr 1e-4, one micro-batch per step). rows: None (the C++
    bench's default matrix), a row file's path, or a list of row dicts ({"stage": 3, "offload_optimizer":
    "cpu"}, the row file's keys). dtype: the parameter dtype of rows without their own (default: the
    config's precision). device_memory: the engine's device cap (bytes or "64MiB"; 0: the engine's default).
    nvme_path: the NVMe rows' folder (default $STRATA_NVME_DIR, else $TMPDIR, else /tmp). json_path,
    csv_path, plot_path (.png): written after the last row; checked before the first."""
    return _Bench(_API_NAMES, model_fn, batch_fn, config, rows, steps, warmup, repeats, loss_fn, dtype,
                  device_memory, nvme_path, seed, json_path, csv_path, plot_path, plot_script, verbose,
                  source=None, token_shape=(None, None)).run()


class _RowResult:
    def __init__(self, row):
        self.row = row
        self.status = "pending"
        self.reason = ""
        self.steps = []            # the engine's metrics of each measured step, every repeat
        self.wall_ms = []          # each measured train_batch() call, as the user's loop sees it
        self.tokens = []           # tokens per measured step (all ranks), None where the batch shows none
        self.repeat_median_ms = []
        self.predicted = None
        self.engine = ""
        self.warnings = []


def _default_nvme_dir():
    # Where `strata train`'s quickstart and `strata bench offload` put swap files (apps/engine_run.cpp).
    for variable in ("STRATA_NVME_DIR", "TMPDIR"):
        folder = os.environ.get(variable)
        if folder:
            return folder, f"${variable}"
    return "/tmp", "neither $STRATA_NVME_DIR nor $TMPDIR is set"


def _first_tensor(value):
    if torch.is_tensor(value):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        if torch.is_tensor(item):
            return item
    return None


def _tokens_of(micro_batch):
    """Tokens in a micro-batch: its input_ids' elements, else its first integer tensor's; None without one."""
    if isinstance(micro_batch, dict) and torch.is_tensor(micro_batch.get("input_ids")):
        return micro_batch["input_ids"].numel()
    items = (micro_batch.values() if isinstance(micro_batch, dict) else
             micro_batch if isinstance(micro_batch, (list, tuple)) else (micro_batch,))
    for item in items:
        if torch.is_tensor(item) and not item.is_floating_point() and not item.is_complex() and item.dim() >= 1:
            return item.numel()
    return None


def to_device(batch, device):
    """`batch` (a tensor, or a dict, list or tuple of them and other values) with its tensors on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device)
    if isinstance(batch, dict):
        return type(batch)((key, to_device(value, device)) for key, value in batch.items())
    if isinstance(batch, collections.abc.Mapping):  # transformers' BatchEncoding: a plain dict of it
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def _model_of(built, what):
    if hasattr(built, "to_dict") and hasattr(built, "model_type"):  # a Hugging Face PretrainedConfig
        import transformers
        try:
            return transformers.AutoModelForCausalLM.from_config(built)
        except ValueError as e:
            raise InvalidArgument(f"{what}: {type(built).__name__} has no causal-LM model in transformers ({e}); "
                                  f"give a callable that builds the model") from None
    if not isinstance(built, torch.nn.Module):
        raise TypeError(f"{what} must build a torch.nn.Module (or be a Hugging Face config), not "
                        f"{type(built).__name__}")
    return built


class _Bench:
    def __init__(self, names, model_fn, batch_fn, config, rows, steps, warmup, repeats, loss_fn, dtype,
                 device_memory, nvme_path, seed, json_path, csv_path, plot_path, plot_script, verbose, source,
                 token_shape):
        self.names = names
        self.steps = check_int(steps, names["steps"], 1, 100000)
        self.warmup = check_int(warmup, names["warmup"], 0, 100000)
        self.repeats = check_int(repeats, names["repeats"], 1, 10000)
        self.seed = check_int(seed, names["seed"], 0, (1 << 63) - 1)
        self.device_memory = parse_size(device_memory, names["device_memory"]) if device_memory else 0
        if hasattr(model_fn, "to_dict") and hasattr(model_fn, "model_type"):
            hf_config = model_fn
            model_fn = lambda: hf_config  # noqa: E731  (_model_of builds its causal LM)
        if not callable(model_fn):
            raise TypeError(f"{names['model']} must be a callable that builds the model (or a Hugging Face config), "
                            f"not {type(model_fn).__name__}")
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"{names['batch']} must be a callable batch_fn(i) -> micro-batch, not "
                            f"{type(batch_fn).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{names['loss']} must be a callable loss_fn(output, micro_batch), not "
                            f"{type(loss_fn).__name__}")
        self.model_fn, self.batch_fn, self.loss_fn = model_fn, batch_fn, loss_fn
        self.token_shape = token_shape  # (samples, tokens) of the random tokens made without a batch_fn
        self.verbose = verbose
        self.source = source
        self.outputs = {}
        for key, path in (("json", json_path), ("csv", csv_path), ("plot", plot_path)):
            if path is not None:
                report.check_output_path(path, names[key])
                self.outputs[key] = os.fspath(path)
        self.plot_tool = None
        if "plot" in self.outputs:
            if not self.outputs["plot"].endswith(".png"):
                raise InvalidArgument(f"{names['plot']} '{printable(self.outputs['plot'])}' must name a .png file")
            self.plot_tool = report.find_plot_tool(plot_script)
        elif plot_script is not None:
            raise InvalidArgument(f"{names['plot_script']} is for the plot: give {names['plot']} too, or drop it")
        self.base = self._base_config(config)
        self.dtype = self._dtype(dtype)
        self.rows = self._rows(rows)
        self.nvme_path, self.nvme_origin = self._nvme_path(nvme_path)
        # A given config is checked with each row now; the default one is made valid after the first batch.
        self.refused = self._refusals() if self.base is not None else {}

    # -- inputs, checked before anything runs -------------------------------------------------------
    def _base_config(self, config):
        if config is None:
            return None  # made once the first micro-batch says how many samples it has
        name = self.names["config"]
        if isinstance(config, dict):
            try:
                raw = json.loads(json.dumps(config, allow_nan=False))
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"{name} is not JSON: {e}") from None
        elif isinstance(config, (str, os.PathLike)):
            if not os.path.isfile(config):
                raise InvalidArgument(f"{name} '{printable(os.fspath(config))}' is not a file")
            try:
                with open(config, encoding="utf-8") as f:
                    raw = json.load(f)
            except (OSError, ValueError) as e:
                raise InvalidArgument(f"{name} '{printable(os.fspath(config))}': {e}") from None
        else:
            raise TypeError(f"{name} must be a path or a dict, not {type(config).__name__}")
        return raw

    def _refusals(self):
        """{row index: why the config checker refuses that row's config}. The base config is checked through
        its rows: its own placement may be one a row replaces (int8 moments beside a device optimizer). When it
        refuses every row, the config itself is wrong (a misspelled key): an error naming it."""
        refused, first = {}, None
        for i, row in enumerate(self.rows):
            if row.unsupported_reason():
                continue
            issues = strata_config.check(row.config(self.base, self.nvme_path or ""))
            errors = [issue.text for issue in issues if issue.severity == "error"]
            if errors:
                refused[i] = "the config refuses this placement: " + "; ".join(errors)
                first = first or (row, errors)
        runnable = [i for i, row in enumerate(self.rows) if not row.unsupported_reason()]
        if runnable and all(i in refused for i in runnable):
            row, errors = first
            raise InvalidArgument(f"{self.names['config']} is refused with every row ({row.label()}: "
                                  f"{'; '.join(errors)})")
        return refused

    def _dtype(self, dtype):
        if dtype is None:
            for key in ("bf16", "fp16"):
                section = (self.base or {}).get(key)
                if isinstance(section, dict) and section.get("enabled") is True:
                    return key
            return "fp32"
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise InvalidArgument(f"{self.names['dtype']} {printable(short_repr(dtype))} is not fp32, bf16 or fp16")
        return DTYPES[dtype]

    def _rows(self, rows):
        if rows is None:
            return default_rows(self.dtype)
        if isinstance(rows, (str, os.PathLike)):
            try:
                return load_rows_file(rows, self.dtype)
            except InvalidArgument as e:
                raise InvalidArgument(f"{self.names['rows']}: {e}") from None
        if isinstance(rows, (list, tuple)):
            return rows_from_list(list(rows), "", self.dtype)
        raise TypeError(f"{self.names['rows']} must be a row file's path or a list of row dicts such as "
                        f"[{{'stage': 3, 'offload_optimizer': 'cpu'}}], not {type(rows).__name__}")

    def _nvme_path(self, nvme_path):
        if not any(r.uses_nvme() and not r.unsupported_reason() for r in self.rows):
            return (os.fspath(nvme_path) if nvme_path is not None else None), self.names["nvme_path"]
        if nvme_path is not None:
            path = os.fspath(nvme_path)
            if not os.path.isdir(path):
                raise InvalidArgument(f"{self.names['nvme_path']} '{printable(path)}' is not a folder")
            return path, self.names["nvme_path"]
        path, origin = _default_nvme_dir()
        if not os.path.isdir(path):
            raise InvalidArgument(f"the NVMe rows' folder '{printable(path)}' ({origin}) is not a folder; give "
                                  f"{self.names['nvme_path']} DIR (a folder on the NVMe drive) or set STRATA_NVME_DIR")
        return path, origin

    def _random_tokens(self, config):
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise InvalidArgument(f"{self.names['batch']} is needed: the model has no config.vocab_size to draw "
                                  f"random tokens from")
        positions = next((getattr(config, k) for k in ("n_positions", "max_position_embeddings")
                          if isinstance(getattr(config, k, None), int)), None)
        samples, seq = self.token_shape
        seq = seq if seq is not None else min(64, positions or 64)
        if positions is not None and seq > positions:
            raise InvalidArgument(f"--seq {seq} is longer than the model's {positions} positions")
        return token_batches(vocab, samples or 2, seq, seed=self.seed)

    def _probe(self):
        """The model built once (its size and name for the report) and micro-batch 0 checked, so that a broken
        model_fn or batch_fn is named before the first row, not reported as every row failing."""
        torch.manual_seed(self.seed)
        model = _model_of(self.model_fn(), self.names["model"])
        params = sum(p.numel() for p in model.parameters())
        config = getattr(model, "config", None)
        model_info = {"describe": f"{type(model).__name__} ({params / 1e6:.2f}M parameters)",
                      "class": type(model).__name__, "params": params, "source": self.source,
                      "model_type": getattr(config, "model_type", None)}
        del model
        if self.batch_fn is None:
            self.batch_fn = self._random_tokens(config)
        model_info["batches"] = getattr(self.batch_fn, "describe", None)
        micro_batch = self.batch_fn(0)
        first = _first_tensor(micro_batch)
        if first is None:
            raise TypeError(f"{self.names['batch']}(0) returned {type(micro_batch).__name__} with no tensor in it: "
                            f"return a tensor, a tuple or list of tensors, or a dict such as {{'input_ids': ids}}")
        samples = first.shape[0] if first.dim() > 0 else 1
        tokens = _tokens_of(micro_batch)
        seq = tokens // samples if tokens is not None and samples else None
        return model_info, samples, tokens, seq

    # -- running --------------------------------------------------------------------------------------
    def run(self):
        import strata.torch as st

        model_info, samples, tokens, seq = self._probe()
        if self.base is None:
            self.base = {"train_micro_batch_size_per_gpu": samples, "gradient_accumulation_steps": 1,
                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}}
        results = [_RowResult(row) for row in self.rows]
        for i, r in enumerate(results):
            why = r.row.unsupported_reason() or self.refused.get(i, "")
            if why:
                r.status, r.reason = "skipped", why
        runnable = sum(r.status == "pending" for r in results)
        self._say(f"bench offload (strata.torch): {model_info['describe']}, micro-batch {samples} sample(s)"
                  + (f" x {seq} tokens" if seq else "") + f", {self.warmup} warm-up + {self.steps} measured steps x "
                  f"{self.repeats} repeats, {len(results)} rows ({runnable} runnable, ABBA order)")
        if self.nvme_path is not None and any(r.row.uses_nvme() for r in results if r.status == "pending"):
            self._say(f"nvme     the NVMe rows swap under {self.nvme_path} ({self.nvme_origin})")
        schedule, world, device, device_setting = [], 1, None, None
        for repeat in range(self.repeats):
            order = []
            for index in abba_order(len(results), repeat):
                r = results[index]
                if r.status not in ("pending", "ok"):
                    continue
                order.append(index)
                started = time.perf_counter()
                try:
                    world, device, device_setting = self._run_once(st, r)
                    r.status = "ok"
                except (OutOfMemory, ResourceExhausted) as e:
                    r.status, r.reason = "does_not_fit", str(e)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as e:  # reported in the row; the bench goes on with the others
                    r.status, r.reason = "failed", f"{type(e).__name__}: {e}"
                if r.status != "ok":
                    r.steps, r.wall_ms, r.tokens, r.repeat_median_ms = [], [], [], []
                took = time.perf_counter() - started
                self._say(f"  repeat {repeat + 1}/{self.repeats}  {r.row.label():<45} "
                          + (f"{r.repeat_median_ms[-1]:.2f} ms/step ({took:.1f} s)" if r.status == "ok" else r.status))
            schedule.append(order)
        doc = self._document(results, schedule, model_info, samples, tokens, seq, world, device, device_setting)
        if self.verbose:
            report.print_table(doc)
        self._write(doc)
        return doc

    def _micro_batches(self, step, gas):
        """The step's micro-batches as batch_fn makes them (a list of gas, or the one)."""
        batches = [self.batch_fn(step * gas + k) for k in range(gas)]
        return batches if gas > 1 else batches[0]

    def _run_once(self, st, r):
        """One run of one row: a fresh model and engine, warm-up steps, measured steps back to back."""
        torch.manual_seed(self.seed)
        model = _model_of(self.model_fn(), self.names["model"])
        engine = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine, _, _, _ = st.initialize(model=model, config=r.row.config(self.base, self.nvme_path or ""),
                                                device_memory=self.device_memory)
            for w in caught:
                if str(w.message) not in r.warnings:
                    r.warnings.append(str(w.message))
            gas = engine.gradient_accumulation_steps()
            measured = []
            for step in range(self.warmup + self.steps):
                # As a training loop moves its batches (batch.to(engine.device)): made on the CPU, trained on the GPU.
                batches = to_device(self._micro_batches(step, gas), engine.device)
                started = time.perf_counter()
                engine.train_batch(batches=batches, loss_fn=self.loss_fn, retries=0)
                wall = (time.perf_counter() - started) * 1e3
                if step >= self.warmup:
                    counts = [_tokens_of(b) for b in (batches if gas > 1 else [batches])]
                    tokens = None if None in counts else sum(counts) * engine.world_size
                    measured.append((dict(engine.metrics), wall, tokens))
            engine.synchronize()
            r.predicted = engine.memory()["predicted"]
            r.engine = engine._engine.describe()
            r.steps += [m for m, _, _ in measured]
            r.wall_ms += [w for _, w, _ in measured]
            r.tokens += [t for _, _, t in measured]
            r.repeat_median_ms.append(statistics.median(float(m["step_ms"]) for m, _, _ in measured))
            return engine.world_size, engine.device.type, engine.config.get("strata", {}).get("device")
        finally:
            if engine is not None:
                engine.remove_hooks()
            del engine, model
            gc.collect()

    # -- the report ---------------------------------------------------------------------------------------
    def _document(self, results, schedule, model_info, samples, tokens, seq, world, device, device_setting):
        ran = [i for i, r in enumerate(results) if r.status == "ok"]
        medians = {i: statistics.median(float(m["step_ms"]) for m in results[i].steps) for i in ran}
        baseline = min(ran, key=lambda i: medians[i]) if ran else None
        doc = {"bench": "offload", "front_end": "strata.torch",
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model_info, "device": device,
               "device_setting": device_setting, "torch": torch.__version__, "ranks": world, "batch": samples,
               "seq": seq, "tokens_per_micro_batch": tokens, "warmup": self.warmup, "steps": self.steps,
               "repeats": self.repeats, "dtype": self.dtype, "device_memory_bytes": self.device_memory,
               "nvme_path": self.nvme_path, "seed": self.seed, "config": self.base, "schedule": schedule,
               "baseline_row": baseline,
               "rows": [report.row_json(i, r, medians[baseline] if baseline is not None else None)
                        for i, r in enumerate(results)]}
        for j, r in zip(doc["rows"], results):
            if r.warnings:
                j["warnings"] = r.warnings
        return doc

    def _write(self, doc):
        text = json.dumps(doc, indent=2) + "\n"
        if "json" in self.outputs:
            with open(self.outputs["json"], "w", encoding="utf-8") as f:
                f.write(text)
        if "csv" in self.outputs:
            report.write_csv(self.outputs["csv"], doc)
        if "plot" in self.outputs:
            json_for_plot = self.outputs.get("json")
            if json_for_plot is None:
                json_for_plot = self.outputs["plot"] + ".json"
                with open(json_for_plot, "w", encoding="utf-8") as f:
                    f.write(text)
            try:
                if any(r["status"] == "ok" for r in doc["rows"]):
                    report.draw_plot(self.plot_tool, json_for_plot, self.outputs["plot"])
                    self._say(f"plot     {self.outputs['plot']}")
                else:
                    self._say(f"plot     not drawn: no row ran ({self.outputs['plot']} not written)")
            finally:
                if "json" not in self.outputs:
                    os.remove(json_for_plot)

    def _say(self, line):
        if self.verbose:
            print(line, flush=True)


# -- the command line ---------------------------------------------------------------------------------------
def _import_callable(spec, flag):
    """'package.module:function' -> the function; errors name the flag."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidArgument(f"{flag} '{printable(spec)}' is not module:function (e.g. mymodels:build)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` and `python script.py` find the user's modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidArgument(f"{flag} '{printable(spec)}': cannot import {module_name}: {e}") from None
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise InvalidArgument(f"{flag} '{printable(spec)}': {module_name} has no '{printable(attribute)}'")
        found = getattr(found, part)
    if not callable(found):
        raise InvalidArgument(f"{flag} '{printable(spec)}': {attribute} is a {type(found).__name__}, not a callable")
    return found


def _hf_config(spec, overrides):
    """A Hugging Face config from a config.json file, a folder holding one, a model type (gpt2, llama: the
    architecture's defaults) or a hub name, with --set's attributes changed."""
    try:
        import transformers
    except ImportError:
        raise InvalidArgument(f"--model '{printable(spec)}' names a Hugging Face config, and transformers is not "
                              f"installed: pip install transformers (or give --model module:function)") from None
    try:
        if os.path.isdir(spec) or os.path.isfile(spec):
            path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
            if not isinstance(values, dict) or "model_type" not in values:
                raise InvalidArgument(f"--model '{printable(spec)}': {printable(path)} has no \"model_type\"; is it a "
                                      f"Hugging Face config.json?")
            config = transformers.AutoConfig.for_model(**values)
        elif spec in transformers.CONFIG_MAPPING:
            config = transformers.AutoConfig.for_model(spec)
        else:
            config = transformers.AutoConfig.from_pretrained(spec)
    except InvalidArgument:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgument(f"--model '{printable(spec)}' is not a config.json, a folder with one, a model type "
                              f"(gpt2, llama, ...) or a hub name this machine can read: {e}") from None
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"--set '{printable(item)}' is not KEY=VALUE (e.g. --set n_layer=2)")
        if not hasattr(config, key):
            raise InvalidArgument(f"--set {printable(key)}: {type(config).__name__} has no attribute "
                                  f"'{printable(key)}'")
        try:
            value = json.loads(text)
        except ValueError:
            value = text  # a bare string such as gelu_new
        setattr(config, key, value)
    return config


def _positive(low, high):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {low}..{high}")
        return value
    return parse


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m strata.torch.bench", allow_abbrev=False,
        description="What each placement of the training state costs for your model: every placement row "
                    "(or --rows FILE), repeats in ABBA order, the median step, the penalty against the fastest "
                    "row, exposed waits, bytes per link, peaks against the plan (docs/torch.md).")
    p.add_argument("--model", required=True,
                   help="module:function that builds the nn.Module (or returns a Hugging Face config), or a Hugging "
                        "Face config: a config.json, a folder with one, a model type (gpt2, llama) or a hub name")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a Hugging Face config's attribute (repeatable), e.g. --set n_layer=2")
    p.add_argument("--batch", help="module:function: batch_fn(i) -> the i-th micro-batch (default for a model "
                                   "with config.vocab_size: random tokens, --batch-size x --seq)")
    p.add_argument("--batch-size", type=_positive(1, 1 << 16), help="samples per micro-batch of the random tokens "
                                                                    "(default 2)")
    p.add_argument("--seq", type=_positive(1, 1 << 24), help="tokens per sample of the random tokens (default 64, "
                                                             "at most the model's positions)")
    p.add_argument("--loss", help="module:function: loss_fn(output, micro_batch) -> loss (default: output.loss)")
    p.add_argument("--config", help="DeepSpeed config every row starts from (default: AdamW lr 1e-4)")
    p.add_argument("--rows", help="row file (strata bench offload --configs' format) instead of the default matrix")
    p.add_argument("--dtype", help="parameter dtype of rows without their own: fp32, bf16, fp16 (default: the "
                                   "config's precision)")
    p.add_argument("--steps", type=_positive(1, 100000), default=3, help="measured steps per row and repeat (3)")
    p.add_argument("--warmup", type=_positive(0, 100000), default=1, help="warm-up steps per row and repeat (1)")
    p.add_argument("--repeats", type=_positive(1, 10000), default=3, help="repeats, in ABBA order (3)")
    p.add_argument("--device-memory", help="the engine's device cap, e.g. 64MiB (rows that do not fit are "
                                           "reported with the engine's reason)")
    p.add_argument("--nvme-path", help="folder for the NVMe rows (default $STRATA_NVME_DIR, else $TMPDIR, else /tmp)")
    p.add_argument("--seed", type=_positive(0, (1 << 63) - 1), default=0, help="torch seed of every model build (0)")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--csv", help="write one CSV line per row")
    p.add_argument("--plot", help="draw a PNG with scripts/plot_offload.py (needs matplotlib)")
    p.add_argument("--plot-script", help="the plotting script (default: plot_offload.py staged with strata.torch)")
    p.add_argument("--quiet", action="store_true", help="only errors and the output files")
    return p


def _cli_bench(args):
    flagged = _CLI_NAMES
    if ":" in args.model and not os.path.exists(args.model):
        if args.set:
            raise InvalidArgument(f"--set is for a Hugging Face config, and --model '{printable(args.model)}' is "
                                  f"module:function: set the values in your function")
        model_fn = _import_callable(args.model, "--model")
    else:
        model_fn = _hf_config(args.model, args.set)
    if args.batch is not None:
        if args.batch_size is not None or args.seq is not None:
            raise InvalidArgument("--batch-size and --seq shape the random tokens, and --batch makes its own "
                                  "batches: give one of the two")
        batch_fn = _import_callable(args.batch, "--batch")
    else:
        batch_fn = None  # random tokens of the model's vocabulary, --batch-size x --seq
    loss_fn = _import_callable(args.loss, "--loss") if args.loss is not None else None
    return _Bench(flagged, model_fn, batch_fn, args.config, args.rows, args.steps, args.warmup, args.repeats,
                  loss_fn, args.dtype, args.device_memory or 0, args.nvme_path, args.seed, args.json, args.csv,
                  args.plot, args.plot_script, verbose=not args.quiet, source=args.model,
                  token_shape=(args.batch_size, args.seq))


def main(argv=None):
    """`python -m strata.torch.bench`: 0 when every row ran (or was skipped / did not fit), 1 when a row
    failed, 2 for bad input."""
    args = _parser().parse_args(argv)
    try:
        bench = _cli_bench(args)
        doc = bench.run()
    except (InvalidArgument, TypeError, StrataError) as e:
        print(f"python -m strata.torch.bench: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (InvalidArgument, TypeError)) else 1
    failed = [r["label"] for r in doc["rows"] if r["status"] == "failed"]
    if failed:
        print(f"python -m strata.torch.bench: error: {len(failed)} row(s) failed: {', '.join(failed)} (their "
              f"reasons are in the table and the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
