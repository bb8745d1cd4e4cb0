"""The checkpoint's typed record of what the protocols save (CheckpointMeta): every field
survives a save and a load, and a checkpoint written by older mpitrain (an untyped
``extra`` dict, rank keys as strings, keys missing) loads with the documented defaults."""

import dataclasses
import json

import numpy as np
import pytest

from mpitrain.errors import ResultsError
from mpitrain.run.checkpoint import CHECKPOINT, Checkpoint, CheckpointMeta, Geometry


def write_old_format(run_dir, extra=None):
    """checkpoint.npz as mpitrain wrote it before the typed record: ``extra`` the dict
    the protocols built by hand (None: no ``extra`` key, as the first checkpoints)."""
    meta = {"step": 40, "wall_time_s": 3.5, "worker_steps": {"1": 21, "2": 19},
            "optimizer_keys": ["o0"]}
    if extra is not None:
        meta["extra"] = extra
    with open(run_dir / CHECKPOINT, "wb") as f:
        np.savez(f, weights=np.arange(4, dtype=np.float32), opt_o0=np.array(7),
                 meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))


def every_field_set() -> CheckpointMeta:
    """A record none of whose fields has its default (both protocols' fields at once:
    no protocol writes that, the format must carry it all the same)."""
    meta = CheckpointMeta.asynchronous(
        Geometry(world_size=4, batch_size=16, servers=2),
        staleness={2: {0: 5, 3: 1}, 3: {1: 4}},
        retired_staleness={3: {2: {0: 9}}}, extra_steps={2: 7, 3: -1}, updates_short=2,
        lost_workers=[{"rank": 4, "host": "node2", "update": 17, "reason": "silent"}],
    ).with_partition_staleness({1: {2: {0: 3}, 3: {4: 2}}})
    return dataclasses.replace(meta, rng={0: (1, 2**62), 5: (3, 4)})


def test_every_field_round_trips_through_the_file(tmp_path):
    meta = every_field_set()
    blank = CheckpointMeta()
    unset = [f.name for f in dataclasses.fields(meta)
             if getattr(meta, f.name) == getattr(blank, f.name)]
    assert unset == []  # a field added later is set here too, or this fails
    Checkpoint(np.ones(2, np.float32), {}, 9, 1.0, {2: 5, 3: 4}, meta).save(tmp_path)
    back = Checkpoint.load(tmp_path)
    assert back.meta == meta and back.worker_steps == {2: 5, 3: 4}


def test_an_old_format_checkpoint_loads_into_the_record(tmp_path):
    write_old_format(tmp_path, {  # an async checkpoint: all rank keys strings
        "staleness": {"1": {"0": 2, "1": 3}, "2": {"0": 4}},
        "retired_staleness": {"2": {"1": {"0": 6}}},
        "extra_steps": {"1": 5, "2": 0}, "updates_short": 1,
        "lost_workers": [{"rank": 3, "host": "h", "update": 8, "reason": "died"}],
        "geometry": {"world_size": 3, "batch_size": 8, "servers": 1}})
    ckpt = Checkpoint.load(tmp_path)
    assert (ckpt.step, ckpt.wall_time_s, ckpt.worker_steps) == (40, 3.5, {1: 21, 2: 19})
    assert ckpt.meta == CheckpointMeta(
        geometry=Geometry(3, 8, 1), staleness={1: {0: 2, 1: 3}, 2: {0: 4}},
        retired_staleness={2: {1: {0: 6}}}, extra_steps={1: 5, 2: 0}, updates_short=1,
        lost_workers=({"rank": 3, "host": "h", "update": 8, "reason": "died"},))


def test_keys_an_older_checkpoint_lacks_take_the_documented_defaults(tmp_path):
    # a sync checkpoint written before --servers: geometry without servers, the rest absent
    write_old_format(tmp_path, {"rng": {"0": [1, 2]}, "geometry": {"world_size": 2,
                                                                   "batch_size": 8}})
    assert Checkpoint.load(tmp_path).meta == CheckpointMeta(
        geometry=Geometry(2, 8, servers=1), rng={0: (1, 2)})
    # before geometry was recorded (the run's first session's units), and null values
    write_old_format(tmp_path, {"rng": None, "geometry": None})
    assert Checkpoint.load(tmp_path).meta == CheckpointMeta()
    write_old_format(tmp_path, None)  # no extra at all
    assert Checkpoint.load(tmp_path).meta == CheckpointMeta()


def test_the_file_keeps_the_layout_older_mpitrain_reads(tmp_path):
    """What older mpitrain's readers looked up (string rank keys, plain JSON values) is
    where they looked, so a checkpoint of this version resumes under an older one."""
    Checkpoint(np.ones(2, np.float32), {}, 9, 1.0, {}, every_field_set()).save(tmp_path)
    with np.load(tmp_path / CHECKPOINT) as f:
        extra = json.loads(f["meta"].tobytes().decode())["extra"]
    assert extra["geometry"] == {"world_size": 4, "batch_size": 16, "servers": 2}
    assert extra["rng"] == {"0": [1, 2**62], "5": [3, 4]}
    assert extra["staleness"]["2"] == {"0": 5, "3": 1}
    assert extra["partition_staleness"]["1"]["3"] == {"4": 2}
    assert extra["retired_staleness"] == {"3": {"2": {"0": 9}}}
    assert extra["extra_steps"] == {"2": 7, "3": -1} and extra["updates_short"] == 2
    assert extra["lost_workers"][0]["rank"] == 4
    # no geometry: no key (older readers took a missing one, not a null, for "none")
    Checkpoint(np.ones(2, np.float32), {}, 9, 1.0).save(tmp_path)
    with np.load(tmp_path / CHECKPOINT) as f:
        assert "geometry" not in json.loads(f["meta"].tobytes().decode())["extra"]


@pytest.mark.parametrize("extra", [{"staleness": {"1": "many"}}, {"rng": {"zero": [1]}},
                                   {"geometry": {"world_size": 2}}, {"lost_workers": [3]}])
def test_a_malformed_record_is_an_unreadable_checkpoint(tmp_path, extra):
    write_old_format(tmp_path, extra)
    with pytest.raises(ResultsError, match="unreadable checkpoint"):
        Checkpoint.load(tmp_path)


def test_the_workers_compression_states_round_trip_and_older_files_have_none(tmp_path):
    codecs = {1: np.arange(5, dtype=np.float32), 2: np.full(5, -0.5, np.float32)}
    Checkpoint(np.ones(2, np.float32), {}, 9, 1.0, codecs=codecs).save(tmp_path)
    back = Checkpoint.load(tmp_path).codecs
    assert sorted(back) == [1, 2] and all(back[r].tobytes() == codecs[r].tobytes()
                                          for r in codecs)
    Checkpoint(np.ones(2, np.float32), {}, 9, 1.0).save(tmp_path)
    assert Checkpoint.load(tmp_path).codecs == {}
