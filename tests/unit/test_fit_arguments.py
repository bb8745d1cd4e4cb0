"""mpitrain.fit's arguments, the registry's resnet, and CIFAR batches that try to run
code (the readers' and the model specs' other cases: test_user_data.py,
test_model_spec.py)."""

import pickle

import numpy as np
import pytest

from conftest import write_cifar
from mpitrain import api, data, models
from mpitrain.errors import DataError, UsageError
from unit.test_data import OneRank


def test_hostile_cifar_batch_is_refused_not_run(tmp_path, capsys):
    write_cifar(tmp_path)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with open(tmp_path / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(DataError, match="data_batch_3: .*builtins.print"):
        data.read_user_data(str(tmp_path))
    assert "pwned" not in capsys.readouterr().out


def test_resnet_is_resnet20():
    model = models.get("resnet").build((32, 32, 3), 10)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert trainable == 272474 and model.non_trainable_weights  # BatchNorm statistics


# ---- mpitrain.fit's arguments ------------------------------------------------------------------
def test_fit_arguments(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")  # as under mpirun -np 3
    x, y = np.zeros((4, 3)), np.array([0, 1, 0, 1])
    with pytest.raises(UsageError, match="unknown option.*epoch_count"):
        api._config("lr", (x, y), (x, y), "sync", None, {"epoch_count": 3})
    with pytest.raises(UsageError, match="mode must be one of sync, async"):
        api._config("lr", (x, y), (x, y), "fast", None, {})
    with pytest.raises(UsageError, match="train=.*or data=PATH"):
        api._config("lr", (x, y), None, "sync", None, {})

    def build(input_shape, num_classes):
        return None
    cfg, explicit, spec, arrays = api._config(build, (x, y), (x, y), "async", None,
                                              {"epochs": 2})
    assert cfg.async_mode and cfg.epochs == 2 and cfg.data.path == data.GIVEN_ARRAYS
    assert cfg.world_size == 3 and cfg.optimizer.name == "adam"  # built: a user's defaults
    assert cfg.model.endswith(":test_fit_arguments.<locals>.build") and spec.name == cfg.model
    assert {"epochs", "async_mode", "data"} <= explicit
    ds = data.load("auto", None, OneRank(), arrays=arrays)
    assert (ds.name, ds.input_shape, ds.num_classes) == ("arrays", (3,), 2)


def test_the_arrays_of_a_fit_run_are_not_read_from_the_command_line():
    """A run of mpitrain.fit records its arrays by a name no file has: resuming it
    outside its script is one line saying where it can be resumed."""
    with pytest.raises(DataError, match="arrays its script handed to mpitrain.fit, which "
                                        "only that script has: resume it from the script"):
        data.load("auto", None, OneRank(), user_data=data.GIVEN_ARRAYS)
