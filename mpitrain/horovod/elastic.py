"""``hvd.elastic``: Horovod's elastic API, where a change of the job's hosts restarts it.

Horovod keeps its processes through a change of membership: the workers roll back to
the state's last ``commit()`` (a failure) or stop at the next one (hosts added), meet
again at the new size and broadcast the state from rank 0. An MPI job cannot change
its size while it runs, so here the change is a restart at the new size, as torchrun
does it, and the state object carries the training across it. A script written for
Horovod elastic runs unchanged:

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0)
    state.register_reset_callbacks([lambda: optimizer.learning_rate.assign(lr * hvd.size())])
    train(state)

Under ``mpitrain launch -np MIN:MAX script.py`` (or with a discovery script) the
launcher gives every attempt the path of a state file ($MPITRAIN_ELASTIC_STATE):

* ``state.commit()`` saves the state in memory, as Horovod's does, and rank 0 writes
  the committed state to that file at most every PERSIST_EVERY seconds. Then the
  ranks agree (one small allreduce) whether the launcher asked them to stop (SIGUSR1,
  which mpirun forwards to every rank: a host came back, or a stop was asked for):
  then rank 0 writes the state, and every rank exits with 143 at the same commit. The
  launcher restarts the script at the new size.
* ``@hvd.elastic.run``: on entry, rank 0 reads the file if an attempt before wrote one;
  ``state.sync()`` gives every rank rank 0's state; after a state was read, the reset
  callbacks run (they rescale what follows the size, e.g. the learning rate).
* A failure (a rank or a host lost) ends the job, and the restart resumes from the last
  state written: what is lost is the steps since then (Horovod loses those since the
  last commit).

The state lives as long as the launch (a launch of its own starts afresh, as Horovod's
in-memory state does; resume across launches from the script's own checkpoints).
Under plain mpirun nothing is written and nothing stops: ``run`` calls the function
once, and ``commit`` saves in memory only.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from ..atomic import atomic_file
from ..results.run_dir import ELASTIC_ENV
from .ops import Max, allreduce, broadcast_object
from .variables import broadcast_variables
from .world import stop_every_rank, topology

#: the shortest time between two writes of the committed state (a failure loses at most
#: this much more than Horovod would); a stop always writes
PERSIST_EVERY = float(os.environ.get("MPITRAIN_ELASTIC_PERSIST_EVERY", "10"))


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that failed as a rank was lost. Here the job
    ends instead and ``mpitrain launch`` restarts it; never raised, provided for the
    scripts that catch it."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's interrupt when hosts were added or removed. Here the ranks exit at the
    commit instead (the launcher restarts them); never raised, provided for the
    scripts that catch it."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class _StopRequest:
    """Whether this rank was asked to stop (SIGUSR1, under mpitrain launch only)."""

    def __init__(self) -> None:
        self.asked = False

    def install(self) -> None:
        try:
            signal.signal(signal.SIGUSR1, self._ask)
        except ValueError:  # (not the main thread: the stop is then not seen)
            pass

    def _ask(self, signum, frame) -> None:
        self.asked = True


_STOP = _StopRequest()


class State:
    """Horovod's ``State``: what a reset carries. Subclasses say how to ``save`` (in
    memory), ``restore``, ``sync`` (from rank 0) and, here, ``snapshot``/``load`` (the
    committed state as plain Python and numpy, for the state file)."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank=None):
        self._bcast_object = bcast_object
        self._reset_callbacks: List[Callable[[], None]] = []
        self._persisted = -float("inf")

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions to call after a reset (the job restarted at another size, its state
        read back), e.g. to scale the learning rate with the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory; under mpitrain launch, write it (at most every
        PERSIST_EVERY s) and stop every rank here if the launcher asked (exit 143).
        Collective: every rank commits at the same points."""
        self.save()
        self._write_or_stop(time.monotonic() - self._persisted >= PERSIST_EVERY)

    def check_host_updates(self) -> None:
        """Stop every rank (exit 143, the state written) if any was asked to; collective."""
        self._write_or_stop(False)

    def _write_or_stop(self, due: bool) -> None:
        """Under mpitrain launch: write the committed state if ``due`` or a stop was
        asked of any rank (written once), then stop every rank if it was."""
        path = os.environ.get(ELASTIC_ENV)
        if not path:
            return
        asked = int(allreduce(np.int32(_STOP.asked), op=Max, name="mpitrain.elastic.stop"))
        if due or asked:
            self._persist(path)
        if asked:
            stop_every_rank(f"stopped at a commit, the elastic state written to {path}")

    def _persist(self, path: str) -> None:
        if topology().rank == 0:
            with atomic_file(path, "wb") as f:
                pickle.dump({"size": topology().size, "state": self.snapshot()}, f,
                            protocol=pickle.HIGHEST_PROTOCOL)
        self._persisted = time.monotonic()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called on a reset before the callbacks; override to rebuild what the size
        decides."""

    def snapshot(self) -> dict:
        raise NotImplementedError

    def load(self, snapshot: dict) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Horovod's ``ObjectState``: the keyword arguments become attributes, committed,
    restored and synced (picklable values)."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank=None, **kwargs):
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def snapshot(self) -> dict:
        return {"attrs": dict(self._saved_state)}

    def load(self, snapshot: dict) -> None:
        self._saved_state = dict(snapshot["attrs"])
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def _values(variables) -> List[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables, values) -> None:
    if len(variables) != len(values):
        raise ValueError(f"hvd.elastic: the saved state has {len(values)} variable(s), this "
                         f"process {len(variables)}: build the model and the optimizer (one "
                         "step) before creating the state")
    for variable, value in zip(variables, values):
        variable.assign(value)


class _VariablesState(ObjectState):
    """Attributes and the variables :meth:`tracked` lists, committed, restored, synced
    from rank 0 and written as numpy arrays."""

    def __init__(self, **kwargs):
        self._values = _values(self.tracked())
        super().__init__(**kwargs)

    def tracked(self) -> list:
        raise NotImplementedError

    def _before_assigning(self, saved: int) -> None:
        """Make ``saved`` variables exist where they are made lazily (a hook)."""

    def save(self) -> None:
        self._values = _values(self.tracked())
        super().save()

    def restore(self) -> None:
        _assign(self.tracked(), self._values)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.tracked(), root_rank=0)
        self._values = _values(self.tracked())
        super().sync()

    def snapshot(self) -> dict:
        return {**super().snapshot(), "variables": self._values}

    def load(self, snapshot: dict) -> None:
        self._before_assigning(len(snapshot["variables"]))
        _assign(self.tracked(), snapshot["variables"])
        self._values = _values(self.tracked())
        super().load(snapshot)


class TensorFlowState(_VariablesState):
    """Horovod's ``TensorFlowState``: a list of variables (eager) and attributes."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("hvd.elastic.TensorFlowState needs its variables: TensorFlow 2 "
                             "has no global variables")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def tracked(self) -> list:
        return self.variables


def optimizer_variables(optimizer) -> list:
    """An optimizer's variables: Keras 3's list, or the method of older optimizers."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


class TensorFlowKerasState(_VariablesState):
    """Horovod's ``TensorFlowKerasState``: a built Keras model, its optimizer (the
    model's own by default) and attributes."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model, self.optimizer = model, optimizer or model.optimizer
        super().__init__(**kwargs)

    def tracked(self) -> list:
        return list(self.model.variables) + optimizer_variables(self.optimizer)

    def _before_assigning(self, saved: int) -> None:
        if len(self.tracked()) < saved and not getattr(self.optimizer, "built", True):
            self.optimizer.build(self.model.trainable_variables)  # (at its first step)

    def sync(self) -> None:
        built = getattr(self.optimizer, "built", True)
        if broadcast_object(built, root_rank=0) and not built:  # (rank 0's has its slots)
            self.optimizer.build(self.model.trainable_variables)
        super().sync()


def read_persisted(path: Optional[str]) -> Optional[dict]:
    """The state an attempt before wrote at ``path`` (rank 0 only), or None."""
    if not path or topology().rank != 0 or not Path(path).is_file():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def run(func):
    """Horovod's ``hvd.elastic.run``: call ``func(state, ...)`` after the state was
    brought to rank 0's (``state.sync()``), from the state an earlier attempt of the
    launch wrote if there is one (then the reset callbacks run: a restart is a reset).
    Collective: every rank calls it with its state."""
    def wrapper(state: State, *args, **kwargs):
        path = os.environ.get(ELASTIC_ENV)
        if path:
            _STOP.install()
        persisted = read_persisted(path)
        if persisted is not None:
            state.load(persisted["state"])
        resumed = bool(broadcast_object(persisted is not None, root_rank=0))
        state.sync()
        if resumed:
            if topology().rank == 0:
                print(f"mpitrain.horovod: the elastic state resumed from {path} "
                      f"(-np {persisted['size']} -> {topology().size})",  # type: ignore[index]
                      file=sys.stderr, flush=True)
            state.on_reset()
        return func(state, *args, **kwargs)

    wrapper.__name__ = getattr(func, "__name__", "run")
    wrapper.__doc__ = func.__doc__
    return wrapper
