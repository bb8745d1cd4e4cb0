"""TensorFlow and Keras imported the quick way (mpitrain.models.keras_import): less is
loaded at start-up, and everything stays usable."""

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO
from mpitrain.models.keras_import import (_forward_references_compiled_once, _LazyLoader,
                                          is_api_package, loads_lazily, onednn_hint)

PROBE = """
import json, sys
{how}
before = len(sys.modules)
found = {{"modules": before,
          "skipped_sklearn": "sklearn" not in sys.modules,
          "feature_columns_loaded": "tensorflow.python.feature_column.feature_column_v2"
                                    in sys.modules}}
import sklearn.datasets, tensorflow as tf, keras
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
found["outputs"] = list(model(tf.data.Dataset.from_tensors([[1.0, 2.0, 3.0]]).get_single_element()).shape)
found["legacy_keras_loaded"] = "tensorflow.python.keras" in sys.modules  # tf.nn was used
found["cell"] = tf.nn.RNNCellDeviceWrapper.__name__  # tf.nn's re-export of legacy tf.keras
found["column"] = tf.feature_column.numeric_column("x").key  # a lazy package, used
found["mwms"] = tf.distribute.MultiWorkerMirroredStrategy.__name__
found["v1"] = tf.compat.v1.nn.relu(tf.constant([-1.0, 2.0])).numpy().tolist()
import typing
found["typing_as_it_was"] = "compile" not in vars(typing)
from tensorflow.python.ops import gen_math_ops
found["type_variable"] = [str(c) for c in gen_math_ops.TV_Abs_T.__constraints__]
tf.compat.v1.reset_default_graph()  # as keras.backend.clear_session() does
print(json.dumps(found))
"""


def probe(how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(how=how)], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh TensorFlow imports; quick: every launch of the quick tier
def test_the_quick_import_loads_less_and_everything_still_works():  # imports this way
    quick = probe("from mpitrain.models import import_keras; import_keras()")
    plain = probe("import tensorflow, keras")
    # measured: about 2,100 modules instead of 3,800 (TF 2.21, Keras 3)
    assert quick["modules"] < 0.8 * plain["modules"], (quick, plain)
    assert quick["skipped_sklearn"] and not plain["skipped_sklearn"]
    assert not quick["feature_columns_loaded"] and plain["feature_columns_loaded"]
    assert not quick["legacy_keras_loaded"] and plain["legacy_keras_loaded"]
    for found in (quick, plain):
        assert found["column"] == "x" and found["outputs"] == [1, 2]
        assert found["mwms"] == "CollectiveAllReduceStrategy"  # tf.distribute is the API
        assert found["v1"] == [0.0, 2.0]
        assert found["cell"] == "DeviceWrapper"
        assert found["typing_as_it_was"]
    # TensorFlow's type variables hold the same forward references either way
    assert quick["type_variable"] == plain["type_variable"]
    assert "ForwardRef('_atypes.Float32')" in quick["type_variable"], quick


def test_forward_references_are_compiled_once_inside_the_block_only():
    import typing
    with _forward_references_compiled_once():
        a, b = typing.ForwardRef("_atypes.Float32"), typing.ForwardRef("_atypes.Float32")
        assert a.__forward_code__ is b.__forward_code__  # one compile, shared
        assert a == b and a.__forward_arg__ == "_atypes.Float32"
        with pytest.raises(SyntaxError):  # as without the cache
            typing.ForwardRef("not python (")
        with _forward_references_compiled_once():  # nested: the outer cache stays
            pass
        assert "compile" in vars(typing)
    assert "compile" not in vars(typing)
    a, b = typing.ForwardRef("_atypes.Float32"), typing.ForwardRef("_atypes.Float32")
    assert a.__forward_code__ is not b.__forward_code__  # the builtin again
    namespace = {"_atypes": type("atypes", (), {"Float32": float})}
    assert typing._eval_type(a, namespace, namespace) is float


@pytest.mark.parametrize("name,api", [
    ("tensorflow._api.v2.data", True), ("tensorflow._api.v2.__internal__.distribute", True),
    ("keras.layers", True), ("keras._tf_keras.keras", True), ("tensorflow._api.v2.compat", True),
    ("tensorflow._api.v2.compat.v1.nn", True),
    ("tensorflow", False), ("tensorflow.python.data.ops.dataset_ops", False),
    ("keras", False), ("keras.src.layers", False), ("kerasx.layers", False)])
def test_api_packages_are_the_generated_ones(name, api):
    assert is_api_package(name) is api


def test_packages_named_like_a_real_tensorflow_package_load_at_once(tmp_path):
    (tmp_path / "lite").mkdir()  # as tensorflow/lite: a real package beside the API
    for name in ("tensorflow._api.v2.lite", "tensorflow._api.v2.lite.experimental"):
        assert not loads_lazily(name, [str(tmp_path / "missing"), str(tmp_path)])
    assert loads_lazily("tensorflow._api.v2.data", [str(tmp_path)])
    assert loads_lazily("keras.layers", [str(tmp_path)])
    assert not loads_lazily("tensorflow.python.data", [str(tmp_path)])


def lazy_package(directory, name: str, source: str):
    """``name`` (a package in ``directory`` whose __init__ is ``source``), loaded as the
    lazy finder loads an API package."""
    (directory / name).mkdir()
    (directory / name / "__init__.py").write_text(source)
    (directory / name / "sub.py").write_text("VALUE = 3\n")
    spec = importlib.util.spec_from_file_location(name, directory / name / "__init__.py",
                                                  submodule_search_locations=[str(directory / name)])
    spec.loader = _LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_package_of_reexports_binds_one_name_at_a_time(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "heavy_dep.py").write_text("import sys\nLOADED = True\n")
    api = lazy_package(tmp_path, "api_pkg", '"""An API."""\nimport sys as _sys\n'
                       "from json import dumps as to_json\nfrom heavy_dep import LOADED\n"
                       "from api_pkg import sub\n")
    try:
        assert api.to_json([1]) == "[1]"
        assert "heavy_dep" not in sys.modules  # its line did not run
        assert api.sub.VALUE == 3  # a submodule imported by the package itself
        assert api.LOADED and "heavy_dep" in sys.modules
        with pytest.raises(AttributeError):
            api.missing  # the rest runs; a name it lacks is an AttributeError
    finally:
        for name in ("api_pkg", "api_pkg.sub", "heavy_dep"):
            sys.modules.pop(name, None)


def test_dir_of_a_lazy_package_lists_the_names_it_will_bind(tmp_path, monkeypatch):
    """dir() shows every name, bound or not (vars() only the bound ones): what code that
    looks for a package's classes by name relies on (mpitrain.horovod.keras.load_model
    finds Keras' optimizers so)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    api = lazy_package(tmp_path, "api_dir_pkg", "from json import dumps as to_json\n"
                       "from json import loads\n")
    try:
        assert "to_json" not in vars(api) and {"to_json", "loads"} <= set(dir(api))
        assert api.to_json([1]) == "[1]" and "to_json" in vars(api)
    finally:
        for name in ("api_dir_pkg", "api_dir_pkg.sub"):
            sys.modules.pop(name, None)


def test_a_package_that_does_more_than_import_runs_whole(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    api = lazy_package(tmp_path, "compat_pkg", "from json import dumps\nFLAG = 1\n")
    try:
        assert api.dumps(2) == "2" and api.__dict__["FLAG"] == 1
    finally:
        sys.modules.pop("compat_pkg", None)


FILTER = """
import os, sys
from mpitrain.models.keras_import import _stderr_without
print("before", file=sys.stderr, flush=True)
with _stderr_without((b"custom operations are on", b"before absl")):
    os.write(2, b"I0000 port.cc] oneDNN custom operations are on.\\nkept from C\\n")
    print("kept from Python", file=sys.stderr)
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called\\n")
    os.write(2, b"no newline at the end")
print("after", file=sys.stderr)
"""


def test_the_import_filter_drops_the_notices_and_passes_on_everything_else():
    out = subprocess.run([sys.executable, "-c", FILTER], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ("before\nkept from C\nkept from Python\nno newline at the end"
                          "after\n")


ONEDNN = """
import json, os, sys
{how}
from mpitrain.models.keras_import import onednn_enabled
print(json.dumps({{"onednn": onednn_enabled(), "env": os.environ.get("TF_ENABLE_ONEDNN_OPTS")}}))
"""


def onednn_probe(how: str, **env) -> tuple:
    out = subprocess.run([sys.executable, "-c", ONEDNN.format(how=how)], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.slow  # three fresh TensorFlow imports
def test_tensorflow_loads_with_onednn_quietly_unless_the_user_said_otherwise():
    quick = "from mpitrain.models import import_keras; import_keras()"
    found, stderr = onednn_probe(quick)
    assert found == {"onednn": True, "env": "1"} and stderr == ""
    found, stderr = onednn_probe(quick, TF_ENABLE_ONEDNN_OPTS="0")
    assert found == {"onednn": False, "env": "0"} and stderr == ""
    # TensorFlow imported first: too late for mpitrain's default, so TensorFlow's own stands
    found, _ = onednn_probe("import tensorflow\n" + quick)
    assert found["onednn"] is tensorflow_default_onednn()


def tensorflow_default_onednn() -> bool:
    """TensorFlow's own default on Linux x86 (IsMklEnabled in tensorflow/core/util/port.cc):
    oneDNN on only for CPUs with neural-network instructions, so the expectation follows
    this machine's CPU (off on an AVX2 EPYC, on on a Sapphire Rapids)."""
    with open("/proc/cpuinfo") as cpuinfo:
        flags = set(next(line for line in cpuinfo if line.startswith("flags")).split())
    return bool(flags & {"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
                         "amx_bf16"})


def test_the_onednn_hint_names_the_ranks_without_it(monkeypatch):
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    facts = [{"onednn": True}, {"onednn": False}, {"onednn": None}, {"onednn": False}]
    assert "rank(s) 1, 3:" in onednn_hint(facts) and "import mpitrain first" in onednn_hint(facts)
    assert onednn_hint([{"onednn": True}, {"onednn": None}]) == ""
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")  # the user turned them off
    assert onednn_hint(facts) == ""
