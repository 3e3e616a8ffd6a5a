"""strata.torch.GatheredParameters: a module's parameters whole, outside
its forward, with DeepSpeed's signature.

Note [Gathered parameters]
Between steps the engine owns every parameter: at stage 3 the module's
parameters are empty placeholders, at stages 0-2 they view the engine's
copy. Inside `with GatheredParameters(params):` every engine layer holding
one of params is acquired for an evaluation pass (gathered at stage 3, read
from NVMe where it lives) and the module's parameters view it; on exit the
layers are released (placeholders again at stage 3).

modifier_rank=r: the values the parameters hold on rank r when the block
ends become the layers' values on every rank (the module's own init code
that writes weights in place, an embedding resized and filled, a
checkpoint's tensor copied in). Only before the first step: then the fp32
master weights are set from them too (moments are still zero), through the
engine's put_initial_layer. After training has begun the master weights
and moments own the values, and writing the 16-bit copy alone would be
undone by the next step (DeepSpeed's GatheredParameters loses such a change
silently); that is refused, naming the parameter.

Parameters that no strata engine manages are left as they are (DeepSpeed
does the same for parameters ZeRO does not partition).
"""

import weakref

import torch

from .errors import Unsupported

__all__ = ["GatheredParameters", "register_engine"]



def register_engine(engine):
    """Marks each of engine's parameters with (a weak reference to) its engine."""
    owner = weakref.ref(engine)
    for layer in engine._layers:
        for _, p in layer.plan.params:
            p._strata_engine = owner


def _owner(p):
    ref = getattr(p, "_strata_engine", None)
    return ref() if ref is not None else None


class GatheredParameters:
    """with GatheredParameters(params, modifier_rank=None): params whole
    inside the block (Note [Gathered parameters]). params: a parameter, or an
    iterable of them (e.g. module.parameters()). Every rank enters the block
    (the gathers are collectives)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if fwd_module is not None:
            raise Unsupported("fwd_module (registering parameters used outside their module) is not supported: "
                              "declare units so the module that uses a parameter owns it (initialize(units=...))")
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if params is not None else []
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.nn.Parameter):
                raise TypeError(f"params[{i}] is a {type(p).__name__}, not a torch.nn.Parameter")
        if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)):
            raise TypeError(f"modifier_rank must be a rank (int) or None, not {modifier_rank!r}")
        self.modifier_rank = modifier_rank
        self.enabled = bool(enabled)
        self.engine = None
        self.layers = []

    def __enter__(self):
        if not self.enabled:
            return self
        engines = {id(e): e for e in map(_owner, self.params) if e is not None}
        if not engines:
            return self
        if len(engines) > 1:
            raise Unsupported("GatheredParameters over parameters of two strata engines: gather each engine's "
                              "parameters in its own block")
        engine = next(iter(engines.values()))
        engine._guard.enter(engine, "GatheredParameters")  # held by this thread until the block ends
        try:
            return self._enter(engine)
        except BaseException:
            engine._guard.leave()
            raise

    def _enter(self, engine):
        if engine._engine.in_step or engine._pass is not None:
            raise engine._out_of_order("GatheredParameters inside a step or a forward: use it between steps (after "
                                       "engine.step() at a gradient accumulation boundary)")
        if self.modifier_rank is not None:
            if not 0 <= self.modifier_rank < engine.world_size:
                raise ValueError(f"modifier_rank {self.modifier_rank} is not a rank (0..{engine.world_size - 1})")
            if engine._engine.steps_begun > 0:
                name = engine._names[self.params[0]]
                raise Unsupported(f"GatheredParameters(modifier_rank=...) of '{name}' after training has begun: the "
                                  f"fp32 master weights and moments own the values and the next step would undo a "
                                  f"change to the parameter; modify parameters before the first step (or change the "
                                  f"model and start from a checkpoint)")
        self.engine = engine
        self.layers = sorted({engine._layer_of[p] for p in self.params if p in engine._layer_of})
        engine._engine.begin_evaluation()
        acquired = []
        try:
            for index in self.layers:
                engine._acquire(index, "eval")
                acquired.append(index)
        except BaseException:
            self.engine = None
            _release(engine, acquired)
            raise
        return self

    def __exit__(self, kind, value, traceback):
        engine = self.engine
        if engine is None:
            return False
        self.engine = None
        try:
            return self._exit(engine, kind)
        finally:
            engine._guard.leave()

    def _exit(self, engine, kind):
        values = None
        if self.modifier_rank is not None and kind is None:
            # What the block left in the parameters (changed in place, or .data replaced), copied before release.
            values = {index: [p.detach().clone() for _, p in engine._layers[index].plan.params]
                      for index in self.layers}
            for index, tensors in values.items():
                for (name, _), t, (_, shape, *_rest) in zip(engine._layers[index].plan.params, tensors,
                                                             engine._engine.layout(index)):
                    if list(t.shape) != list(shape):
                        _release(engine, self.layers)
                        raise ValueError(f"parameter '{name}' was given shape {list(t.shape)} inside "
                                         f"GatheredParameters; the engine's layer holds {list(shape)}: rebuild the "
                                         f"model with the new shape before initialize()")
        _release(engine, self.layers)
        if values is not None:
            for index, tensors in values.items():
                engine._engine.put_initial_layer(index, tensors, root=self.modifier_rank)
                if engine._layers[index].kept_whole:
                    engine._layers[index].bound = None  # rebound at its next acquire
        return False


def _release(engine, layers):
    for index in reversed(layers):
        engine._release(index, "eval")
    engine._engine.finish_evaluation(0.0, 1)
