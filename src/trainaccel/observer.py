"""The step observer: one per DDP model, the one place that decides when a training step begins.

`observe(model)` gives a DDP model its observer, `model.trainaccel`: one forward pre-hook, one state-dict
hook, and every feature's state for that model. Features subscribe to its events instead of hooking the
model or torch themselves:

- `step_begin(observer, args, kwargs)`: a training forward (gradients on, whatever the modules' mode: DDP prepares
  its gradient exchange at every such forward); `observer.step` counts them.
- `eval(observer, args, kwargs)`: a forward with gradients off.
- `after_backward(observer)`: `loss.backward()` returned in a step (seen once some feature calls `watch_backward`).
- `before_optimizer_step(observer, optimizer)`: an optimizer holding the model's parameters is about to step.
- `after_optimizer_step(observer, optimizer)`: an optimizer holding the model's parameters stepped.
- `state_dict(observer, destination, prefix, metadata)`: the model's module built its state dict.

Process-wide, one pair of torch's global optimizer step hooks and one `Tensor.backward` wrapper feed
these events and the process-wide watchers (`watch_optimizer_steps`, `watch_backward`), all
registered with `context` so that `trainaccel.shutdown()` removes them. Hooks on a module are `OwnHook`s: they
act on their own module only, so a copy of it (`copy.deepcopy` for an EMA, pickle) carries none that acts.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from trainaccel import context

EVENTS = ("step_begin", "eval", "after_backward", "before_optimizer_step", "after_optimizer_step", "state_dict")

_observers: weakref.WeakSet[StepObserver] = weakref.WeakSet()
_by_module: weakref.WeakKeyDictionary[torch.nn.Module, StepObserver] = weakref.WeakKeyDictionary()
_optimizer_watchers: dict[str, list[Callable[..., Any]]] = {"before": [], "after": []}
_backward_watchers: dict[str, list[Callable[..., Any]]] = {"before": [], "after": []}
_held: weakref.WeakKeyDictionary[Any, tuple[int, frozenset[int]]] = weakref.WeakKeyDictionary()
_furthest = 0  # the furthest step any observer of this process began (read by the heartbeat thread)
_forwards = 0  # forwards of observed models, training or not: a rank evaluating alone is busy, not hung


class StepObserver:
    """Everything trainaccel keeps for one DDP model, and the events of its training loop."""

    __slots__ = {
        "model": "a weak reference to the DDP model (which holds this observer)",
        "step": "training steps begun, i.e. training forwards: the one step counter (heartbeats, monitors, timeline)",
        "optimizer_steps": "steps of optimizers holding the model's parameters (None once detached: unknown)",
        "entered": "perf_counter() when this forward's pre-hook began: monitors leave their own time out",
        "compiled": "the DDP model is compiled: its forwards are counted here, not by a hook inside the graph",
        "comm": "the communication hook's state (CommState or Autotuner), None without trainaccel's hook",
        "amp": "zero-code AMP's state, None when the model is not autocast",
        "meter": "the StepMeter of metrics_every, or None",
        "stragglers": "the StragglerDetector of straggler_every, or None",
        "local_steps": "the LocalSteps holding this model's reductions back, or None",
        "diloco": "the DiLoCo of sync_every replacing the model's gradient exchange, or None",
        "survivors": "per-step DDP under on_lost_replica=continue: its exchange among the replicas present, or None",
        "_subscribers": "event -> callbacks, called in subscription order",
        "_undo": "what to undo when detached: hook removals, the model's patched forward",
        "_params": "ids of the model's parameters: which optimizers step it",
        "chain": "the wrapped module and the wrappers inside it (weakly): the last one's mode is the model's mode",
        "_backward_due": "a step began and its backward has not been seen yet",
        "__weakref__": "so that process-wide tables do not keep models alive",
    }

    def __init__(self, model: torch.nn.Module, compiled: bool):
        self.model = weakref.ref(model)
        self.step, self.optimizer_steps, self.entered, self.compiled = 0, 0, 0.0, compiled
        self.comm = self.amp = self.meter = self.stragglers = self.local_steps = self.diloco = self.survivors = None
        self._subscribers: dict[str, list[Callable[..., Any]]] = {event: [] for event in EVENTS}
        self._params = frozenset(id(p) for p in model.parameters())
        self._backward_due = False
        self.chain = [weakref.ref(m) for m in wrapper_chain(getattr(model, "module", model))]
        before_forward = functools.partial(_before_forward, weakref.ref(self))
        if compiled:
            # Untraced: the counters and the features' collectives change every step, and a compiled frame
            # would be specialised (and recompiled) on them. Importing TorchDynamo only for this would slow
            # every start, so runs that do not compile skip it.
            before_forward = torch.compiler.disable(before_forward)
        module = getattr(model, "module", model)
        # The state-dict hook sits on the innermost wrapper: a framework may save that module alone (Lightning saves
        # its LightningModule, inside the module DDP wraps), and the outer ones' state dicts reach it too.
        innermost = self.chain[-1]()
        self._undo: list[Callable[[], Any]] = [
            model.register_forward_pre_hook(OwnHook(model, before_forward), with_kwargs=True).remove,
            innermost.register_state_dict_post_hook(
                OwnHook(innermost, functools.partial(_after_state_dict, weakref.ref(self)))
            ).remove,
        ]
        if not compiled:
            # Forwards are counted on the wrapped module, which also runs in evaluations that bypass the DDP model;
            # compiled, a hook there would split the graph, so the DDP model's own forwards are counted instead.
            self._undo.append(module.register_forward_pre_hook(OwnHook(module, _count_forward)).remove)

    def training_mode(self) -> bool:
        """The model's mode as the script last set it: the innermost wrapper's, which `train()`/`eval()` on the DDP
        model, its module or a framework's inner module (Lightning switches only its LightningModule) all reach."""
        innermost = self.chain[-1]()
        return innermost.training if innermost is not None else False

    def holds(self, parameter: torch.Tensor) -> bool:
        """Whether `parameter` is one of the model's."""
        return id(parameter) in self._params

    def subscribe(self, event: str, callback: Callable[..., Any]) -> Callable[[], None]:
        """Call `callback(observer, ...)` at each `event`; returns a function that unsubscribes it."""
        if event not in self._subscribers:
            raise ValueError(f"invalid event {event!r}; accepted: {', '.join(EVENTS)}")
        self._subscribers[event].append(callback)
        return functools.partial(_discard, self._subscribers[event], callback)

    def subscribers(self, event: str) -> tuple[Callable[..., Any], ...]:
        return tuple(self._subscribers[event])

    def emit(self, event: str, *args: Any) -> None:
        for callback in list(self._subscribers[event]):  # a callback may unsubscribe itself
            callback(self, *args)

    def on_detach(self, undo: Callable[[], Any]) -> None:
        """Run `undo` when the observer is detached (a feature's change to the model)."""
        self._undo.append(undo)

    def detach(self) -> None:
        """Stop observing: hooks removed, no more events (`shutdown()`); the features' state stays readable."""
        while self._undo:
            self._undo.pop()()
        for callbacks in self._subscribers.values():
            callbacks.clear()
        self.optimizer_steps = None
        _observers.discard(self)


class OwnHook:
    """A module hook that acts on its own module only: a copy of the module (deepcopy, pickle) gets an inert one."""

    __slots__ = ("owner", "hook", "_from_public_api")  # torch marks state-dict hooks it registers publicly

    def __init__(self, owner: torch.nn.Module, hook: Callable[..., Any]):
        self.owner, self.hook = weakref.ref(owner), hook

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if module is self.owner():
            return self.hook(module, *args, **kwargs)
        return None

    def __reduce__(self) -> tuple:
        return (_inert, ())

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _inert()


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _inert() -> Callable[..., None]:
    return _nothing


def wrapper_chain(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module` (the one a DDP model wraps), then each module inside that only wraps one other (no parameters or
    buffers of its own): Lightning's wrapper around the LightningModule, for one. The last one's mode is the model's."""
    chain = [module]
    while True:
        children = list(module.children())
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if len(children) != 1 or own:
            return chain
        module = children[0]
        chain.append(module)


def _discard(callbacks: list[Callable[..., Any]], callback: Callable[..., Any]) -> None:
    if callback in callbacks:
        callbacks.remove(callback)


def observe(model: torch.nn.Module, compiled: bool = False) -> StepObserver:
    """`model.trainaccel`, created on first use (`compiled`: keep the hook out of compiled graphs)."""
    observer = observer_of(model)
    if observer is None:
        compiled = compiled or "torch._dynamo" in sys.modules
        observer = StepObserver(model, compiled)
        model.trainaccel = observer
        context.note_taken(type(model).__name__)
        _observers.add(observer)
        for ref in observer.chain:
            _by_module[ref()] = observer
        _watch_optimizers()
        if context.first_time("step observers"):
            context.on_undo("step observers", _detach_all)
    return observer


def observed() -> bool:
    """Whether any DDP model of this process is observed now."""
    return any(o.model() is not None for o in list(_observers))


def observer_of(model: torch.nn.Module) -> StepObserver | None:
    """The observer of a DDP model, or of the DDP model wrapping this module; None if there is none."""
    observer = model.__dict__.get("trainaccel")
    if isinstance(observer, StepObserver):
        return observer
    return _by_module.get(model)


def _detach_all() -> None:
    global _furthest, _forwards
    for observer in list(_observers):
        observer.detach()
    _furthest = _forwards = 0


def _count_forward(module: torch.nn.Module, args: tuple) -> None:
    global _forwards
    _forwards += 1


def _before_forward(ref: weakref.ref, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    observer = ref()
    if observer is None:
        return
    observer.entered = time.perf_counter()
    if observer.compiled:
        _count_forward(module, args)
    if torch.is_grad_enabled():
        # DDP prepares its gradient exchange at every forward with gradients on, whatever the mode: so is a step
        # counted here (Lightning leaves the DDP model in eval mode; some scripts train in eval mode throughout).
        global _furthest
        observer.step += 1
        _furthest = max(_furthest, observer.step)
        observer._backward_due = True
        observer.emit("step_begin", args, kwargs)
    else:
        observer.emit("eval", args, kwargs)


def _after_state_dict(
    ref: weakref.ref, module: torch.nn.Module, destination: dict, prefix: str, metadata: dict
) -> None:
    observer = ref()
    if observer is not None:
        observer.emit("state_dict", destination, prefix, metadata)


def watch_optimizer_steps(
    before: Callable[[torch.optim.Optimizer], Any] | None = None,
    after: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> None:
    """Call `before(optimizer)` / `after(optimizer)` around every torch optimizer's step, until `shutdown()`."""
    _watch_optimizers()
    for when, callback in (("before", before), ("after", after)):
        if callback is not None and callback not in _optimizer_watchers[when]:
            _optimizer_watchers[when].append(callback)


def _watch_optimizers() -> None:
    """torch's global optimizer step hooks, once: they feed the process-wide watchers and every observer."""
    if not context.first_time("optimizer step hooks"):
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    handles = [
        register_optimizer_step_pre_hook(_before_optimizer_step),
        register_optimizer_step_post_hook(_after_optimizer_step),
    ]

    def remove() -> None:
        for handle in handles:
            handle.remove()
        for watchers in _optimizer_watchers.values():
            watchers.clear()
        _held.clear()

    context.on_undo("optimizer step hooks", remove)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for callback in list(_optimizer_watchers["before"]):
        callback(optimizer)
    for observer in _observers_of(optimizer):
        observer.emit("before_optimizer_step", optimizer)


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for callback in list(_optimizer_watchers["after"]):
        callback(optimizer)
    for observer in _observers_of(optimizer):
        observer.optimizer_steps += 1
        observer.emit("after_optimizer_step", optimizer)


def _observers_of(optimizer: torch.optim.Optimizer) -> list[StepObserver]:
    """The observers of the models whose parameters `optimizer` holds."""
    if not _observers:
        return []
    groups = optimizer.param_groups
    count = sum(len(g["params"]) for g in groups)
    seen, held = _held.get(optimizer, (-1, frozenset()))
    if seen != count:  # new or grown (add_param_group)
        held = frozenset(id(p) for g in groups for p in g["params"])
        _held[optimizer] = (count, held)
    # An observer can outlive its model, and a new model's parameters can take the ids of the old one's.
    return [o for o in list(_observers) if o.model() is not None and not held.isdisjoint(o._params)]


def watch_backward(
    before: Callable[[torch.Tensor], torch.Tensor] | None = None,
    after: Callable[[torch.Tensor], Any] | None = None,
) -> None:
    """Around `loss.backward()` (a scalar's, no gradient given), until `shutdown()`: `before(loss)` returns the
    tensor to backpropagate (a scaled loss), `after(loss)` sees it done; observers then emit `after_backward`."""
    if context.first_time("backward watchers"):
        original = torch.Tensor.backward

        @functools.wraps(original)
        def backward(self: torch.Tensor, gradient: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
            if gradient is not None or self.numel() != 1:
                return original(self, gradient, *args, **kwargs)
            loss = self
            for callback in list(_backward_watchers["before"]):
                loss = callback(loss)
            result = original(loss, gradient, *args, **kwargs)
            for callback in list(_backward_watchers["after"]):
                callback(loss)
            for observer in list(_observers):
                if observer._backward_due:
                    observer._backward_due = False
                    observer.emit("after_backward")
            return result

        context.patch(torch.Tensor, "backward", backward)
        context.on_undo("backward watchers", lambda: [w.clear() for w in _backward_watchers.values()])
    for when, callback in (("before", before), ("after", after)):
        if callback is not None and callback not in _backward_watchers[when]:
            _backward_watchers[when].append(callback)


def process_step() -> int:
    """The furthest step of this process's observed models (what heartbeats report)."""
    return _furthest


def process_forwards() -> int:
    """Forwards of this process's observed models so far, training or not (what heartbeats report)."""
    return _forwards
