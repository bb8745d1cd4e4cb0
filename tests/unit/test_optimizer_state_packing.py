"""How sync workers send the optimizer state at checkpoints and rank 0 broadcasts it on
resume: one byte vector, every variable in its own dtype (pure logic; the bit-exact
resumes that depend on it run end to end in test_faults and test_your_model)."""

import numpy as np

from mpitrain.train.sync import _pack, _packed_size, _unpack

# o10 after o2: the optimizer's order is numeric, not the names' alphabetical one
LAYOUT = {"o0": ((), "int64"), "o1": ((3, 2), "float32"), "o10": ((4,), "float64"),
          "o2": ((5,), "float32")}


def test_every_variable_comes_back_bit_for_bit_in_its_dtype():
    state = {"o0": np.int64(2**40 + 3),  # beyond float32's exact integers
             "o1": np.arange(6, dtype=np.float32).reshape(3, 2) / 7,
             "o2": np.float32([1e-30, -0.0, np.inf, 3.3, 7]),
             "o10": np.float64([1 / 3, 2, 3, 4])}
    back = _unpack(_pack(state, LAYOUT), LAYOUT)
    for name, value in state.items():
        value = np.asarray(value)
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert back[name].tobytes() == value.tobytes(), name


def test_float32_slots_travel_as_four_bytes():
    packed = _pack({name: np.zeros(shape, dtype) for name, (shape, dtype) in LAYOUT.items()},
                   LAYOUT)
    assert packed.dtype == np.uint8 and packed.size == _packed_size(LAYOUT) == 8 + 24 + 32 + 20


def test_a_state_saved_in_another_dtype_is_sent_in_the_layouts():
    # a checkpoint's arrays are cast to the running optimizer's dtypes
    state = {name: np.ones(shape, np.float64) for name, (shape, _) in LAYOUT.items()}
    back = _unpack(_pack(state, LAYOUT), LAYOUT)
    assert back["o1"].dtype == np.float32 and back["o0"].dtype == np.int64
    assert float(back["o1"].sum()) == 6.0
