"""The suite's own order (tests/conftest.py): longest files first."""

from types import SimpleNamespace

from conftest import longest_files_first


def ids(*nodeids, slow=()):
    return [SimpleNamespace(nodeid=n, keywords={"slow": 1} if n in slow else {})
            for n in nodeids]


def test_files_go_longest_first_and_keep_their_tests_together_in_order():
    items = ids("a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2")
    seconds = {"a.py::t1": 1, "a.py::t2": 1, "b.py::t1": 5, "c.py::t1": 0.5, "c.py::t2": 9}
    longest_files_first(items, seconds)
    assert [i.nodeid for i in items] == ["c.py::t1", "c.py::t2", "b.py::t1", "a.py::t1",
                                         "a.py::t2"]


def test_only_the_selected_tests_count_and_unknown_ones_count_nothing():
    # b.py's long test was deselected (-m "not slow"): b.py now weighs 1 s, after a.py
    items = ids("a.py::t1", "b.py::quick", "d.py::new")
    longest_files_first(items, {"a.py::t1": 2, "b.py::quick": 1, "b.py::slow": 100})
    assert [i.nodeid for i in items] == ["a.py::t1", "b.py::quick", "d.py::new"]



def test_a_file_with_an_unmeasured_slow_test_goes_first():
    # e.g. a renamed or new benchmark smoke: maybe long, and a long file last idles a worker
    items = ids("a.py::t1", "b.py::quick", "b.py::renamed", "c.py::new", slow={"b.py::renamed"})
    longest_files_first(items, {"a.py::t1": 50, "b.py::quick": 1})
    assert [i.nodeid for i in items] == ["b.py::quick", "b.py::renamed", "a.py::t1",
                                         "c.py::new"]
