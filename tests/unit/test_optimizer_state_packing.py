"""How sync workers send the optimizer state at checkpoints and rank 0 broadcasts it on
resume: one byte vector, every variable in its own dtype (pure logic; the bit-exact
resumes that depend on it run end to end in test_faults and test_your_model)."""

import numpy as np

from mpitrain.train.sync_server import pack_state, packed_size, unpack_state

# o10 after o2: the optimizer's order is numeric, not the names' alphabetical one
LAYOUT = {"o0": ((), "int64"), "o1": ((3, 2), "float32"), "o10": ((4,), "float64"),
          "o2": ((5,), "float32")}


def test_every_variable_comes_back_bit_for_bit_in_its_dtype():
    state = {"o0": np.int64(2**40 + 3),  # beyond float32's exact integers
             "o1": np.arange(6, dtype=np.float32).reshape(3, 2) / 7,
             "o2": np.float32([1e-30, -0.0, np.inf, 3.3, 7]),
             "o10": np.float64([1 / 3, 2, 3, 4])}
    back = unpack_state(pack_state(state, LAYOUT), LAYOUT)
    for name, value in state.items():
        value = np.asarray(value)
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert back[name].tobytes() == value.tobytes(), name


def test_float32_slots_travel_as_four_bytes():
    packed = pack_state({name: np.zeros(shape, dtype) for name, (shape, dtype) in LAYOUT.items()},
                   LAYOUT)
    assert packed.dtype == np.uint8 and packed.size == packed_size(LAYOUT) == 8 + 24 + 32 + 20


def test_a_state_saved_in_another_dtype_is_sent_in_the_layouts():
    # a checkpoint's arrays are cast to the running optimizer's dtypes
    state = {name: np.ones(shape, np.float64) for name, (shape, _) in LAYOUT.items()}
    back = unpack_state(pack_state(state, LAYOUT), LAYOUT)
    assert back["o1"].dtype == np.float32 and back["o0"].dtype == np.int64
    assert float(back["o1"].sum()) == 6.0


def test_a_saved_state_that_does_not_fit_the_layout_is_named():
    """Resume refuses a checkpoint's optimizer state unless it has the layout's names with
    their sizes (dtypes may differ: _pack casts)."""
    from mpitrain.errors import UsageError
    from mpitrain.run.checkpoint import optimizer_mismatch

    fits = {"o0": np.int64(5), "o1": np.zeros((3, 2), np.float64), "o10": np.zeros(4),
            "o2": np.zeros(5, np.float32)}
    assert optimizer_mismatch(fits, LAYOUT, "run") is None
    for bad in ({**fits, "o3": np.zeros(1)}, {**fits, "o2": np.zeros(6)},
                {k: v for k, v in fits.items() if k != "o10"}):
        error = optimizer_mismatch(bad, LAYOUT, "run")
        assert isinstance(error, UsageError) and "--resume run" in str(error) \
            and "does not fit this run's optimizer (4, 16 values)" in str(error)
